"""Samples → training rows, packed or one sample per row.

Packing concatenates whole samples into rows of exactly ``max_seq_len`` tokens. Position ids
restart at 0 at every sample, and that alone keeps attention inside each sample: with
``attention_mask=None``, transformers turns restarting position ids into a block-diagonal
causal mask (``masking_utils.find_packed_sequence_indices``), for sdpa and eager alike.
The model must run with ``use_cache=False``: transformers only looks for packed sequences
when no cache object exists, and with the config default (use_cache=True) it creates one,
so samples would silently attend to each other.

The tail of a row is padding with label −100 and position ids counting from 0 again, so it
is a "sample" of its own that no real token attends to.

Samples are packed first-fit in their (seeded, shuffled) order and never split across rows:
a split sample would lose its prompt or its start. The cost is some unused tail in each row;
`DataStats` reports how full the rows are.

The first token of every sample is labelled −100. The model scores logits[t] against
labels[t + 1], so that label would make the previous sample's last token predict the next
sample's first token, across a boundary the model cannot see. Nothing within a sample
predicts its first token, so masking it loses nothing in padding mode either.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ligertune.data.formats import IGNORE_INDEX, Sample

FIELDS = ("input_ids", "labels", "position_ids")
OPEN_ROWS = 32  # rows first-fit packing still tries to fill


class SequenceDataset:
    """Training rows: each a dict of 1-D int64 tensors input_ids, labels, position_ids.

    The rows are stored as three flat tensors and an offsets table (row i is
    ``offsets[i]:offsets[i + 1]``), which keeps a large dataset compact and cheap to pickle;
    indexing returns views. Packed rows are all exactly `max_seq_len` long; unpacked rows are
    one sample each, at most `max_seq_len`.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        offsets: torch.Tensor,
        *,
        max_seq_len: int,
        packed: bool,
        num_padding: int = 0,
    ):
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids
        self.offsets = offsets
        self.max_seq_len = max_seq_len
        self.packed = packed
        self.num_padding = num_padding  # pad tokens stored at the end of packed rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        index %= len(self)
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return {name: getattr(self, name)[start:end] for name in FIELDS}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self[i] for i in range(len(self)))

    @property
    def num_tokens(self) -> int:
        """Real tokens, not counting the padding at the end of packed rows."""
        return self.input_ids.numel() - self.num_padding

    @property
    def num_label_tokens(self) -> int:
        """Tokens that contribute to the loss."""
        return int((self.labels != IGNORE_INDEX).sum())

    def __repr__(self) -> str:
        layout = (
            f"packed to {self.max_seq_len}" if self.packed else f"one sample per row, ≤ {self.max_seq_len}"
        )
        return f"SequenceDataset({len(self)} rows, {layout})"


def truncate_and_mask(samples: list[Sample], max_seq_len: int) -> tuple[list[Sample], int, int]:
    """Cut samples to `max_seq_len`, mask each first label, drop samples left with no label.

    Returns (kept samples, number truncated, number dropped). Truncation keeps the start: the
    prompt and the beginning of the response (the EOS is lost).
    """
    kept, truncated, dropped = [], 0, 0
    for sample in samples:
        if len(sample.input_ids) > max_seq_len:
            truncated += 1
            sample = Sample(sample.input_ids[:max_seq_len], sample.labels[:max_seq_len])
        labels = [IGNORE_INDEX] + sample.labels[1:]
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            continue
        kept.append(Sample(sample.input_ids, labels))
    return kept, truncated, dropped


def first_fit(lengths: Sequence[int], max_seq_len: int, window: int = OPEN_ROWS) -> list[list[int]]:
    """Put each sample (by its length) in the oldest of the last `window` rows that still has
    room for it; returns each row's sample indices.

    Plain greedy packing (close a row as soon as the next sample does not fit) leaves the
    tail of every row empty; letting short samples fall back into recent rows fills them.
    The window bounds the work at O(samples × window) and keeps samples near their shuffled
    position. Deterministic: the same samples in the same order give the same rows.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    open_rows: list[int] = []  # indices into rows, oldest first
    for index, size in enumerate(lengths):
        target = next((r for r in open_rows if room[r] >= size), None)
        if target is None:
            target = len(rows)
            rows.append([])
            room.append(max_seq_len)
            open_rows.append(target)
            if len(open_rows) > window:
                open_rows.pop(0)
        rows[target].append(index)
        room[target] -= size
        if room[target] == 0:
            open_rows.remove(target)
    return rows


def build_rows(samples: list[Sample], max_seq_len: int, pad_token_id: int, packed: bool) -> SequenceDataset:
    """Lay samples (already truncated to `max_seq_len`) out as packed or one-per-row rows."""
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    ids = np.fromiter((t for s in samples for t in s.input_ids), dtype=np.int64, count=int(lengths.sum()))
    labels = np.fromiter((t for s in samples for t in s.labels), dtype=np.int64, count=int(lengths.sum()))
    return layout_rows(ids, labels, lengths, max_seq_len, pad_token_id, packed)


def layout_rows(
    ids: np.ndarray,
    labels: np.ndarray,
    lengths: np.ndarray,
    max_seq_len: int,
    pad_token_id: int,
    packed: bool,
) -> SequenceDataset:
    """`build_rows` on samples stored flat (sample i is ``ids[starts[i]:starts[i] + lengths[i]]``),
    as the cache holds them: the rows are gathered with numpy, without a Python object per token."""
    starts = (np.cumsum(lengths) - lengths).astype(np.int64)
    rows = first_fit(lengths.tolist(), max_seq_len) if packed else [[i] for i in range(len(lengths))]
    # The pieces of every row in order: samples (index ≥ 0) and the padding tail (-1).
    order, tails = [], []
    for row in rows:
        order += row
        tail = max_seq_len - int(lengths[row].sum()) if packed else 0
        if tail:
            order.append(-1)
            tails.append(tail)
    order_arr = np.array(order, dtype=np.int64)
    is_pad = order_arr < 0
    piece_len = np.where(is_pad, 0, lengths[np.maximum(order_arr, 0)])
    piece_len[is_pad] = np.array(tails, dtype=np.int64)
    piece_start = np.where(is_pad, -1, starts[np.maximum(order_arr, 0)])
    total = int(piece_len.sum())
    first = np.cumsum(piece_len) - piece_len  # each piece's offset (also for no pieces at all)
    within = np.arange(total, dtype=np.int64) - np.repeat(first, piece_len)
    source = np.repeat(piece_start, piece_len) + within  # -1 + within for padding: fixed below
    pad = np.repeat(is_pad, piece_len)
    source[pad] = 0
    flat_ids = np.where(pad, pad_token_id, ids[source] if len(ids) else 0)
    flat_labels = np.where(pad, IGNORE_INDEX, labels[source] if len(labels) else 0)
    row_lengths = [int(lengths[row].sum()) if not packed else max_seq_len for row in rows]
    offsets = torch.tensor([0] + row_lengths, dtype=torch.int64).cumsum(0)
    return SequenceDataset(
        torch.from_numpy(flat_ids.astype(np.int64)),
        torch.from_numpy(flat_labels.astype(np.int64)),
        torch.from_numpy(within),
        offsets=offsets,
        max_seq_len=max_seq_len,
        packed=packed,
        num_padding=int(sum(tails)),
    )
