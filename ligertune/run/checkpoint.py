"""Resumable checkpoints, written atomically, by one process or by every rank of a job.

Layout under ``<run_dir>/checkpoints``::

    step-120/
        model.pt        format "full" (strategies none, ddp): the model state dict (tied
        optimizer.pt    weights stay tied) and the optimizer state dict, written by rank 0
        dcp/            format "dcp" (fsdp): model and optimizer shards, torch.distributed.checkpoint
        deepspeed/      format "deepspeed": DeepSpeed's own ZeRO checkpoint
        trainer.pt      LR-scheduler state
        rng-rank<R>.pt  RNG states (python, numpy, torch CPU/CUDA) of each rank
        state.json      step, data position (epoch, next micro-batch), format, world size and run
                        facts, human-readable
        recipe.yaml     the fully resolved recipe the run used
        manifest.json   every other file of the directory with its size and sha256
        COMPLETE        written last; a directory without it is never loaded
    .tmp-step-140/      a save in progress (or one killed half way): ignored

Which of ``model.pt``/``optimizer.pt``, ``dcp/`` or ``deepspeed/`` a checkpoint holds, and how
those are written and read, belongs to the strategy (`ligertune.distributed`); this module
owns everything around them: the directory, its atomicity, the run state and the RNG states.

Atomicity: a checkpoint is written into ``.tmp-step-N``, every file is fsync'd, the
``COMPLETE`` marker goes in last, and the directory is renamed to ``step-N`` (a rename within
one filesystem is atomic). A process killed at any point leaves either the previous set of
complete checkpoints untouched, or the new one complete as well; ``resume: auto`` only looks
at complete ``step-N`` directories, and leftover ``.tmp-*`` directories are removed by the
next successful save. Old checkpoints are pruned (``keep_last``) only after the new one is in
place, so at least one complete checkpoint always exists once the first save finished.

Several processes: rank 0 creates the temporary directory, every rank writes its part into it
(its shards, its RNG states) and fsyncs what it sees there, then rank 0 writes the run state
and the marker and renames; barriers separate the phases, so no rank reads or prunes a
directory another is still writing. Every rank must see the same directory: on several nodes
``output_dir`` has to be on a shared filesystem.

Damage after the fact (a truncated copy, a disk error, a file edited by hand) is what the
manifest is for: just before ``COMPLETE``, rank 0 records the size and sha256 of every file in
the directory (every rank's, so on several nodes it reads the shared filesystem), and
`verify_checkpoint` checks them, sizes first (a truncation costs nothing to find), then the
digests. sha256 and not a cheaper checksum: measured on a Xeon with SHA extensions it hashes
1.3 GB/s per core against 2.2 GB/s for zlib's crc32, so the cheap one would save well under
half of a cost that is of the order of writing the files in the first place; in exchange the
digests are the standard ones (``sha256sum`` checks a copied checkpoint), and files are hashed
in parallel threads (hashlib releases the GIL). A checkpoint written before manifests existed
is verified as far as it can be: ``state.json`` parses, every file reads to its end, and every
``.pt`` file is a whole zip archive whose records match their CRCs (``torch.save`` writes them).

Disk full: an ``ENOSPC``/``EDQUOT`` during a save removes the temporary directory (the last
good checkpoint is never touched: nothing replaces or prunes it before the new one is
complete) and raises `TrainingError` naming the directory, the step and the checkpoint to
resume from. ``torch.save`` reports a failed write as a bare ``RuntimeError`` ("unexpected
pos", "PytorchStreamWriter failed writing file") with no errno and no cause chain, so such an
error is taken for a full disk when the filesystem has (almost) no free space left
(`shutil.disk_usage`), checked before the partial files are removed.

Everything is loaded with ``torch.load(weights_only=True)``: no pickled code runs on resume.
The sharded formats' own files are read the same way (`ligertune.run.safe_load`).

Links: a symbolic link under one of our names (``step-N``, ``.tmp-*``, ``.old-*``) is never
followed. Listing skips links (`complete` lists real folders only), and replacing or pruning
removes a link itself (`ligertune.files.remove_tree`), never what it points at; a run refuses
such links up front (`ligertune.run.lock`).

Any other failure to write a checkpoint (a read-only or unmounted ``output_dir``, a permission
taken away mid-run) is a `TrainingError` of one line naming the file and the last good
checkpoint, like a full disk; a failure to prune an old checkpoint is a warning (the new one is
saved: nothing is lost but disk space).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ligertune.errors import TrainingError
from ligertune.files import describe_os_error, real_directories, remove_tree
from ligertune.run.loggers import LOGGER
from ligertune.run.manifest import (
    COMPLETE,
    STATE_FILE,
    DamagedCheckpoint,
    load_file,
    read_state,
    require_complete,
    verify_checkpoint,
    write_manifest,
)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_FILE = "trainer.pt"
FULL_FORMAT = "full"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
# Below this much free space, a failed torch.save is a full disk: a write that ran out of space
# has used up what was left (a block or so), while any other failure leaves the disk as it was.
_NEARLY_FULL = 64 * 2**20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            _fsync(path)
    _fsync(root)


def _temporary(final: Path) -> Path:
    return final.with_name(f".tmp-{final.name}")


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it replaces `final` in one
    rename. On an exception the temporary directory is removed and `final` is untouched.

    Replacing an existing `final` needs two renames (old out of the way, new in); a crash
    between them leaves `final` missing but the old copy intact under ``.old-<name>``.
    """
    tmp = _temporary(final)
    remove_tree(tmp)  # a leftover, or a link in its place: the link goes, never what it points at
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_tree(tmp)
        raise
    old = final.with_name(f".old-{final.name}")
    if os.path.lexists(final):  # rename moves a link itself; remove_tree then unlinks it
        remove_tree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    remove_tree(old)


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


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def missing_rng_files(path: Path, ranks: int) -> list[str]:
    """The RNG files of ranks 0..`ranks`-1 that checkpoint `path` lacks (a checkpoint saved
    before manifests existed, or copied without them): a resume then cannot restore those
    ranks' random state and says so."""
    return [name for name in map(_rng_file, range(ranks)) if not (path / name).is_file()]


