"""``metrics.jsonl`` on disk: opened without following links, a torn last line repaired, and the
records of steps a resume replays marked as superseded.

Each record goes out in one ``write()`` of the whole line on a file opened with ``O_APPEND``
(`ligertune.run.metrics`), so a process killed or a disk filled mid-line leaves at most a torn
last line, which the next run cuts off (`repair_torn_tail`) before its first record.

Replayed steps (`mark_superseded`): a run killed after logging step 4 but whose last checkpoint
is step 2 resumes at step 3, and logs steps 3 and 4 again. The first records of those steps
describe weights that no longer exist, so when a run opens the file at step S, every ``train``
and ``eval`` record of a step after S gets ``"superseded": true``: nothing is deleted (the lost
attempt stays readable, e.g. the one that hit a non-finite loss before a resume with a lower
lr), and a reader that leaves superseded records out sees each step once, as the model lived
it. The file is rewritten to a temporary sibling and renamed over the original, so a kill
during the rewrite leaves the old file or the new one. A fresh start (step 0) on a directory
with an old run's metrics supersedes all of that run's steps the same way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ligertune.files import open_nofollow, remove_tree, write_new

METRICS_FILE = "metrics.jsonl"
SUPERSEDED = "superseded"
_REPLAYABLE = ("train", "eval")


def _last_line_start(fd: int, end: int) -> int:
    """Offset of the first byte after the last newline before `end` (0 if there is none)."""
    block = 64 * 1024
    position = end
    while position > 0:
        start = max(0, position - block)
        found = os.pread(fd, position - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        position = start
    return 0


def repair_torn_tail(path: Path) -> str | None:
    """Cut a torn last line off the JSON-lines file `path`: one without its newline (the
    writer died or the disk filled mid-write), or one that is not a JSON object. Returns a
    warning saying what was removed, or None when the file was whole (or absent). A link at
    `path` is a `ligertune.files.LinkError`: the truncation never reaches another file."""
    try:
        fd = open_nofollow(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        ends_whole = os.pread(fd, 1, size - 1) == b"\n"
        start = _last_line_start(fd, size - 1 if ends_whole else size)
        line = os.pread(fd, size - start, start)
        if ends_whole:
            try:
                if isinstance(json.loads(line), dict):
                    return None
            except ValueError:
                pass
        os.ftruncate(fd, start)
        os.fsync(fd)
    finally:
        os.close(fd)
    why = "is not a JSON object" if ends_whole else "has no newline"
    return (
        f"warning: the last line of {path} {why} (a run stopped mid-write or the disk filled up); "
        f"removed it ({size - start} bytes)"
    )


def _read(path: Path) -> bytes | None:
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _superseded(line: bytes, start_step: int) -> bytes | None:
    """`line` marked as superseded when it records a step after `start_step`; else None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None  # not ours to judge (a line edited by hand): left as it is
    if not isinstance(record, dict) or record.get("event") not in _REPLAYABLE:
        return None
    step = record.get("step")
    if not isinstance(step, int) or step <= start_step or record.get(SUPERSEDED):
        return None
    return json.dumps({**record, SUPERSEDED: True}).encode()


def mark_superseded(path: Path, start_step: int) -> int:
    """Mark the records of steps after `start_step` as superseded (module docstring); returns
    how many were marked (0: the file is left untouched)."""
    data = _read(path)
    if not data:
        return 0
    lines = data.split(b"\n")
    marked = 0
    for i, line in enumerate(lines):
        replaced = _superseded(line, start_step) if line else None
        if replaced is not None:
            lines[i], marked = replaced, marked + 1
    if marked:
        temporary = path.with_name(f".tmp-{path.name}")
        remove_tree(temporary)  # a leftover of a rewrite that was killed
        write_new(temporary, b"\n".join(lines))
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    return marked
