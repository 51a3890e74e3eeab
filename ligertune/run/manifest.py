"""What makes a checkpoint trustworthy before it is loaded: the manifest written with it (size and
sha256 of every file) and `verify_checkpoint`, which checks a checkpoint against it, or as far as
it can for one written before manifests existed. `ligertune.run.checkpoint` explains where the
manifest goes in the atomic save and why sha256.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from ligertune.catalog.strategies import STRATEGIES
from ligertune.files import digest_files, digest_problem, files_below

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
STATE_FILE = "state.json"
_READ_CHUNK = 16 * 2**20
# What a checkpoint of each format holds besides its RNG states (`ligertune.run.checkpoint`): the
# strategy's model and optimizer files, the schedule and the recipe. Checked by name for a
# checkpoint saved before manifests existed, which has no list of its own.
REQUIRED_FILES = {s.checkpoint_format: (*s.checkpoint_files, "trainer.pt", "recipe.yaml") for s in STRATEGIES}


# --------------------------------------------------------------------------------------------
# Manifest and verification
# --------------------------------------------------------------------------------------------


class DamagedCheckpoint(ValueError):
    """A checkpoint that carries its ``COMPLETE`` marker but whose files are not those that
    were saved (or cannot be read); the message names the directory, the file and the fault."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"checkpoint {path} is damaged: {problem}")


def _recorded_files(directory: Path) -> list[Path]:
    """Every file of a checkpoint directory but the manifest and the marker, sorted."""
    return files_below(directory, leave_out=(MANIFEST, COMPLETE))


def write_manifest(directory: Path) -> None:
    """Record the size and sha256 of every file in `directory` (see the module docstring)."""
    record = {"algorithm": "sha256", "files": digest_files(directory, leave_out=(MANIFEST, COMPLETE))}
    (directory / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")


def require_complete(path: Path) -> None:
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / COMPLETE).is_file():
        raise ValueError(
            f"checkpoint {path} is incomplete (no {COMPLETE} marker: its save was interrupted); "
            "resume from an older one or use checkpoint.resume=auto"
        )


def read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(path, f"{STATE_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(path, f"{STATE_FILE} cannot be read: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DamagedCheckpoint(path, f"{STATE_FILE} does not record a step")
    return state


def verify_checkpoint(path: Path) -> None:
    """Check that checkpoint `path` is complete and its files are those that were saved.
    Raises ValueError (DamagedCheckpoint for a complete but damaged one) naming what is wrong.
    Reads every file once: as long as a resume's own load."""
    require_complete(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return _verify_without_manifest(path)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(path, f"{MANIFEST} cannot be read: {e!r}") from None
    if not isinstance(files, dict):
        raise DamagedCheckpoint(path, f"{MANIFEST} does not list the files")
    problem = digest_problem(path, files)
    if problem is not None:
        raise DamagedCheckpoint(path, problem)
    read_state(path)
    return None


def _verify_without_manifest(path: Path) -> None:
    """A checkpoint saved before manifests existed: the state parses, every file reads to its
    end, every ``.pt`` file is a whole zip archive whose records match their CRC32s, and the
    files its format always has (`REQUIRED_FILES`) are there: without a list of what was saved,
    a missing optimizer file would otherwise pass, and be refused only by the load, after
    ``resume: auto`` had chosen this checkpoint over an older intact one."""
    state = read_state(path)
    for name in REQUIRED_FILES.get(state.get("format", "full"), ()):
        if not (path / name).exists():
            raise DamagedCheckpoint(path, f"{name} is missing")
    for file in _recorded_files(path):
        name = file.relative_to(path).as_posix()
        try:
            if file.suffix == ".pt":
                with zipfile.ZipFile(file) as archive:
                    bad = archive.testzip()
                if bad is not None:
                    raise DamagedCheckpoint(path, f"{name}: its record {bad} fails its CRC check")
            else:
                with file.open("rb") as f:
                    while f.read(_READ_CHUNK):
                        pass
        except zipfile.BadZipFile as e:
            raise DamagedCheckpoint(path, f"{name} is not a whole torch file ({e}; truncated?)") from None
        except OSError as e:
            raise DamagedCheckpoint(path, f"{name} cannot be read: {e.strerror or e}") from None


def load_file(path: Path) -> Any:
    """`torch.load` of one checkpoint file; a file torch cannot read is a DamagedCheckpoint."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DamagedCheckpoint(path.parent, f"{path.name} is missing") from None
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DamagedCheckpoint(path.parent, f"{path.name} cannot be loaded: {first_line}") from None