# --------------------------------------------------------------------------------------------
# Save, find, load
# --------------------------------------------------------------------------------------------


class ProcessGroup(Protocol):
    """What a save needs to know about the job: `ligertune.distributed.Runtime` is one."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...

    def barrier(self) -> None: ...


class _OneProcess:
    rank, world_size, is_main = 0, 1, True

    def barrier(self) -> None:
        pass


@contextlib.contextmanager
def _full_disk_as_oserror(directory: Path) -> Iterator[None]:
    """Turn torch.save's errno-less RuntimeError for a failed write into the OSError(ENOSPC) it
    stands for when the filesystem is (nearly) full. Asked while the partial files still fill
    it: the caller's atomic directory removes them afterwards."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, TrainingError):
            raise
        try:
            full = shutil.disk_usage(directory).free < _NEARLY_FULL
        except OSError:
            full = False
        if full:
            raise OSError(
                errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (torch.save: {e})", str(directory)
            ) from e
        raise


def write_full_state(directory: Path, model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
    """The "full" format: whole model and optimizer state dicts, one file each."""
    torch.save(model, directory / MODEL_FILE)
    torch.save(optimizer, directory / OPTIMIZER_FILE)


@dataclass
class Checkpoint:
    """A complete checkpoint, as one rank reads it. The run state is read at once; the model
    and optimizer state dicts of the "full" format only when asked for (a sharded format has
    none: its strategy reads its own files under `path`)."""

    path: Path
    scheduler: dict[str, Any]
    rng: dict[str, Any] | None  # this rank's RNG states; None if the saving job had no such rank
    state: dict[str, Any]
    recipe_yaml: str

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def format(self) -> str:
        return self.state.get("format", FULL_FORMAT)

    @property
    def world_size(self) -> int:
        return self.state.get("world_size", 1)

    @cached_property
    def model(self) -> dict[str, torch.Tensor]:
        return load_file(self._full_file(MODEL_FILE))

    @cached_property
    def optimizer(self) -> dict[str, Any]:
        return load_file(self._full_file(OPTIMIZER_FILE))

    def _full_file(self, name: str) -> Path:
        if self.format != FULL_FORMAT:
            raise ValueError(
                f"checkpoint {self.path} is in the {self.format!r} format (sharded); it has no {name}"
            )
        return self.path / name


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
        """Complete checkpoints, oldest first: real folders only (a link named step-N is not
        ours, and is never loaded from or pruned through)."""
        return sorted((p for p in real_directories(self.root) if is_complete(p)), key=step_of)

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def newest_intact(self) -> tuple[Path | None, list[str]]:
        """The newest complete checkpoint that `verify_checkpoint` passes (`resume: auto`, and
        `generate`), and what is wrong with each newer one, passed over as damaged. None when no
        checkpoint is intact (the list then says why each one is not)."""
        damaged: list[str] = []
        for candidate in reversed(self.complete()):
            try:
                verify_checkpoint(candidate)
            except ValueError as e:
                damaged.append(str(e))
                continue
            return candidate, damaged
        return None, damaged

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
        """Write checkpoint `step` of a single process, in the "full" format, atomically,
        then prune to `keep_last`. Returns its path."""
        return self.save_from(
            _OneProcess(),
            step,
            write_state=lambda directory: write_full_state(directory, model, optimizer),
            format=FULL_FORMAT,
            scheduler=scheduler,
            state=state,
            recipe_yaml=recipe_yaml,
        )

    def save_from(
        self,
        group: ProcessGroup,
        step: int,
        *,
        write_state: Callable[[Path], None],
        format: str,
        scheduler: dict[str, Any],
        state: dict[str, Any],
        recipe_yaml: str,
    ) -> Path:
        """Write checkpoint `step` with every rank of `group` taking part (collective: every
        rank calls it). `write_state(directory)` writes the model and optimizer state in
        `format`; it runs on every rank, which writes its own part (or nothing). Atomic as
        described in the module docstring; prunes to `keep_last`. Returns the path."""
        final = self.path_for(step)
        tmp = _temporary(final)
        last_good = self.latest()
        directory_of_main = atomic_directory(final) if group.is_main else contextlib.nullcontext(tmp)
        try:
            with directory_of_main as directory, _full_disk_as_oserror(directory):
                group.barrier()  # rank 0 has made the directory
                write_state(directory)
                torch.save(capture_rng_state(), directory / _rng_file(group.rank))
                if not group.is_main:
                    # Each rank flushes what it wrote from its own node; rank 0 flushes on commit.
                    _fsync_tree(directory)
                group.barrier()  # every rank's part is in
                if group.is_main:
                    record = {**state, "step": step, "format": format, "world_size": group.world_size}
                    torch.save({"scheduler": scheduler}, directory / TRAINER_FILE)
                    (directory / STATE_FILE).write_text(json.dumps(record, indent=2) + "\n")
                    (directory / "recipe.yaml").write_text(recipe_yaml)
                    write_manifest(directory)
                    (directory / COMPLETE).write_text(f"{step}\n")
        except OSError as e:
            kept = (
                f"the last good checkpoint {last_good} is intact"
                if last_good
                else "no earlier checkpoint exists"
            )
            if e.errno in _OUT_OF_SPACE:
                what = "no space left" if e.errno == errno.ENOSPC else "disk quota exceeded"
                raise TrainingError(
                    f"{what} on {self.root} while saving step {step}; {kept}; free space and resume"
                ) from e
            raise TrainingError(
                f"cannot save step {step} in {self.root}: {describe_os_error(e)}; {kept}; fix that and resume"
            ) from e
        if group.is_main:
            self._prune()
        group.barrier()  # nobody goes on (or resumes, or saves again) before the rename
        return final

    def _prune(self) -> None:
        """Old checkpoints beyond keep_last, and half-written saves of processes that were
        killed (this job's own save is done). A failure is a warning: the new checkpoint is
        saved, and only disk space is lost."""
        for path in [*self.complete()[: -self.keep_last], *self.root.glob(".tmp-step-*")]:
            try:
                remove_tree(path)
            except OSError as e:
                LOGGER.warning(f"warning: cannot remove {path} ({describe_os_error(e)}); remove it by hand")


def load_checkpoint(path: Path, rank: int = 0) -> Checkpoint:
    """Read a complete checkpoint's run state as rank `rank` sees it (tensors on the CPU).
    Raises ValueError naming what is wrong (DamagedCheckpoint for a file that cannot be read).
    It checks no digests: `verify_checkpoint` does, before a resume."""
    require_complete(path)
    rng_path = path / _rng_file(rank)
    try:
        recipe_yaml = (path / "recipe.yaml").read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DamagedCheckpoint(path, f"recipe.yaml cannot be read: {e}") from None
    return Checkpoint(
        path=path,
        scheduler=load_file(path / TRAINER_FILE)["scheduler"],
        rng=load_file(rng_path) if rng_path.is_file() else None,
        state=read_state(path),
        recipe_yaml=recipe_yaml,
    )
