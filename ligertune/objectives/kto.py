"""``kto``: Kahneman-Tversky Optimization (Ethayarajh et al. 2024, "KTO: Model Alignment as
Prospect Theoretic Optimization"), on unpaired examples (prompt, completion, desirable or not).

With r(x, y) = log π(y|x) − log π_ref(y|x) and the reference point

    z₀ = max(0, mean over the micro-batch of r(x, y')),   y' a *mismatched* completion (the
                                                          next example's, ligertune/data/preference.py)

an estimate of KL(π‖π_ref) that gets no gradient, the loss of an example is

    desirable:    λ_D · (1 − σ(β·(r(x, y) − z₀)))
    undesirable:  λ_U · (1 − σ(β·(z₀ − r(x, y))))

with λ_D, λ_U = ``desirable_weight``, ``undesirable_weight`` (the paper balances them so that
λ_D·n_D / (λ_U·n_U) ∈ [1, 4/3]). As TRL. The difference: z₀ is this rank's micro-batch mean (TRL
gathers it over processes), so with several micro-batches per step it is a noisier estimate.
An item is an example: ``count`` is B. Metrics: KL (z₀), rewards β·r, log-probs.
"""

from __future__ import annotations

import torch

from ligertune.catalog.objectives.kto import KTOOptions
from ligertune.objectives.base import Batch
from ligertune.objectives.pairs import PairObjective, halves


def kto_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    desirable: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, reward, z₀) per example from [B] log-probs and the [B] bool ``desirable``."""
    z0 = (kl_logps - ref_kl_logps).mean().clamp(min=0).detach()
    r = logps - ref_logps
    loss = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))),
    )
    return loss, beta * r.detach(), z0.expand_as(r)


class KTO(PairObjective):
    options_model = KTOOptions
    separable = False  # z₀ is a mean over the micro-batch

    def losses(self, logps, tokens, ref, batch: Batch):
        (policy, kl), (ref_policy, ref_kl) = halves(logps), halves(ref)
        desirable = batch["pair_label"].bool()
        loss, reward, z0 = kto_losses(
            policy,
            ref_policy,
            kl.detach(),
            ref_kl,
            desirable,
            self.beta,
            self.options.desirable_weight,
            self.options.undesirable_weight,
        )
        return loss, {"kl": z0, "rewards": reward, "logps": policy.detach(), "desirable": desirable.float()}
