"""One optimizer step's forward and backward, evaluation, and the stream of micro-batches.

One optimizer step takes the next ``gradient_accumulation_steps`` micro-batches from a stream
that runs across epoch boundaries (the data position is the epoch and the index of the next
micro-batch in it, which is all a resume needs). Its loss is the objective's mean over *every*
item of the window, on every rank:

    loss = Σ_micro Σ_items loss  /  N,   N = items in the window (label tokens for SFT), over ranks

Each micro-batch's objective returns its summed loss divided by N (`ligertune.objectives.base`
says why the objective, not the loop, divides), so the backward passes add up to the gradient
of the window's mean. A mean of per-micro-batch means would weight a token in a
short micro-batch more than one in a long one, so 4×1 and 1×4 micro-batches of the same rows
would train differently; with this normalisation they give the same loss and gradients.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ligertune.distributed import Runtime
from ligertune.objectives import Batch, Objective
from ligertune.objectives.causal_lm import count_label_tokens


def count_input_tokens(batch: Batch) -> int:
    """Input tokens the model computes on: the attention mask's ones in padding mode; every
    position of a packed row (its short padded tail included, which the matmuls process too)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}


@dataclass
class StepOutcome:
    loss: torch.Tensor  # 0-d, the window's mean loss over all ranks (on the device)
    items: torch.Tensor  # 0-d, N: the objective's items in the window over all ranks
    label_tokens: torch.Tensor  # 0-d, tokens with a label (the loss's targets), over all ranks
    tokens: torch.Tensor  # 0-d, input tokens in the window over all ranks
    # The objective's metrics (rewards, KL, ...): Σ over the window's items / N over all ranks, i.e.
    # the window's means. The objective returns the same keys for every micro-batch.
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def forward_backward(
    model: nn.Module,
    objective: Objective,
    micro_batches: list[Batch],
    runtime: Runtime,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> StepOutcome:
    """Forward and backward over one accumulation window; gradients accumulate in `.grad`.

    No host synchronisation: the item and token counts are taken from the CPU batches, and the
    results stay on the device until the caller reads them once.
    """
    device = runtime.device
    # Each rank's part of the rows (its context-parallel shard of each): counted and trained on.
    micro_batches = [runtime.shard_rows(b) for b in micro_batches]
    local_items = sum(objective.count(b) for b in micro_batches)
    n = runtime.all_reduce_sum(torch.tensor(local_items, device=device, dtype=torch.int64))
    # A window without a single item contributes zero loss and zero gradient.
    num_items = n.clamp(min=1)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    metric_sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro_batches):
        with runtime.accumulation_context(model, sync=i == len(micro_batches) - 1), autocast():
            out = objective(model, to_device(batch, device), num_items)
            runtime.backward(out.loss)
        loss_sum += out.loss.detach().double()
        for name, value in out.metrics.items():
            metric_sums[name] = metric_sums.get(name, 0) + value.detach().double()
    local_counts = [
        sum(count_label_tokens(b) for b in micro_batches),
        sum(count_input_tokens(b) for b in micro_batches),
    ]
    names = sorted(metric_sums)
    totals = runtime.all_reduce_sum(
        torch.cat(
            [
                loss_sum[None],
                torch.tensor(local_counts, device=device, dtype=torch.float64),
                *(metric_sums[k].reshape(1) for k in names),
            ]
        )
    )
    metrics = {k: totals[3 + i] for i, k in enumerate(names)}
    return StepOutcome(loss=totals[0], items=n, label_tokens=totals[1], tokens=totals[2], metrics=metrics)


@torch.no_grad()
def evaluate(
    model: nn.Module, objective: Objective, loader, runtime: Runtime, autocast, max_batches: int | None
) -> tuple[float, int]:
    """Item-weighted validation loss: Σ loss over every item / their number, over all ranks (not
    a mean of batch means). Returns (loss, items); loss is nan without items."""
    model.eval()
    device = runtime.device
    # N = 1: the objective's loss is then the plain sum over the batch's items.
    one = torch.ones((), device=device, dtype=torch.int64)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for index, batch in enumerate(loader.iter_epoch(0)):
        if max_batches is not None and index >= max_batches:
            break
        batch = runtime.shard_rows(batch)
        with autocast():
            out = objective(model, to_device(batch, device), one)
        count = torch.tensor(objective.count(batch), device=device, dtype=torch.float64)
        totals += torch.stack([out.loss.double(), count])
    model.train()
    loss_sum, items = runtime.all_reduce_sum(totals).tolist()
    return (loss_sum / items if items else math.nan), int(items)


def micro_batch_stream(
    loader, epoch: int, index: int, epochs: int | None
) -> Iterator[tuple[Batch, tuple[int, int]]]:
    """Micro-batches from (epoch, index) on, each with the position of the *next* one;
    endless when `epochs` is None (max_steps runs), else ending after `epochs` passes."""
    per_epoch = loader.batches_per_epoch
    while epochs is None or epoch < epochs:
        for batch in loader.iter_epoch(epoch, start=index):
            index += 1
            yield batch, ((epoch, index) if index < per_epoch else (epoch + 1, 0))
        epoch, index = epoch + 1, 0
