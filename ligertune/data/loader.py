"""Micro-batches for the training loop: seeded order, rank sharding, exact resume.

Each epoch draws one permutation of the rows from (seed, epoch). The global stream of
micro-batches is that permutation cut into slices of ``micro_batch_size``; slice
``i * world_size + r`` goes to rank r as its micro-batch i. So at every step the ranks
together see the same rows whatever the world size (2 ranks × 2 rows = 1 rank × 4 rows), a
resumed run on a different number of GPUs keeps the data order, and skipping ``start``
micro-batches resumes mid-epoch exactly. Rows that do not fill a last micro-batch on every
rank are dropped (they come back in other epochs, in other positions).

A `StreamingRows` dataset (``data.streaming``) has no length: its rows come in the stream's
order, cut the same way, and its "epoch" is the whole run (see ligertune/data/streaming.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ligertune.data.formats import IGNORE_INDEX
from ligertune.data.streaming import StreamingRows
from ligertune.errors import DataError

Batch = dict[str, torch.Tensor]


class MicroBatchLoader:
    """Yields micro-batch dicts of [B, S] int64 tensors: input_ids, labels, position_ids, and
    attention_mask in padding mode only. Packed rows rely on their position ids to keep samples
    apart, which needs ``model(**batch, use_cache=False)`` (see packing.py).

    `dataset` is any sequence of row dicts of 1-D tensors, such as a `SequenceDataset`.
    """

    def __init__(
        self,
        dataset: Sequence[dict[str, torch.Tensor]] | StreamingRows,
        micro_batch_size: int,
        *,
        seed: int,
        pad_token_id: int,
        packing: bool,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ):
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need micro_batch_size ≥ 1 and 0 ≤ rank < world_size, got {micro_batch_size}, {rank}, {world_size}"
            )
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.seed, self.pad_token_id, self.packing = seed, pad_token_id, packing
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        if isinstance(dataset, StreamingRows):
            self.batches_per_epoch = dataset.micro_batches
            return
        self.batches_per_epoch = len(dataset) // (micro_batch_size * world_size)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the data has {len(dataset)} sequences, fewer than one micro-batch on each rank "
                f"(micro_batch_size {micro_batch_size} × {world_size} ranks); "
                "lower training.micro_batch_size or add data"
            )

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of row indices, the same on every rank."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's micro-batches of `epoch`, skipping the first `start` (to resume)."""
        if not 0 <= start <= self.batches_per_epoch:
            raise ValueError(f"start must be in 0..{self.batches_per_epoch}, got {start}")
        size = self.micro_batch_size
        if isinstance(self.dataset, StreamingRows):
            yield from self._iter_stream(epoch, start)
            return
        order = self.order(epoch)
        for i in range(start, self.batches_per_epoch):
            first = (i * self.world_size + self.rank) * size
            yield self.collate([self.dataset[int(j)] for j in order[first : first + size]])

    def _iter_stream(self, epoch: int, start: int) -> Iterator[Batch]:
        """Micro-batch i · world_size + rank of the stream, from `start` on (the rows before
        are read and discarded: a stream cannot seek)."""
        group = self.micro_batch_size * self.world_size
        rows = self.dataset.rows(epoch)
        for _ in range(start * group):
            next(rows)
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        for _ in range(start, self.batches_per_epoch):
            window = [next(rows) for _ in range(group)]
            yield self.collate(window[mine])

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> Batch:
        if self.packing:
            lengths = {len(row["input_ids"]) for row in rows}
            if len(lengths) > 1:
                raise DataError(
                    f"packing is on but the rows have different lengths {sorted(lengths)}; "
                    "build the dataset with data.packing: true"
                )
            return {
                name: torch.stack([row[name] for row in rows])
                for name in ("input_ids", "labels", "position_ids")
            }
        longest = max(len(row["input_ids"]) for row in rows)
        batch = {
            "input_ids": torch.full((len(rows), longest), self.pad_token_id, dtype=torch.int64),
            "labels": torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.int64),
            # Pad positions keep counting: no restart, so nothing reads them as a packed sample.
            "position_ids": torch.arange(longest, dtype=torch.int64).repeat(len(rows), 1),
            "attention_mask": torch.zeros((len(rows), longest), dtype=torch.int64),
        }
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            batch["input_ids"][b, :n] = row["input_ids"]
            batch["labels"][b, :n] = row["labels"]
            batch["position_ids"][b, :n] = row["position_ids"]
            batch["attention_mask"][b, :n] = 1
        return batch


def loader_class(dataset) -> type[MicroBatchLoader]:
    """The loader of a split's rows: the ``loader`` their class names (pairs, prompts: collated
    their own way), else `MicroBatchLoader`."""
    return getattr(type(dataset), "loader", MicroBatchLoader)
