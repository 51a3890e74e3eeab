"""Context parallelism: each sequence of a micro-batch split over the ranks of a context-parallel
group (``parallel.context_parallel: N``), on top of ddp or fsdp.

**The mesh.** The job's W ranks form a (W/N data-parallel) × (N context-parallel) grid: ranks
``d·N … d·N + N − 1`` (consecutive, so on one node when N divides the GPUs per node) are
context-parallel group d. They load the same rows (the loader shards the data over the W/N
groups: `Runtime.data_rank`) and each computes its share of every row's tokens.

**The sharding** (`shard_rows`): the labels are shifted *before* the split (position t keeps
the label of token t + 1, and the last position none), so each shard's loss is a plain sum over
its own positions and the shards' sums add up to the whole row's. The row is padded to a
multiple of 2N (input id 0, ignored label, position ids counting on, attention-mask 0): padding
comes after every real token, so under the causal mask no real token sees it. It is then cut
into 2N chunks and rank r keeps chunks r and 2N − 1 − r
(`ligertune.models.attention.zigzag_positions`), with the original position ids, so RoPE
rotates every token as in the whole row. The shard carries its targets as ``shift_labels``
(which Hugging Face's loss and our fused linear cross entropy take as already shifted) and as
``labels`` (whose presence turns the loss on).

**The gradients.** The loss count N of a step is summed over every rank (the loop's
all-reduce), and each token is on exactly one rank, so it is the one-process count; each rank's
loss is its tokens' share of the step mean. DDP and FSDP2 reduce over the whole world (the
runtime's one-dimensional mesh), which sums the context-parallel ranks' gradients too: each
holds the gradient of its own tokens' loss (the K/V all-gather's backward has already sent every
rank the gradient its keys and values got from the other ranks' queries). FSDP2 therefore shards
the model over all W ranks, not just the data-parallel ones: the least memory per GPU.

The attention itself is `ligertune.models.attention.install_context_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ligertune.data.formats import IGNORE_INDEX
from ligertune.errors import RecipeError
from ligertune.models.attention import ContextSplit, zigzag_positions


def context_split(shards: int, world_size: int, rank: int) -> ContextSplit:
    """This rank's context-parallel group of `shards` consecutive ranks (module docstring).
    *Collective*: every rank creates every group, as torch.distributed requires."""
    if world_size % shards:
        raise RecipeError(
            [
                f"parallel.context_parallel: {shards} does not divide the job's {world_size} processes; use a "
                f"context_parallel that divides it, or --nproc-per-node (× --nnodes) a multiple of {shards}"
            ]
        )
    groups = [list(range(start, start + shards)) for start in range(0, world_size, shards)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return ContextSplit(mine, shards, rank % shards)


def shard_rows(batch: dict[str, torch.Tensor], split: ContextSplit) -> dict[str, torch.Tensor]:
    """This rank's shard of a micro-batch of ``[B, S]`` rows (module docstring): ``[B, S'/N]``
    tensors, S' = S rounded up to a multiple of 2N."""
    shards = split.shards
    labels = batch["labels"]
    length = labels.shape[1]
    padded = -(-length // (2 * shards)) * (2 * shards)
    extra = padded - length
    targets = F.pad(labels[:, 1:], (0, 1 + extra), value=IGNORE_INDEX)
    positions = batch["position_ids"]
    counting_on = positions[:, -1:] + torch.arange(1, extra + 1, dtype=positions.dtype)
    rows = {
        "input_ids": F.pad(batch["input_ids"], (0, extra), value=0),
        "position_ids": torch.cat([positions, counting_on], dim=1),
        "shift_labels": targets,
    }
    if "attention_mask" in batch:
        rows["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=0)
    index = zigzag_positions(padded, shards, split.rank)
    shard = {name: tensor[:, index] for name, tensor in rows.items()}
    shard["labels"] = shard["shift_labels"]
    return shard
