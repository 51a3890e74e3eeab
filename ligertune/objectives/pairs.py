"""The common part of the preference objectives: a micro-batch of B pairs ([2B, S] rows, first
sequences then second ones, see `ligertune.data.preference`), one forward of the policy over
all 2B rows (chosen and rejected together), the reference's log-probs, then a loss per item.

An item is a pair (dpo, orpo, simpo) or an example (kto): ``count`` is B, on the host. The
objective returns Σ_items loss / N and its metrics as Σ_items value / N, which the loop sums
over the window into means (`ligertune.objectives.base`). Subclasses implement ``losses``.

The reference's log-probs come first: they are constants of the policy's loss. On the fused
path a *separable* objective (a pair's loss reads only that pair's log-probs: dpo, orpo,
simpo) then hands its ``losses`` to the policy's lm_head call (`logps.pair_sequence_loss`),
which evaluates it per chunk of pairs and computes the gradient in the same pass, without
computing the logits a second time in the backward. KTO's reference point is a mean over the
micro-batch, so it takes the two-step path: the rows' log-probs, then the loss.
"""

from __future__ import annotations

import torch
from torch import nn

from ligertune.catalog.objectives import ObjectiveOptions
from ligertune.objectives.base import Batch, Building, Objective, ObjectiveOutput
from ligertune.objectives.logps import label_tokens, lm_head_is_fused, pair_sequence_loss, sequence_logps
from ligertune.objectives.reference import Reference, build_reference


class PairObjective(Objective):
    """The common part of dpo, orpo, simpo and kto: `options` is the recipe's objective section
    (``beta`` and the objective's own options), `reference` where the reference log-probs come
    from (none for the reference-free objectives), `fused` whether the policy's lm_head runs the
    fused kernel."""

    separable = True  # the loss of a pair reads only its own rows (module docstring)

    def __init__(self, options: ObjectiveOptions, reference: Reference, fused: bool):
        self.options, self.reference, self.fused = options, reference, fused
        self.beta = options.beta

    @classmethod
    def build(cls, options: ObjectiveOptions, building: Building) -> PairObjective:
        fused = building.policy is not None and lm_head_is_fused(building.policy)
        kind = getattr(options, "reference", "none")  # the reference-free objectives have no such key
        return cls(options, build_reference(kind, options, building, fused), fused)

    def count(self, batch: Batch) -> int:
        self.reference.check(batch)
        return batch["input_ids"].shape[0] // 2

    def losses(
        self, logps: torch.Tensor, tokens: torch.Tensor, ref: torch.Tensor, batch: Batch | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss per item [B], metrics per item [B] each) from the rows' Σ log-probs, label
        token counts and reference Σ log-probs (all [2B]). `batch` is the micro-batch, for a
        loss that reads more of it (KTO's desirability); a separable objective's fused path
        calls this per chunk of pairs, on those pairs' values only, and passes None."""
        raise NotImplementedError

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        ref = self.reference.logps(model, batch).detach()
        n = num_items.to(torch.float32)
        if self.fused and self.separable:
            out = pair_sequence_loss(model, batch, self._chunk_loss(batch, ref, n))
            return ObjectiveOutput(out.loss, _means(out.extras, n))
        logps, tokens = sequence_logps(model, batch, self.fused)
        losses, metrics = self.losses(logps, tokens, ref, batch)
        return ObjectiveOutput(losses.sum() / n, _means(metrics, n))

    def _chunk_loss(self, batch: Batch, ref: torch.Tensor, n: torch.Tensor):
        """`GroupLoss.fn` of the one-pass path: ``losses`` on a chunk's pairs, summed over N,
        with the per-item metrics as the extras the kernel concatenates over the chunks."""
        tokens = label_tokens(batch["labels"])

        def loss(row_logps: torch.Tensor, pairs: slice):
            def rows(x):  # [2B] → the chunk's rows, first sequences then second ones, as row_logps
                return x.reshape(2, -1)[:, pairs].reshape(-1)

            losses, metrics = self.losses(row_logps.reshape(-1), rows(tokens), rows(ref), None)
            return losses.sum() / n, metrics

        return loss


def _means(metrics: dict[str, torch.Tensor], n: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-item metrics [B] → Σ / N each (`ligertune.objectives.base`), detached, fp32."""
    return {k: v.detach().float().sum() / n for k, v in sorted(metrics.items())}


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
