"""docs/recipes.md is generated from the schema; these tests keep the two in step."""

import typing
from pathlib import Path

from pydantic import BaseModel

from ligertune.config import Recipe
from ligertune.config.docs import render

DOC = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"


def _models(annotation) -> list[type[BaseModel]]:
    """The section models a field holds: itself, the one model of an optional section (lora), or
    every member of a section that is one of several (objective, parallel)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    members = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]


def leaf_keys(model: type[BaseModel], prefix: str = "", top: bool = True):
    for name, field in model.model_fields.items():
        # nested model sections (a reference model) are one row of their own
        models = _models(field.annotation) if top or _models(field.annotation) == [field.annotation] else []
        if models:
            for section in models:
                yield from leaf_keys(section, f"{prefix}{name}.", top=False)
        else:
            yield f"{prefix}{name}"


def test_recipe_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == render(), "run: python scripts/gen_recipe_docs.py"


def test_reference_lists_every_key():
    text = DOC.read_text(encoding="utf-8")
    missing = [key for key in leaf_keys(Recipe) if f"| `{key}` |" not in text]
    assert not missing, missing


def test_types_read_as_types_and_rules_read_whole():
    """No pydantic internals in a type (training.adam_betas printed its Annotated metadata), and
    each rule's text is its whole first paragraph (lora.combinations was cut mid-sentence)."""
    text = DOC.read_text(encoding="utf-8")
    assert "| `training.adam_betas` | tuple[float, float] |" in text
    assert "Annotated" not in text and "metadata=" not in text
    combinations = next(line for line in text.splitlines() if line.startswith("| `lora.combinations`"))
    assert combinations.endswith("export.merge_lora needs lora. |")
    assert "JSON/JSONL/Parquet/CSV" in text
