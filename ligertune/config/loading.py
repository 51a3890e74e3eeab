"""Reading a recipe: YAML → command-line overrides → pydantic schema → rules, with errors a user can act on.

Loading goes: ``yaml.safe_load`` → command-line overrides (``training.lr=2e-5``) applied to the
raw mapping → pydantic validation → the recipe rules of `ligertune.config.rules`. Every failure
raises `RecipeError` with one line per problem, each naming the dotted key, before any model,
data or GPU work starts. The CLI prints those lines and exits with status 2.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ligertune.config.rules import recipe_problems
from ligertune.config.schema import KernelsSection, Recipe
from ligertune.errors import RecipeError
from ligertune.paths import RECIPES_DIR


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """``training.lr=2e-5`` → (["training", "lr"], 2e-05). Values are parsed as YAML."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError([f"{item}: an override is written section.key=value, e.g. training.lr=2e-5"])
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise RecipeError([f"{key}: cannot parse value {raw!r} as YAML ({e.problem})"]) from None
        parsed.append((key.split("."), value))
    return parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for keys, value in parse_overrides(overrides):
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None or isinstance(child, str) and key == "kernels":
                # `kernels: all` followed by `kernels.rope=false`: expand the preset first.
                child = {} if child is None else KernelsSection.preset(child).model_dump()
                node[key] = child
            if not isinstance(child, dict):
                path = ".".join(keys[: depth + 1])
                raise RecipeError([f"{'.'.join(keys)}: {path} is {child!r}, not a section with keys"])
            node = child
        node[keys[-1]] = value
    return raw


def _model_at(loc: tuple, root: type[BaseModel] = Recipe) -> type[BaseModel] | None:
    """The pydantic model class whose fields live at `loc` (a ValidationError location)."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = next(
            (
                a
                for a in getattr(annotation, "__args__", (annotation,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            annotation,
        )
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _describe_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
    dotted = ".".join(str(p) for p in loc) or "recipe"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        valid = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        prefix = ".".join(str(p) for p in loc[:-1])
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
        return f"{dotted}: unknown key{hint} (valid keys here: {', '.join(valid)})"
    if kind == "missing":
        return f"{dotted}: required key is missing"
    if kind == "literal_error":
        allowed = err.get("ctx", {}).get("expected", "")
        return f"{dotted}: got {given!r}; allowed: {allowed}"
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{dotted}: {msg}"
    return f"{dotted}: got {given!r}; {err['msg'].lower()}"


def validate_recipe(raw: Any, source: str | None = None, base_dir: Path | None = None) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(
            [f"the recipe must be a YAML mapping of sections, got {type(raw).__name__}"], source
        )
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError([_describe_error(err) for err in e.errors()], source) from None
    recipe._base_dir = base_dir
    problems = recipe_problems(recipe)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError with every problem found."""
    path = Path(path)
    if not path.exists():
        shipped = RECIPES_DIR / path.name
        raise RecipeError(
            [f"recipe file not found: {path}"]
            + (
                [f"a shipped recipe has that name: {shipped}"]
                if shipped.exists() and shipped != path.resolve()
                else []
            )
        )
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise RecipeError(["the file is not UTF-8 text"], str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError([f"not valid YAML{where}: {getattr(e, 'problem', e)}"], str(path)) from None
    if raw is None:
        raw = {}
    if isinstance(raw, dict) and overrides:
        raw = apply_overrides(raw, overrides)
    return validate_recipe(raw, str(path), path.resolve().parent)


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
