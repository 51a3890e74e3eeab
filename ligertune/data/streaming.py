"""``data.streaming``: rows made from a stream while training, for data larger than the cache.

Each source is read with ``load_dataset(..., streaming=True)`` and tokenised on the fly in
chunks of `CHUNK` samples, each chunk truncated, masked and packed (or laid out one per row)
exactly as the cached path does; nothing is written to disk. What changes:

- The length is unknown ahead, so there are no epochs to count: the run is
  ``training.max_steps`` steps (a recipe rule requires it), and the loader treats the whole run
  as one "epoch" of ``max_steps × gradient_accumulation_steps`` micro-batches per rank. When a
  source runs out before that, it starts over with a new shuffle (a new pass).
- Shuffling is approximate: a seeded buffer of `SHUFFLE_BUFFER` rows (`IterableDataset.shuffle`),
  reshuffled at every pass.
- A mix draws the source of each sample at random by weight (seeded).
- Every rank reads the same stream and takes its own micro-batches, so the data order is that of
  the cached path's rule (micro-batch ``i · world_size + rank``) and a resume is exact; resuming
  at step k re-reads (and re-tokenises) the first k steps' samples to find its place.
- Validation reads ``data.validation_split`` of each source to the end and keeps it in memory
  (``validation_fraction`` cannot hold out part of a stream of unknown length).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from ligertune.data.formats import Located, chat_options, empty_rows_message, tokenize_rows
from ligertune.data.packing import SequenceDataset, build_rows, truncate_and_mask
from ligertune.data.prepared import DataStats, Log, PreparedData
from ligertune.data.sources import SourceSpec, load_split, source_specs
from ligertune.errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import Recipe

CHUNK = 1024  # samples tokenised and packed together
SHUFFLE_BUFFER = 10_000
MIX_STREAM = 2  # the random stream of source choices (pipeline.py numbers the others)


class StreamingRows:
    """Training rows from a stream: no length, no random access; `rows(epoch)` yields them in
    the order every rank sees. `micro_batches` is the run's length in micro-batches per rank."""

    def __init__(
        self,
        sources: list[tuple[SourceSpec, datasets.IterableDataset, str]],
        tokenizer: PreTrainedTokenizerBase,
        recipe: Recipe,
    ):
        self.sources, self.tokenizer, self.data, self.seed = sources, tokenizer, recipe.data, recipe.seed
        training = recipe.training
        self.micro_batches = (training.max_steps or 0) * training.gradient_accumulation_steps

    def rows(self, epoch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Endless rows: sources restart when they run out."""
        samples = self._samples(epoch)
        while True:
            chunk = list(itertools.islice(samples, CHUNK))
            tokenised = []
            for i, (spec, _, name) in enumerate(self.sources):
                mine = [name.row(row_number, row) for source, row_number, row in chunk if source == i]
                if mine:
                    tokenised += _tokenise(spec, mine, self.tokenizer, self.data, name)
            kept, _, _ = truncate_and_mask(tokenised, self.data.max_seq_len)
            yield from build_rows(kept, self.data.max_seq_len, self.tokenizer.pad_token_id, self.data.packing)

    def _samples(self, epoch: int) -> Iterator[tuple[int, int, dict]]:
        """(source index, row number in its stream, row), sources drawn by weight."""
        weights = np.array([spec.weight for spec, _, _ in self.sources])
        rng = np.random.default_rng([self.seed, MIX_STREAM, epoch])
        streams = [self._endless(i, epoch) for i in range(len(self.sources))]
        while True:
            i = int(rng.choice(len(streams), p=weights / weights.sum())) if len(streams) > 1 else 0
            row_number, row = next(streams[i])
            yield i, row_number, row

    def _endless(self, index: int, epoch: int) -> Iterator[tuple[int, dict]]:
        spec, stream, name = self.sources[index]
        if self.data.shuffle:
            stream = stream.shuffle(seed=self.seed + index, buffer_size=SHUFFLE_BUFFER)
        for passes in itertools.count():
            stream.set_epoch(epoch * 1_000_003 + passes)
            seen = 0
            for seen, row in enumerate(stream, 1):
                yield seen - 1, row
            if seen == 0:
                raise DataError(f"{name}: the stream has no rows")


def _tokenise(spec: SourceSpec, rows: list, tokenizer, data, name: Located) -> list:
    """`tokenize_rows`, refusing a row that teaches nothing at once (a stream has no end to count
    them to; the cached path refuses them with counts)."""
    samples = tokenize_rows(
        spec.format,
        rows,
        tokenizer,
        train_on_inputs=data.train_on_inputs,
        messages_field=spec.messages_field,
        source=str(name),
        chat=chat_options(spec.format, spec.columns, spec.roles, data.think_blocks),
    )
    for (where, _), sample in zip(rows, samples, strict=True):
        if sample.empty:
            raise DataError(empty_rows_message([where], 1, len(rows), spec.format))
    return samples


def build_streaming(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, log: Log) -> PreparedData:
    data = recipe.data
    sources = []
    for spec in source_specs(recipe):
        stream, name = load_split(spec, spec.split, streaming=True)
        sources.append((spec, stream, name))
    log(f"streaming {', '.join(str(name) for _, _, name in sources)}: samples are tokenised while training")
    stats = DataStats(0, 0, 0, 0, 0, 0, data.max_seq_len, data.packing, streaming=True)
    validation = None
    if data.validation_split is not None:
        validation, stats.validation = _materialise(recipe, tokenizer)
    return PreparedData(StreamingRows(sources, tokenizer, recipe), validation, stats)


def _materialise(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[SequenceDataset, DataStats]:
    """Every source's validation split, read to its end and laid out in memory."""
    data = recipe.data
    samples = []
    for spec in source_specs(recipe):
        stream, name = load_split(spec, data.validation_split, streaming=True)
        samples += _tokenise(spec, [name.row(i, row) for i, row in enumerate(stream)], tokenizer, data, name)
    kept, truncated, dropped = truncate_and_mask(samples, data.max_seq_len)
    dataset = build_rows(kept, data.max_seq_len, tokenizer.pad_token_id, data.packing)
    stats = DataStats(
        len(samples),
        truncated,
        dropped,
        len(dataset),
        dataset.num_tokens,
        dataset.num_label_tokens,
        data.max_seq_len,
        data.packing,
    )
    return dataset, stats
