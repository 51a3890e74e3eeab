"""Regenerate docs/recipes.md from the recipe schema (ligertune/config/schema.py)."""

from pathlib import Path

from ligertune.config.docs import render

target = Path(__file__).resolve().parent.parent / "docs" / "recipes.md"
target.write_text(render(), encoding="utf-8")
print(f"wrote {target}")
