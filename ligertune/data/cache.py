"""Where tokenised samples are kept between runs, and what key says they are still valid.

A build is stored as a folder ``<root>/<fingerprint>/``: one ``save_to_disk`` folder per split
(``train``, ``validation``) and ``meta.json``, written last. The fingerprint hashes everything
the samples depend on: each source (a local file's path, size and modification time, or a hub
id, config and `datasets`' fingerprint of the snapshot loaded), the tokenizer (its serialised
vocabulary, merges and processors, the chat template, the special tokens), the data section's
keys that change samples (format, max_seq_len, train_on_inputs, fields, selection) and the
seed (it picks the rows). Packing is left out: rows are laid out from the cached samples on
every load, so runs that differ only in ``data.packing`` share a cache entry.

A vision-language model's processed samples (`ligertune.data.vision`) use the same root,
writing, verifying and loading (`load_or_build`, `rank_zero_first`), with one safetensors file
per split instead of the ``save_to_disk`` folders (tensors of any shape, floats included, and a
reader that runs no code) and a key that adds the image processor and the image files.

Why ``save_to_disk``/``load_from_disk`` in our own folder rather than `Dataset.map`'s cache
files: map's cache lives next to the source's Arrow files (in the Hugging Face cache, placed
differently for hub and local sources) and is keyed by hashing the mapped function and its
arguments, which pickles the whole tokenizer on every call. Here the map runs with an explicit
``new_fingerprint`` (no hashing) and writes into a work folder, and the result is one folder per
fingerprint that we can write atomically, share between ranks and delete by hand.

Crash safety: a build is written to a temporary sibling folder and renamed into place, so a
folder under its final name is always complete; a leftover ``.tmp-*`` folder is debris that a
later build ignores.

Damage after the fact (a file truncated, removed or edited; a disk error; a symbolic link in an
entry's place): ``meta.json`` records the size and sha256 of every file of the entry, and
`load_entry` checks them (sizes first) before any split is read, as a checkpoint's manifest is
checked (`ligertune.files`). A damaged entry is a `DamagedEntry`, which the pipeline reports in
one line and rebuilds; ``ligertune preprocess`` verifies an existing entry the same way rather
than saying "already cached" about a broken one. The cost: the entry is read once more per
load, at ~1 GB/s per core in parallel threads (the samples are read in full anyway).

``meta.json`` also records a digest of each split's samples (`samples_digest`): what a
checkpoint stores as its data fingerprint, so that a resume notices data that changed since
(`ligertune.training.resume`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ligertune.errors import DataError
from ligertune.files import describe_os_error, digest_files, digest_problem, is_link, remove_tree

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import DataSection

CACHE_ENV = "LIGERTUNE_DATA_CACHE"
DEFAULT_ROOT = Path("~/.cache/ligertune/datasets")
# Bump when a change to the code changes what the same inputs tokenise to, or the entry's layout.
CACHE_VERSION = 2
META = "meta.json"
# Data keys that do not change the samples: layout, caching and the progress of a run.
LAYOUT_KEYS = ("packing", "cache", "cache_dir", "streaming")
T = TypeVar("T")


def cache_root(data: DataSection) -> Path:
    """``data.cache_dir``, else ``$LIGERTUNE_DATA_CACHE``, else ``~/.cache/ligertune/datasets``."""
    chosen = data.cache_dir or os.environ.get(CACHE_ENV) or str(DEFAULT_ROOT)
    return Path(os.path.expanduser(chosen))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What decides how a tokenizer turns text into ids. A fast tokenizer serialises its whole
    pipeline (normaliser, pre-tokenizer, vocabulary, merges, post-processor with BOS/EOS); a
    slow one is identified by its vocabulary and init arguments."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = backend.to_str()
    else:
        model = json.dumps(
            [sorted(tokenizer.get_vocab().items()), tokenizer.init_kwargs], sort_keys=True, default=str
        )
    return {
        "class": type(tokenizer).__name__,
        "model": hashlib.sha256(model.encode()).hexdigest(),
        "chat_template": tokenizer.chat_template,
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)],
    }


def fingerprint(parts: dict[str, Any]) -> str:
    text = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def data_keys(data: DataSection) -> dict[str, Any]:
    """The data section's keys that change the samples."""
    return {k: v for k, v in data.model_dump(mode="json").items() if k not in LAYOUT_KEYS}


