"""``dpo``: Direct Preference Optimization (Rafailov et al. 2023, "Direct Preference Optimization:
Your Language Model is Secretly a Reward Model") and its IPO and hinge variants.

With the policy's and the reference's sequence log-probs of the chosen (w) and rejected (l)
responses, the implicit rewards are r = β·(log π(y|x) − log π_ref(y|x)) and

    Δ = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))

    sigmoid:  −(1 − ε)·log σ(β·Δ) − ε·log σ(−β·Δ)      DPO; ε > 0 is conservative DPO (label
                                                     smoothing, Mitchell 2023), ε = 0 the paper
    ipo:      (Δ − 1/(2β))²                             IPO (Azar et al. 2023, "A General
                                                     Theoretical Paradigm to Understand Learning
                                                     from Human Preferences"), on log-probs
                                                     averaged over each response's tokens, as TRL
    hinge:    max(0, 1 − β·Δ)                           SLiC-HF (Zhao et al. 2023)

per pair. The reference is a frozen copy, the LoRA policy with adapters off, precomputed
columns, or none (reference-free: log π_ref = 0), see `ligertune.objectives.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ligertune.catalog.objectives.dpo import LOSS_TYPES, DPOOptions
from ligertune.objectives.base import Batch
from ligertune.objectives.pairs import PairObjective, halves, pair_metrics


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair from [B] log-probs (the module docstring;
    for ipo pass token-averaged log-probs)."""
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(
            -beta * delta
        )
    elif loss_type == "ipo":
        loss = (delta - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * delta)
    else:
        raise ValueError(f"loss_type={loss_type!r}: use one of {LOSS_TYPES}")
    return loss, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


class DPO(PairObjective):
    options_model = DPOOptions

    def losses(self, logps, tokens, ref, batch: Batch | None):
        loss_type = self.options.loss_type
        if loss_type == "ipo":  # IPO is defined on mean token log-probs (as TRL computes it)
            logps, ref = logps / tokens.clamp_min(1), ref / tokens.clamp_min(1)
        (chosen, rejected), (ref_c, ref_r) = halves(logps), halves(ref)
        loss, reward_c, reward_r = dpo_losses(
            chosen, rejected, ref_c, ref_r, self.beta, loss_type, self.options.label_smoothing
        )
        return loss, pair_metrics(chosen.detach(), rejected.detach(), reward_c, reward_r)
