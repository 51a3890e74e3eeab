"""`build_datasets`: a recipe's data section → tokenized, laid-out train and validation rows.

Order of operations, all seeded by ``recipe.seed`` so every rank builds identical data:

1. load ``data.split`` of each source (``data.path``, or each dataset of ``data.mix``), and
   ``data.validation_split`` when set;
2. choose the training samples: one source is shuffled (``data.shuffle``) and cut to
   ``data.max_samples``; a mix draws each source's share (below), then shuffles them together;
3. hold out ``data.validation_fraction`` of those (a seeded random choice, whatever the order);
4. tokenize in each source's format with `datasets.map` (batched; in several processes when
   the data is large), truncate to ``data.max_seq_len`` (counted), mask each sample's first
   label, drop samples left without a trained token (counted), and cache the result
   (`ligertune.data.cache`): a later run with the same inputs, a resumed run and every arm of
   a comparison load it instead;
5. pack into rows of ``max_seq_len`` (``data.packing``) or keep one sample per row.

Mixing (``data.mix``): the weights are relative shares of the mix's samples. The mix has
``data.max_samples`` samples, by default as many as all its sources together, and source i
contributes ``weight_i / Σ weights`` of them: a seeded random subset of its rows when that is
fewer than it has, every row once plus a random subset of the rest again when more (so a small
source weighted up is repeated). Equal weights on equal-sized sources use each row once.

In a multi-process run, rank 0 tokenises and writes the cache while the others wait at a
barrier, then every rank loads it (a rank that finds no cache entry, e.g. on another node
without a shared disk, builds its own). ``data.streaming`` goes to `ligertune.data.streaming`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ligertune.catalog.formats import PROMPT_FORMATS, UNPACKED_FORMATS
from ligertune.data.cache import (
    cache_root,
    data_keys,
    fingerprint,
    load_or_build,
    rank_zero_first,
    samples_digest,
    tokenizer_fingerprint,
)
from ligertune.data.chat import ChatOptions
from ligertune.data.formats import (
    Located,
    Sample,
    chat_options,
    columns_for,
    empty_rows_message,
    tokenize_rows,
)
from ligertune.data.packing import SequenceDataset, layout_rows, truncate_and_mask
from ligertune.data.preference import PAIR_FORMATS, pair_features, pair_rows, tokenize_pair_batch
from ligertune.data.prepared import DataStats, Log, PreparedData
from ligertune.data.prompts import prompt_features, prompt_rows, tokenize_prompt_batch
from ligertune.data.sources import SourceSpec, load_split, quiet_datasets, source_fingerprint, source_specs
from ligertune.data.streaming import build_streaming
from ligertune.errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import DataSection, Recipe

# Independent random streams derived from the recipe seed, one per purpose.
SHUFFLE_STREAM, HOLDOUT_STREAM, MIX_STREAM = 0, 1, 2
# Formats tokenised their own way (a row of two sequences, a prompt): (map function, cached columns).
_OWN_TOKENISERS = {fmt: (tokenize_pair_batch, pair_features) for fmt in PAIR_FORMATS} | {
    fmt: (tokenize_prompt_batch, prompt_features) for fmt in PROMPT_FORMATS
}
# Rows above which tokenising in several processes pays for starting them (about 1 s).
PARALLEL_ROWS = 20_000
MAP_BATCH = 1000


def build_datasets(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] | None = None,
    log: Log | None = None,
) -> PreparedData:
    """The recipe's train and validation rows. `is_main` and `barrier` come from the runtime of
    a multi-process run (rank 0 builds the cache, the others wait); `log` receives progress
    lines (counts and seconds) on the main rank."""
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; load it with ligertune.data.load_tokenizer")
    say: Log = log if (log is not None and is_main) else (lambda message: None)
    if recipe.data.streaming:
        return build_streaming(recipe, tokenizer, say)
    builder = _Builder(recipe, tokenizer, say)
    if not recipe.data.cache:
        with tempfile.TemporaryDirectory(prefix="ligertune-data-") as work:
            entry = builder.load_or_build(Path(work) / "entry")
            return _lay_out(*entry[:2], recipe.data, tokenizer, None, say)
    directory = builder.cache_directory()
    entry = rank_zero_first(lambda: builder.load_or_build(directory), is_main, barrier)
    return _lay_out(*entry[:2], recipe.data, tokenizer, directory, say)


def cache_entry(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase, log: Log | None = None
) -> tuple[Path, bool]:
    """Build the recipe's cache entry ahead of training (``ligertune preprocess``); returns
    its folder and whether it was already there."""
    builder = _Builder(recipe, tokenizer, log or (lambda message: None))
    directory = builder.cache_directory()
    _, _, existed = builder.load_or_build(directory)
    return directory, existed


class _Builder:
    """Loads a recipe's sources lazily, keys the cache and tokenises the chosen rows."""

    def __init__(self, recipe: Recipe, tokenizer: PreTrainedTokenizerBase, log: Log):
        self.recipe, self.data, self.tokenizer, self.log = recipe, recipe.data, tokenizer, log
        self.specs = source_specs(recipe)
        # A prompt's tokens: the row's, less what the objective generates after it (data.prompts).
        self.prompt_budget = recipe.data.max_seq_len - recipe.objective.generated_tokens()
        self._loaded: dict[tuple[int, str], tuple[datasets.Dataset, Located]] = {}

    def source(self, index: int, split: str) -> tuple[datasets.Dataset, Located]:
        key = (index, split)
        if key not in self._loaded:
            self._loaded[key] = load_split(self.specs[index], split)
        return self._loaded[key]

    def cache_directory(self) -> Path:
        """The cache entry for these inputs. Local sources are keyed by their files' stats,
        so a cache hit reads no source at all; hub sources are loaded (from the Hugging Face
        cache when there) for the fingerprint of the snapshot."""
        sources = []
        for i, spec in enumerate(self.specs):
            if spec.local is not None and not spec.local.exists():
                raise DataError(f"{spec.key}: file not found: {spec.local}")
            loaded = self.source(i, spec.split)[0] if spec.local is None else None
            sources.append({**asdict(spec), "data": source_fingerprint(spec, loaded)})
        key = fingerprint(
            {
                "sources": sources,
                "tokenizer": tokenizer_fingerprint(self.tokenizer),
                "data": data_keys(self.data),
                "seed": self.recipe.seed,
                # Only when it differs from max_seq_len, so that the other entries keep their keys.
                **(
                    {"prompt_tokens": self.prompt_budget}
                    if self.prompt_budget != self.data.max_seq_len
                    else {}
                ),
            }
        )
        return cache_root(self.data) / key

    def load_or_build(self, directory: Path) -> tuple[dict[str, datasets.Dataset], dict[str, Any], bool]:
        """The cache entry at `directory`, verified, or tokenised there (`ligertune.data.cache.load_or_build`)."""
        return load_or_build(directory, self.tokenise, self.log)

    def tokenise(self, work: Path) -> dict[str, Any]:
        """Choose, tokenise and save every split into `work`; returns the meta to save with them."""
        start = time.perf_counter()
        train, validation = self.choose()
        scratch = work / "map"
        with quiet_datasets():  # our own lines report the work, once
            splits = {"train": self.tokenise_split("train", train, scratch)}
            if validation is not None:
                splits["validation"] = self.tokenise_split("validation", validation, scratch)
            for name, split in splits.items():
                split.save_to_disk(str(work / name))
        digests = {name: samples_digest(split) for name, split in splits.items()}
        shutil.rmtree(scratch, ignore_errors=True)
        count = sum(len(s) for s in splits.values())
        self.log(f"tokenised {count:,} samples in {time.perf_counter() - start:.1f} s")
        return {"splits": {name: len(split) for name, split in splits.items()}, "samples": digests}

    # -- which rows ------------------------------------------------------------------------

    def choose(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Training and validation samples as [n, 2] arrays of (source index, row)."""
        data, seed = self.data, self.recipe.seed
        sizes = [len(self.source(i, spec.split)[0]) for i, spec in enumerate(self.specs)]
        if len(self.specs) == 1:
            rows = np.arange(sizes[0])
            if data.shuffle:
                rows = _rng(seed, SHUFFLE_STREAM).permutation(rows)
            if data.max_samples is not None:
                rows = rows[: data.max_samples]
            order = np.stack([np.zeros_like(rows), rows], axis=1)
        else:
            order = self.mix_order(sizes)

        validation = None
        if data.validation_split is not None:
            validation = np.concatenate(
                [
                    np.stack([np.full(n, i), np.arange(n)], axis=1)
                    for i in range(len(self.specs))
                    for n in [len(self.source(i, data.validation_split)[0])]
                ]
            )
        elif data.validation_fraction > 0:
            held = max(1, round(len(order) * data.validation_fraction))
            if held >= len(order):
                name = self.source(0, self.specs[0].split)[1] if len(self.specs) == 1 else "data.mix"
                raise DataError(
                    f"{name}: data.validation_fraction {data.validation_fraction} of {len(order)} samples "
                    "leaves nothing to train on; lower it or add data"
                )
            chosen = np.zeros(len(order), dtype=bool)
            chosen[_rng(seed, HOLDOUT_STREAM).choice(len(order), held, replace=False)] = True
            validation, order = order[chosen], order[~chosen]
        return order, validation

    def mix_order(self, sizes: list[int]) -> np.ndarray:
        """Each source's share of the mix (see the module docstring), shuffled together."""
        data, seed = self.data, self.recipe.seed
        weights = np.array([spec.weight for spec in self.specs])
        total = data.max_samples or sum(sizes)
        counts = mix_counts(weights, total)
        parts = []
        for i, (count, size) in enumerate(zip(counts, sizes, strict=True)):
            passes = -(-count // size)
            rng = np.random.default_rng([seed, MIX_STREAM, i])
            rows = [rng.permutation(size) if data.shuffle else np.arange(size) for _ in range(passes)]
            parts.append(np.stack([np.full(count, i), np.concatenate(rows)[:count]], axis=1))
            name = self.source(i, self.specs[i].split)[1]
            repeat = f" (×{count / size:.2f})" if count > size else ""
            self.log(
                f"mix: {count:,} samples from {name} ({size:,} rows, weight {self.specs[i].weight:g}){repeat}"
            )
        order = np.concatenate(parts)
        if data.shuffle:
            order = order[_rng(seed, SHUFFLE_STREAM).permutation(len(order))]
        return order

    # -- tokenising ------------------------------------------------------------------------

    def tokenise_split(self, split: str, order: np.ndarray, scratch: Path) -> datasets.Dataset:
        """The samples of `order`, in that order: each source's rows mapped in one batched
        `datasets.map`, then the sources interleaved back."""
        import datasets

        parts, positions = [], []
        for i, spec in enumerate(self.specs):
            mine = np.flatnonzero(order[:, 0] == i)
            if len(mine) == 0:
                continue
            source_split = spec.split if split == "train" else (self.data.validation_split or spec.split)
            source, name = self.source(i, source_split)
            parts.append(self._map(source, order[mine, 1], spec, name, scratch / f"{split}-{i}.arrow"))
            positions.append(mine)
        tokenised = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        if len(parts) > 1:
            where = np.empty(len(order), dtype=np.int64)
            where[np.concatenate(positions)] = np.arange(len(order))
            tokenised = tokenised.select(where)
        return tokenised

    def _map(
        self, source: datasets.Dataset, rows: np.ndarray, spec: SourceSpec, name: Located, cache_file: Path
    ) -> datasets.Dataset:
        """Tokenise rows `rows` of `source` (one batched `datasets.map`), then refuse rows that
        teach nothing (`refuse_empty`)."""
        required, optional = columns_for(spec.format, spec.messages_field)
        columns = [c for c in required + optional if c in source.column_names]
        selected = source.select_columns(columns).select(rows.tolist())
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        num_proc = min(8, os.cpu_count() or 1) if len(rows) > PARALLEL_ROWS else 1
        # Pairs (ligertune.data.preference) and prompts (ligertune.data.prompts) tokenise their own way.
        tokenise, features = _OWN_TOKENISERS.get(spec.format, (tokenize_batch, sample_features))
        prompts = spec.format in PROMPT_FORMATS
        mapped = selected.map(
            tokenise,
            batched=True,
            batch_size=MAP_BATCH,
            with_indices=True,
            remove_columns=columns,
            features=features(),
            num_proc=num_proc if num_proc > 1 else None,
            cache_file_name=str(cache_file),
            new_fingerprint=f"{cache_file.stem}-{os.getpid()}-{time.time_ns()}",
            fn_kwargs={
                "rows": rows,
                "fmt": spec.format,
                "tokenizer": self.tokenizer,
                "train_on_inputs": self.data.train_on_inputs,
                "messages_field": spec.messages_field,
                "max_seq_len": self.prompt_budget if prompts else self.data.max_seq_len,
                "source": name,
                "chat": chat_options(spec.format, spec.columns, spec.roles, self.data.think_blocks),
            },
        )
        if spec.format not in UNPACKED_FORMATS and not self.data.train_on_inputs:
            refuse_empty(mapped, rows, spec.format, name)
        return mapped


def sample_features() -> datasets.Features:
    """The columns of a cached sample (int32 ids: half the disk and memory of int64)."""
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "truncated": datasets.Value("bool"),
            "dropped": datasets.Value("bool"),
            "empty": datasets.Value("bool"),
        }
    )


def tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    rows: np.ndarray,
    fmt: str,
    tokenizer,
    train_on_inputs: bool,
    messages_field: str | None,
    max_seq_len: int,
    source: Located,
    chat: ChatOptions | None = None,
) -> dict:
    """One `datasets.map` batch → samples, truncated and masked. `rows` maps a position in the
    selection back to the row number in the source, which error messages name (with its file,
    `Located`). Dropped samples stay (empty) so that they are counted."""
    samples = tokenize_rows(
        fmt,
        source.rows(batch, (int(rows[i]) for i in indices)),
        tokenizer,
        train_on_inputs=train_on_inputs,
        messages_field=messages_field,
        source=str(source),
        chat=chat,
    )
    out: dict[str, list] = {"input_ids": [], "labels": [], "truncated": [], "dropped": [], "empty": []}
    for sample in samples:
        kept, truncated, _ = truncate_and_mask([sample], max_seq_len)
        out["empty"].append(sample.empty)
        sample = kept[0] if kept else Sample([], [])
        out["input_ids"].append(sample.input_ids)
        out["labels"].append(sample.labels)
        out["truncated"].append(bool(truncated))
        out["dropped"].append(not kept)
    return out


def refuse_empty(mapped: datasets.Dataset, rows: np.ndarray, fmt: str, source: Located) -> None:
    """DataError when rows of `mapped` teach nothing (`ligertune.data.formats.Sample.empty`),
    with their count and the first few, by file and row. A dataset of such rows would train on
    end-of-sequence tokens only (or be dropped row by row, silently): refused, as a
    prompt_completion row with an empty completion always was."""
    empty = np.sort(rows[np.flatnonzero(mapped.with_format("numpy")["empty"])])  # in the file's order
    if len(empty) == 0:
        return
    raise DataError(empty_rows_message([source.where(int(r)) for r in empty[:4]], len(empty), len(rows), fmt))


