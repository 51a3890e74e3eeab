"""The common part of the preference objectives: a micro-batch of B pairs ([2B, S] rows, first
sequences then second ones, see `ligertune.data.preference`), one forward of the policy over
all 2B rows (chosen and rejected together), the reference's log-probs, then a loss per item.

An item is a pair (dpo, orpo, simpo) or an example (kto): ``count`` is B, on the host. The
objective returns Σ_items loss / N and its metrics as Σ_items value / N, which the loop sums
over the window into means (`ligertune.objectives.base`). Subclasses implement ``losses``.
"""

from __future__ import annotations

import torch
from torch import nn

from ligertune.objectives.base import Batch, ObjectiveOutput
from ligertune.objectives.logps import sequence_logps
from ligertune.objectives.reference import Reference


class PairObjective:
    name = "pairs"

    def __init__(self, beta: float, reference: Reference, fused: bool, **options):
        self.beta, self.reference, self.fused, self.options = beta, reference, fused, options

    def count(self, batch: Batch) -> int:
        self.reference.check(batch)
        return batch["input_ids"].shape[0] // 2

    def losses(
        self, logps: torch.Tensor, tokens: torch.Tensor, ref: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss per item [B], metrics per item [B] each) from the rows' Σ log-probs, label
        token counts and reference Σ log-probs (all [2B])."""
        raise NotImplementedError

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        logps, tokens = sequence_logps(model, batch, self.fused)
        ref = self.reference.logps(model, batch).detach()
        losses, metrics = self.losses(logps, tokens, ref, batch)
        n = num_items.to(losses.dtype)
        return ObjectiveOutput(
            losses.sum() / n, {k: v.detach().float().sum() / n for k, v in sorted(metrics.items())}
        )


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second sequences' values of a [2B] tensor."""
    return x.chunk(2)


def pair_metrics(
    chosen: torch.Tensor, rejected: torch.Tensor, reward_c: torch.Tensor, reward_r: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What practitioners read (TRL's names, '/' → '_'): the implicit rewards of both responses,
    their margin, whether the chosen one wins, and the policy's log-probs."""
    return {
        "rewards_chosen": reward_c,
        "rewards_rejected": reward_r,
        "rewards_margin": reward_c - reward_r,
        "rewards_accuracy": (reward_c > reward_r).float(),
        "logps_chosen": chosen,
        "logps_rejected": rejected,
    }
