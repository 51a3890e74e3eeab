"""Resumable checkpoints, written atomically.

Layout under ``<run_dir>/checkpoints``::

    step-120/
        model.pt        model state dict (torch.save; tied weights stay tied)
        trainer.pt      optimizer and LR-scheduler state, RNG states (python, numpy, torch CPU/CUDA)
        state.json      step, data position (epoch, next micro-batch) and run facts, human-readable
        recipe.yaml     the fully resolved recipe the run used
        COMPLETE        written last; a directory without it is never loaded
    .tmp-step-140/      a save in progress (or one killed half way): ignored

Atomicity: a checkpoint is written into ``.tmp-step-N``, every file is fsync'd, the
``COMPLETE`` marker goes in last, and the directory is renamed to ``step-N`` (a rename within
one filesystem is atomic). A process killed at any point leaves either the previous set of
complete checkpoints untouched, or the new one complete as well; ``resume: auto`` only looks
at complete ``step-N`` directories, and leftover ``.tmp-*`` directories are removed by the
next successful save. Old checkpoints are pruned (``keep_last``) only after the new one is in
place, so at least one complete checkpoint always exists once the first save finished.

Everything is loaded with ``torch.load(weights_only=True)``: no pickled code runs on resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it replaces `final` in one
    rename. On an exception the temporary directory is removed and `final` is untouched.

    Replacing an existing `final` needs two renames (old out of the way, new in); a crash
    between them leaves `final` missing but the old copy intact under ``.old-<name>``.
    """
    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                _fsync(path)
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Every random generator the run touches, in a form `torch.load(weights_only=True)` reads."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    # random.setstate needs tuples all the way down; serialisation may hand back lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# --------------------------------------------------------------------------------------------
# Save, find, load
# --------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    state: dict[str, Any]
    recipe_yaml: str

    @property
    def step(self) -> int:
        return self.state["step"]


def step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    return step_of(path) is not None and (path / COMPLETE).is_file()


class CheckpointManager:
    """Saves, lists and prunes the checkpoints of one run directory."""

    def __init__(self, root: Path, keep_last: int):
        self.root = root
        self.keep_last = keep_last

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if is_complete(p)), key=step_of)

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(
        self,
        step: int,
        *,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        state: dict[str, Any],
        recipe_yaml: str,
    ) -> Path:
        """Write checkpoint `step` atomically, then prune to `keep_last`. Returns its path."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        with atomic_directory(final) as tmp:
            torch.save(model, tmp / "model.pt")
            torch.save(
                {"optimizer": optimizer, "scheduler": scheduler, "rng": capture_rng_state()},
                tmp / "trainer.pt",
            )
            (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2) + "\n")
            (tmp / "recipe.yaml").write_text(recipe_yaml)
            (tmp / COMPLETE).write_text(f"{step}\n")
        self._prune()
        return final

    def _prune(self) -> None:
        for path in self.complete()[: -self.keep_last]:
            shutil.rmtree(path)
        # Half-written saves of processes that were killed; this process's own save is done.
        for path in self.root.glob(".tmp-step-*"):
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a complete checkpoint (tensors on the CPU). Raises ValueError naming what is wrong."""
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / COMPLETE).is_file():
        raise ValueError(
            f"checkpoint {path} is incomplete (no {COMPLETE} marker: its save was interrupted); "
            "resume from an older one or use checkpoint.resume=auto"
        )
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    return Checkpoint(
        path=path,
        model=torch.load(path / "model.pt", map_location="cpu", weights_only=True),
        optimizer=trainer["optimizer"],
        scheduler=trainer["scheduler"],
        rng=trainer["rng"],
        state=json.loads((path / "state.json").read_text()),
        recipe_yaml=(path / "recipe.yaml").read_text(),
    )