def mix_counts(weights: np.ndarray, total: int) -> list[int]:
    """`total` split in proportion to `weights`, rounded so that the counts add up (largest
    remainders first), each source getting at least one sample."""
    shares = weights / weights.sum() * total
    counts = np.floor(shares).astype(np.int64)
    for i in np.argsort(-(shares - counts), kind="stable")[: total - counts.sum()]:
        counts[i] += 1
    return [max(1, int(c)) for c in counts]


def _lay_out(
    splits: dict[str, datasets.Dataset],
    meta: dict[str, Any],
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path | None,
    log: Log,
) -> PreparedData:
    start = time.perf_counter()
    train, stats = _rows(splits["train"], data, tokenizer.pad_token_id)
    if len(train) == 0:
        raise DataError(
            f"{data.path or 'data.mix'}: no training samples left: all {stats.num_samples:,} have no trainable "
            f"token within data.max_seq_len={data.max_seq_len} (the prompt fills it); raise data.max_seq_len"
        )
    validation = None
    if "validation" in splits:
        validation, stats.validation = _rows(splits["validation"], data, tokenizer.pad_token_id)
    layout = f"packed into rows of {data.max_seq_len}" if data.packing else "laid out one per row"
    log(
        f"{stats.num_samples - stats.num_dropped:,} samples {layout}: {len(train):,} rows in {time.perf_counter() - start:.1f} s"
    )
    return PreparedData(train, validation, stats, directory, data_fingerprint(meta))


