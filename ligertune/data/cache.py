"""Where tokenised samples are kept between runs, and what key says they are still valid.

A build is stored as a folder ``<root>/<fingerprint>/``: one ``save_to_disk`` folder per split
(``train``, ``validation``) and ``meta.json``, written last. The fingerprint hashes everything
the samples depend on: each source (a local file's path, size and modification time, or a hub
id, config and `datasets`' fingerprint of the snapshot loaded), the tokenizer (its serialised
vocabulary, merges and processors, the chat template, the special tokens), the data section's
keys that change samples (format, max_seq_len, train_on_inputs, fields, selection) and the
seed (it picks the rows). Packing is left out: rows are laid out from the cached samples on
every load, so runs that differ only in ``data.packing`` share a cache entry.

Why ``save_to_disk``/``load_from_disk`` in our own folder rather than `Dataset.map`'s cache
files: map's cache lives next to the source's Arrow files (in the Hugging Face cache, placed
differently for hub and local sources) and is keyed by hashing the mapped function and its
arguments, which pickles the whole tokenizer on every call. Here the map runs with an explicit
``new_fingerprint`` (no hashing) and writes into a work folder, and the result is one folder per
fingerprint that we can write atomically, share between ranks and delete by hand.

Crash safety: a build is written to a temporary sibling folder and renamed into place, so a
folder under its final name is always complete; a leftover ``.tmp-*`` folder is debris that a
later build ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import DataSection

CACHE_ENV = "LIGERTUNE_DATA_CACHE"
DEFAULT_ROOT = Path("~/.cache/ligertune/datasets")
# Bump when a change to the code changes what the same inputs tokenise to.
CACHE_VERSION = 1
# Data keys that do not change the samples: layout, caching and the progress of a run.
LAYOUT_KEYS = ("packing", "cache", "cache_dir", "streaming")


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


def load_entry(directory: Path) -> tuple[dict[str, datasets.Dataset], dict[str, Any]] | None:
    """The splits and meta of a complete cache entry, or None when there is none."""
    import datasets

    meta_file = directory / "meta.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    splits = {name: datasets.load_from_disk(str(directory / name)) for name in meta["splits"]}
    return splits, meta


def write_entry(directory: Path, build: Callable[[Path], dict[str, Any]]) -> None:
    """Run `build(work_dir)` (it saves the splits there and returns the meta) and move the
    result to `directory` in one rename. When another process finished the same entry first,
    ours is discarded: both are built from the same inputs."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = directory.parent / f".tmp-{directory.name}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        meta = build(work)
        (work / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(work, directory)
        except OSError:
            if not (directory / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
