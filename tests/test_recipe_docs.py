"""docs/recipes.md is generated from the schema; these tests keep the two in step."""

import typing
from pathlib import Path

from pydantic import BaseModel

from ligertune.config import Recipe
from ligertune.config.docs import render

DOC = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"


def leaf_keys(model: type[BaseModel], prefix: str = ""):
    """Every key, optional sections (``lora: LoraSection | None``) included."""
    for name, field in model.model_fields.items():
        members = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
        if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
            yield from leaf_keys(members[0], f"{prefix}{name}.")
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
