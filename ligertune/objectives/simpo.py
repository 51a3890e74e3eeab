"""``simpo``: Simple Preference Optimization (Meng et al. 2024, "SimPO: Simple Preference
Optimization with a Reference-Free Reward"). Reference-free; the reward is the length-normalised
log-prob r(y|x) = (β/|y|)·log π(y|x), and per pair

    L = −(1 − ε)·log σ( r(y_w|x) − r(y_l|x) − γ ) − ε·log σ( −(r(y_w|x) − r(y_l|x) − γ) )

with the target margin γ = ``gamma_beta_ratio``·β (the paper tunes γ/β ∈ [0.3, 0.8]; default
β = 2.0, γ/β = 0.5) and ε = ``label_smoothing`` (0 in the paper; TRL's CPO trainer has it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ligertune.catalog.objectives.simpo import SimPOOptions
from ligertune.objectives.base import Batch
from ligertune.objectives.pairs import PairObjective, halves, pair_metrics


def simpo_losses(
    mean_chosen: torch.Tensor,
    mean_rejected: torch.Tensor,
    beta: float,
    gamma_beta_ratio: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair from [B] mean token log-probs."""
    logits = beta * (mean_chosen - mean_rejected) - gamma_beta_ratio * beta
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, beta * mean_chosen.detach(), beta * mean_rejected.detach()


class SimPO(PairObjective):
    options_model = SimPOOptions

    def losses(self, logps, tokens, ref, batch: Batch | None):
        chosen, rejected = halves(logps / tokens.clamp_min(1))
        loss, reward_c, reward_r = simpo_losses(
            chosen,
            rejected,
            self.beta,
            self.options.gamma_beta_ratio,
            self.options.label_smoothing,
        )
        return loss, pair_metrics(*halves(logps.detach()), reward_c, reward_r)
