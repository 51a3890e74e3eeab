"""`build_datasets`: a recipe's data section → tokenized, laid-out train and validation rows.

Order of operations, all seeded by ``recipe.seed`` so every rank builds identical data:

1. load ``data.split`` (and ``data.validation_split`` when set);
2. shuffle the training rows (``data.shuffle``), keep the first ``data.max_samples``;
3. hold out ``data.validation_fraction`` of those (a seeded random choice, whatever the order);
4. tokenize in ``data.format``, truncate to ``data.max_seq_len`` (counted), mask each
   sample's first label, drop samples left without a trained token (counted);
5. pack into rows of ``max_seq_len`` (``data.packing``) or keep one sample per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ligertune.data.formats import check_columns, columns_for, tokenize_rows
from ligertune.data.packing import SequenceDataset, build_rows, truncate_and_mask
from ligertune.data.sources import load_split
from ligertune.errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import DataSection, Recipe

# Independent random streams derived from the recipe seed, one per purpose.
SHUFFLE_STREAM, HOLDOUT_STREAM = 0, 1


@dataclass
class DataStats:
    """Counts for one split. `validation` holds the validation split's counts, when there is one."""

    num_samples: int  # rows read from the source (after max_samples / hold-out)
    num_truncated: int  # samples cut to max_seq_len
    num_dropped: int  # samples with no trained token left (e.g. the response was truncated away)
    num_sequences: int  # rows handed to the loader
    num_tokens: int  # real tokens in those rows (packing padding not counted)
    num_label_tokens: int  # tokens the loss is computed on
    max_seq_len: int
    packed: bool
    validation: DataStats | None = None

    def describe(self) -> str:
        if self.packed:
            layout = f"{self.num_sequences} packed sequences of {self.max_seq_len} tokens"
            fill = self.num_tokens / max(1, self.num_sequences * self.max_seq_len)
            layout += f" ({fill:.0%} filled)"
        else:
            layout = f"{self.num_sequences} sequences of ≤ {self.max_seq_len} tokens (padding mode)"
        text = f"{self.num_samples} samples → {layout}; {self.num_truncated} truncated to {self.max_seq_len}"
        if self.num_dropped:
            text += f"; {self.num_dropped} dropped with no trainable tokens"
        return text + f"; {self.num_label_tokens} of {self.num_tokens} tokens trained"


@dataclass
class PreparedData:
    train: SequenceDataset
    validation: SequenceDataset | None
    stats: DataStats  # train counts; stats.validation for the validation split

    def report(self) -> str:
        """One line for the run log."""
        text = self.stats.describe()
        if self.stats.validation is not None:
            text += f" | validation: {self.stats.validation.describe()}"
        return text


def build_datasets(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    data = recipe.data
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; load it with ligertune.data.load_tokenizer")

    train_source, train_name = _load_checked(recipe, data.split)
    order = np.arange(len(train_source))
    if data.shuffle:
        order = _rng(recipe.seed, SHUFFLE_STREAM).permutation(order)
    if data.max_samples is not None:
        order = order[: data.max_samples]

    validation, validation_stats = None, None
    if data.validation_split is not None:
        val_source, val_name = _load_checked(recipe, data.validation_split)
        validation, validation_stats = _prepare(
            val_source, np.arange(len(val_source)), val_name, data, tokenizer
        )
    elif data.validation_fraction > 0:
        held = max(1, round(len(order) * data.validation_fraction))
        if held >= len(order):
            raise DataError(
                f"{train_name}: data.validation_fraction {data.validation_fraction} of {len(order)} samples "
                "leaves nothing to train on; lower it or add data"
            )
        chosen = np.zeros(len(order), dtype=bool)
        chosen[_rng(recipe.seed, HOLDOUT_STREAM).choice(len(order), held, replace=False)] = True
        validation, validation_stats = _prepare(train_source, order[chosen], train_name, data, tokenizer)
        order = order[~chosen]

    train, stats = _prepare(train_source, order, train_name, data, tokenizer)
    if len(train) == 0:
        raise DataError(
            f"{train_name}: no training samples left after dropping those with no trainable tokens"
        )
    stats.validation = validation_stats
    return PreparedData(train, validation, stats)


def _load_checked(recipe: Recipe, split: str) -> tuple[datasets.Dataset, str]:
    source, name = load_split(recipe, split)
    check_columns(recipe.data.format, source.column_names, name, recipe.data.messages_field)
    return source, name


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _prepare(
    source: datasets.Dataset,
    indices: np.ndarray,
    name: str,
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[SequenceDataset, DataStats]:
    """Tokenize the rows at `indices` (in that order) and lay them out."""
    required, optional = columns_for(data.format, data.messages_field)
    columns = [c for c in required + optional if c in source.column_names]
    table = source.select_columns(columns).select(indices.tolist()).to_dict()
    rows = (
        (int(i), dict(zip(columns, values, strict=True)))
        for i, *values in zip(indices, *(table[c] for c in columns), strict=True)
    )
    samples = tokenize_rows(
        data.format,
        rows,
        tokenizer,
        train_on_inputs=data.train_on_inputs,
        messages_field=data.messages_field,
        source=name,
    )
    samples, truncated, dropped = truncate_and_mask(samples, data.max_seq_len)
    dataset = build_rows(samples, data.max_seq_len, tokenizer.pad_token_id, data.packing)
    stats = DataStats(
        num_samples=len(indices),
        num_truncated=truncated,
        num_dropped=dropped,
        num_sequences=len(dataset),
        num_tokens=dataset.num_tokens,
        num_label_tokens=dataset.num_label_tokens,
        max_seq_len=data.max_seq_len,
        packed=data.packing,
    )
    return dataset, stats
