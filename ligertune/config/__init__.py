"""Recipes: the schema, loading with command-line overrides, and the rules between keys.

    recipe = load_recipe("recipes/quickstart.yaml", ["training.lr=1e-4"])   # RecipeError if invalid

`schema` holds one pydantic model per section (the objective's and the parallel strategy's are
the catalog's, `ligertune.catalog`), `loading` reads YAML and applies overrides, `rules` holds
every rule that relates keys to each other or to the machine (with those each component
declares), and `docs` renders docs/recipes.md from all of it. This package imports neither torch
nor transformers: reading a recipe is instant.
"""

from ligertune.config.loading import (
    apply_overrides,
    load_recipe,
    parse_overrides,
    recipe_to_yaml,
    validate_recipe,
)
from ligertune.config.rules import machine_problems
from ligertune.config.schema import (
    CheckpointSection,
    DataSection,
    KernelsSection,
    LoggingSection,
    ModelSection,
    Recipe,
    TrainingSection,
)
from ligertune.errors import RecipeError
from ligertune.paths import ASSETS_DIR, BUNDLED_PREFIX, looks_local, resolve_path, shipped_recipes

__all__ = [
    "ASSETS_DIR",
    "BUNDLED_PREFIX",
    "CheckpointSection",
    "DataSection",
    "KernelsSection",
    "LoggingSection",
    "ModelSection",
    "Recipe",
    "RecipeError",
    "TrainingSection",
    "apply_overrides",
    "load_recipe",
    "looks_local",
    "machine_problems",
    "parse_overrides",
    "recipe_to_yaml",
    "resolve_path",
    "shipped_recipes",
    "validate_recipe",
]