def data_fingerprint(meta: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the data it was trained on: a digest of every split's
    tokenised samples, and their counts (for the message when they differ)."""
    splits, digests = meta["splits"], meta["samples"]
    combined = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:20]
    return {"samples": combined, **{name: splits[name] for name in sorted(splits)}}


def _rows(
    samples: datasets.Dataset, data: DataSection, pad_token_id: int
) -> tuple[SequenceDataset, DataStats]:
    """Cached samples → rows, read as flat Arrow buffers (no Python object per token)."""
    import pyarrow.compute as pc

    if "split" in samples.column_names:  # pairs (ligertune.data.preference)
        return pair_rows(samples, data.max_seq_len, pad_token_id)
    if "answer" in samples.column_names:  # prompts (ligertune.data.prompts)
        return prompt_rows(samples, data.max_seq_len)

    table = samples.with_format("arrow")[:]
    ids_col = table.column("input_ids").combine_chunks()
    labels_col = table.column("labels").combine_chunks()
    dropped = table.column("dropped").to_numpy(zero_copy_only=False)
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    labels = labels_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    dataset = layout_rows(ids, labels, lengths[~dropped], data.max_seq_len, pad_token_id, data.packing)
    stats = DataStats(
        num_samples=len(samples),
        num_truncated=int(table.column("truncated").to_numpy(zero_copy_only=False).sum()),
        num_dropped=int(dropped.sum()),
        num_sequences=len(dataset),
        num_tokens=dataset.num_tokens,
        num_label_tokens=dataset.num_label_tokens,
        max_seq_len=data.max_seq_len,
        packed=data.packing,
    )
    return dataset, stats


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])
