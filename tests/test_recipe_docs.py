"""docs/recipes.md is generated from the schema; these tests keep the two in step."""

from pathlib import Path

from pydantic import BaseModel

from ligertune.config import Recipe
from ligertune.config.docs import render

DOC = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"


def leaf_keys(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaf_keys(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_recipe_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == render(), "run: python scripts/gen_recipe_docs.py"


def test_reference_lists_every_key():
    text = DOC.read_text(encoding="utf-8")
    missing = [key for key in leaf_keys(Recipe) if f"| `{key}` |" not in text]
    assert not missing, missing
