"""How a recipe names files (bundled assets, local paths and hub ids), and where the shipped
recipes are. Plain path logic, imported by every layer that reads a recipe's paths.

``ligertune://name`` is a file shipped inside the package (``ligertune/assets``: the sample data
and the tokenizer). Other paths expand ``~`` and, when relative, resolve against the working
directory first and the recipe's own directory second. Anything else (``org/name``) is a hub id
and is left to the loaders.
"""

from __future__ import annotations

import os
from pathlib import Path

BUNDLED_PREFIX = "ligertune://"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")


def resolve_path(path: str, base: Path | None = None) -> Path:
    """Turn a recipe path into a filesystem path: bundled assets, ~, or relative to `base`."""
    if path.startswith(BUNDLED_PREFIX):
        return ASSETS_DIR / path[len(BUNDLED_PREFIX) :]
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and base is not None and not p.exists():
        candidate = base / p
        if candidate.exists():
            return candidate
    return p


def looks_local(path: str) -> bool:
    """Whether a name is meant as a local path rather than a hub id like ``org/name``."""
    return (
        path.startswith((BUNDLED_PREFIX, "/", "./", "../", "~"))
        or path.lower().endswith(DATA_SUFFIXES)
        or Path(os.path.expanduser(path)).exists()
    )


# The shipped recipes: the repository's recipes/ in a source checkout (editable install); a
# regular install maps that folder into the package as ligertune/recipes.
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
if not RECIPES_DIR.is_dir():
    RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Shipped recipe name (file stem) → path, sorted by name."""
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}
