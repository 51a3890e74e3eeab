"""The run directory's lock: one run at a time writes an ``output_dir``.

Two runs on one directory would prune each other's checkpoints (one removes the other's
in-progress ``.tmp-step-*`` save as a leftover of a crash) and interleave their metrics.jsonl.
So a run holds ``<output_dir>/run.lock`` for its whole life: an exclusive ``fcntl.flock`` on
an open file, which the kernel releases when the file is closed, including when the process
dies (``kill -9``, an OOM kill): a lock is never stale, there is nothing to clean up by hand.
The file itself stays behind, unlocked; its content (pid, host, start time) is only there for
the message a second run gets.

A second run fails at once with `TrainingError` (exit status 1), before it writes anything:
the recipe is not wrong, the directory is busy, and the fix is to wait for the other run, stop
it, or choose another ``output_dir``.

In a job of several processes only rank 0 takes the lock: the job's ranks share its directory.
On several nodes ``output_dir`` is on a shared filesystem; Linux maps ``flock`` on NFS to a
POSIX lock the server arbitrates, so the lock holds across nodes there as well. A filesystem
that supports no locks at all gets a warning and an unlocked run, not a refusal.

Before the lock is taken, the names a run writes or deletes in its directory (`RUN_ENTRIES`,
everything in ``checkpoints/``, leftover ``.tmp-*``/``.old-*`` folders) are looked at without
following links (`check_run_directory`): a symbolic link under one of them would turn our
writes, truncations and deletes into those of whatever it points at (``ligertune.files``
explains), so a run refuses it, one line per link, before any work. ``output_dir`` itself may
be a link (a run placed on another disk): that is the user's choice, made in the recipe.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path

from ligertune.errors import RecipeError, TrainingError
from ligertune.files import links_among, open_nofollow

LOCK_FILE = "run.lock"
# What a run writes or deletes directly in its directory (the modules that write them name them
# too; tests/test_faults.py plants a link under each): the lock, metrics (`ligertune.run.metrics`),
# train.log and the metric loggers' files (`ligertune.run.loggers`), checkpoints and the exports.
RUN_ENTRIES = (
    LOCK_FILE,
    "metrics.jsonl",
    "train.log",
    "checkpoints",
    "final",
    "final-merged",
    "tensorboard",
    "wandb",
    "wandb-run-id",
)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the file ("pid unknown" if it has not yet)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 4096).decode())
        return f"pid {record['pid']} on {record['host']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


class RunLock:
    """The lock on one run directory, held from `acquire` until `release` (or the process's end)."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Lock `run_dir` (created if missing) or raise TrainingError naming the run that holds it;
        RecipeError for links where the run writes (`check_run_directory`)."""
        check_run_directory(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise TrainingError(
                f"{run_dir} is in use by another run ({holder}); wait for it to finish, stop it, "
                "or set another output_dir"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            warnings.warn(
                f"cannot lock {path} ({e.strerror}): this filesystem has no file locks, so nothing "
                "stops a second run from writing the same output_dir",
                RuntimeWarning,
                stacklevel=2,
            )
            return cls(path, None)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        data = (json.dumps(record) + "\n").encode()
        try:  # over the old record, then cut: no block is freed and asked for again on a full disk
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        except OSError:
            pass  # the record only informs a second run's message; the flock is the lock
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock (closing the file releases the flock); the file stays, unlocked. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_run_directory(run_dir: Path) -> None:
    """Refuse symbolic links under the names a run writes or deletes in `run_dir` (module
    docstring): RecipeError naming ``output_dir`` and each link with its target."""
    if not run_dir.is_dir():
        return
    candidates = [run_dir / name for name in RUN_ENTRIES]
    candidates += sorted(p for p in run_dir.iterdir() if p.name.startswith((".tmp-", ".old-")))
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        candidates += sorted(checkpoints.iterdir())
    links = links_among(candidates)
    if links:
        raise RecipeError(
            [
                f"output_dir: {link}; a run never writes or deletes through a link in its directory: "
                "remove the link (to keep a run on another disk, point output_dir there)"
                for link in links
            ]
        )
