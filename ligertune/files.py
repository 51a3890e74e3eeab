"""Files and folders we write or delete inside folders of ours (a run directory, the data cache),
never through a symbolic link; and the sha256 digests that say a folder's files are those written.

Why links matter: a run directory is often received from someone else (a copied run to resume or
to `generate` from), or shared. A link planted there under one of our names (``run.lock`` →
``~/.bashrc``, ``checkpoints/step-2`` → ``/``) would turn our ordinary writes and deletes into
writes and deletes of whatever it points at: truncating ``metrics.jsonl`` to repair its last line,
appending to ``train.log``, pruning an old checkpoint. So:

- files are opened with ``O_NOFOLLOW`` (`open_nofollow`): a link at the path itself fails the
  open (``ELOOP``), reported as a `LinkError` naming the link and its target;
- new files are created with ``O_EXCL`` where nothing should be there yet, which fails on a
  link too, even a dangling one;
- a folder is deleted with `remove_tree`, which removes a link found in its place (the link
  only, never what it points at) and otherwise ``shutil.rmtree``, which itself never follows a
  link inside the tree (it walks with file descriptors on Linux);
- the callers check the names they own up front (`links_among`) and refuse, in one line naming
  each link, before any work: `ligertune.run.lock` for a run directory.

Only the path's last component is checked: the folders above it (``output_dir`` itself, ``runs/``
on another disk) are the user's to place, and linking them is a normal way to put a run on a big
disk. The links refused are those *inside* a folder we own, under a name we write.

It imports only the standard library: every layer (``run/``, ``data/``, the CLI) uses it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_READ_CHUNK = 16 * 2**20


class LinkError(OSError):
    """A symbolic link where we write or delete; the message names it and its target."""

    def __init__(self, path: str | os.PathLike):
        path = str(path)
        super().__init__(errno.ELOOP, f"{path} is a symbolic link{_target(path)}", path)

    def __str__(self) -> str:
        return self.strerror


def _target(path: str) -> str:
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""


def describe_os_error(error: OSError) -> str:
    """An OSError in a few words, naming its file: `/runs/x/metrics.jsonl: Permission denied`."""
    if error.filename and error.strerror and str(error.filename) not in error.strerror:
        return f"{error.filename}: {error.strerror}"
    return error.strerror or str(error)


def is_link(path: str | os.PathLike) -> bool:
    return os.path.islink(path)


def links_among(paths: Iterable[str | os.PathLike]) -> list[str]:
    """One line for each of `paths` that is a symbolic link: the link and its target."""
    return [str(LinkError(p)) for p in paths if is_link(p)]


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that never follows a symbolic link at `path` itself: raises `LinkError`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        # O_NOFOLLOW fails with ELOOP on a link; O_CREAT | O_EXCL with EEXIST (a link always
        # "exists" for it, even a dangling one).
        if e.errno in (errno.ELOOP, errno.EEXIST) and is_link(path):
            raise LinkError(path) from None
        raise


def write_new(path: str | os.PathLike, data: bytes | str) -> None:
    """Create `path` (which must not exist, not even as a link) and write `data` into it."""
    raw = data.encode() if isinstance(data, str) else data
    fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete the folder `path`; a link (or a file) in its place is removed itself, never what
    it points at. Absent: nothing to do."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    shutil.rmtree(path)


def real_directories(root: Path) -> list[Path]:
    """The folders directly in `root` that are folders themselves, not links to one."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]


# --------------------------------------------------------------------------------------------
# Digests
# --------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def in_parallel(function: Callable[[Path], Any], paths: list[Path]) -> list[Any]:
    """`function` over `paths` in threads: hashlib and file reads release the GIL, so the files
    of a folder are read side by side."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(paths)))) as pool:
        return list(pool.map(function, paths))


def files_below(directory: Path, leave_out: Iterable[str] = ()) -> list[Path]:
    """Every regular file under `directory` (links are neither followed nor listed), sorted,
    but those whose path relative to it is in `leave_out`."""
    skip = set(leave_out)
    found = []
    for folder, subfolders, names in os.walk(directory):  # os.walk does not descend into links
        for name in names:
            path = Path(folder) / name
            if (
                path.is_file()
                and not path.is_symlink()
                and path.relative_to(directory).as_posix() not in skip
            ):
                found.append(path)
        subfolders.sort()
    return sorted(found)


def digest_files(directory: Path, leave_out: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """{relative path: {size, sha256}} of every file under `directory` (`files_below`)."""
    files = files_below(directory, leave_out)
    digests = in_parallel(sha256_file, files)
    return {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": digest}
        for path, digest in zip(files, digests, strict=True)
    }


def digest_problem(directory: Path, recorded: dict[str, Any]) -> str | None:
    """What differs between the files under `directory` and `recorded` (`digest_files`' form):
    a missing file, a size (every truncation, at no cost: checked first) or a digest. None when
    every recorded file is there and whole."""
    entries = {}
    try:
        for name, entry in recorded.items():
            entries[name] = int(entry["size"]), str(entry["sha256"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return "its list of files cannot be read"
    outside = next((n for n in entries if Path(n).is_absolute() or ".." in Path(n).parts), None)
    if outside is not None:  # a planted list must not make us read files elsewhere
        return f"its list of files names {outside!r}, outside the folder"
    for name, (saved_size, _) in entries.items():
        file = directory / name
        if file.is_symlink() or not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != saved_size:
            hint = " (truncated)" if size < saved_size else ""
            return f"{name} has {size} bytes, {saved_size} were saved{hint}"
    names = sorted(entries)
    try:
        digests = in_parallel(sha256_file, [directory / name for name in names])
    except OSError as e:
        return f"{Path(e.filename or '?').name} cannot be read: {e.strerror}"
    for name, digest in zip(names, digests, strict=True):
        if digest != entries[name][1]:
            return f"{name} does not match the sha256 recorded when it was saved"
    return None