class DamagedEntry(ValueError):
    """A cache entry whose files are not those written (module docstring); names the fault."""

    def __init__(self, directory: Path, problem: str):
        self.directory, self.problem = directory, problem
        super().__init__(f"the data cache entry {directory} is damaged: {problem}")


def load_entry(
    directory: Path, read: Callable[[Path, list[str]], dict[str, Any]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The splits and meta of a complete cache entry, verified against the sizes and digests in
    its meta; None when there is none. DamagedEntry when it is not what was written. `read`
    turns the verified folder and its split names into the splits: by default `datasets`'
    ``load_from_disk`` (the text samples); the vision-language samples pass their own."""
    if is_link(directory):
        raise DamagedEntry(directory, "it is a symbolic link, not a folder the cache wrote")
    meta_file = directory / META
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        files, splits = meta["files"], meta["splits"]
        if not isinstance(files, dict) or not isinstance(splits, dict):
            raise TypeError("not a mapping")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise DamagedEntry(directory, f"{META} cannot be read ({type(e).__name__}: {e})") from None
    problem = digest_problem(directory, files)
    if problem is not None:
        raise DamagedEntry(directory, problem)
    try:
        loaded = (read or _read_datasets)(directory, list(splits))
    except Exception as e:  # what the reader says of files it cannot read, in any of its words
        raise DamagedEntry(directory, f"a split cannot be loaded ({type(e).__name__}: {e})") from None
    return loaded, meta


def _read_datasets(directory: Path, splits: list[str]) -> dict[str, datasets.Dataset]:
    import datasets

    return {name: datasets.load_from_disk(str(directory / name)) for name in splits}


def load_or_build(
    directory: Path,
    build: Callable[[Path], dict[str, Any]],
    log: Callable[[str], None],
    what: str = "tokenised",
    read: Callable[[Path, list[str]], dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The cache entry at `directory`, verified (`load_entry`), or built there by `build`
    (`write_entry`) and read back; and whether it was there intact. A damaged entry is
    reported, removed and rebuilt. `what` names the samples in the log lines."""
    start = time.perf_counter()
    try:
        entry = load_entry(directory, read)
    except DamagedEntry as e:
        log(f"warning: {e}; rebuilding it")
        try:
            remove_tree(directory)
        except OSError as removal:
            raise DataError(f"{e}, and it cannot be removed ({describe_os_error(removal)})") from None
        entry = None
    if entry is not None:
        count = sum(entry[1]["splits"].values())
        log(f"loaded {count:,} {what} samples from cache {directory} in {time.perf_counter() - start:.1f} s")
        return *entry, True
    try:
        write_entry(directory, build)
        entry = load_entry(directory, read)
    except (OSError, DamagedEntry) as e:
        problem = describe_os_error(e) if isinstance(e, OSError) else str(e)
        raise DataError(f"cannot write the data cache entry {directory}: {problem}") from None
    log(f"cached the {what} samples at {directory}")
    assert entry is not None  # just written
    return *entry, False


def rank_zero_first(load: Callable[[], T], is_main: bool, barrier: Callable[[], None] | None) -> T:
    """`load()` (a `load_or_build`) on rank 0 while the other ranks wait at `barrier`, then on
    them: they find rank 0's entry, or build their own where the cache is not shared. The
    barrier is reached even when rank 0's build fails: the others then build and report it."""
    if barrier is None:
        return load()
    if is_main:
        try:
            return load()
        finally:
            barrier()
    barrier()
    return load()


def write_entry(directory: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """Run `build(work_dir)` (it saves the splits there and returns the meta) and move the
    result to `directory` in one rename, with the sizes and digests of its files in the meta.
    When another process finished the same entry first, ours is discarded: both are built from
    the same inputs."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = directory.parent / f".tmp-{directory.name}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        meta = build(work)
        meta["files"] = digest_files(work, leave_out=(META,))
        (work / META).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(work, directory)
        except OSError:
            if not (directory / META).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def samples_digest(dataset: datasets.Dataset) -> str:
    """sha256 of a split's tokenised samples (every column, in order), independent of how the
    Arrow files lay them out: the data fingerprint a checkpoint keeps."""
    table = dataset.with_format("arrow")[:]
    digest = hashlib.sha256()
    for name in sorted(table.column_names):
        digest.update(name.encode() + b"\0")
        _digest_array(digest, table.column(name).combine_chunks())
    return digest.hexdigest()


def _digest_array(digest, array) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        digest.update(pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        _digest_array(digest, array.flatten())
    else:
        digest.update(array.to_numpy(zero_copy_only=False).tobytes())
