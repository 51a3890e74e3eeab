"""``orpo``: Odds Ratio Preference Optimization (Hong et al. 2024, "ORPO: Monolithic Preference
Optimization without Reference Model"). Reference-free; per pair

    P(y|x) = exp( (1/|y|)·Σ_t log π(y_t | x, y_<t) )          (the mean token log-prob)
    log odds(y|x) = log P − log(1 − P)
    L = L_SFT + λ·L_OR,   L_SFT = −(1/|y_w|)·log π(y_w|x),
                          L_OR  = −log σ( log odds(y_w|x) − log odds(y_l|x) )

with λ = ``objective.beta`` (default 0.1, as TRL). L_SFT is the paper's per-sequence mean NLL of
the chosen response (TRL averages the NLL over all chosen tokens of the batch instead, which
weights long responses more). log(1 − P) is computed as log(−expm1(log P)), stable near P → 1.
Rewards (for the metrics, as TRL): β·mean token log-prob.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ligertune.catalog.objectives.orpo import ORPOOptions
from ligertune.objectives.base import Batch
from ligertune.objectives.pairs import PairObjective, halves, pair_metrics


def orpo_losses(
    mean_chosen: torch.Tensor, mean_rejected: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, NLL, log odds ratio) per pair from [B] mean token log-probs."""
    log_odds = (mean_chosen - mean_rejected) - (
        torch.log(-torch.expm1(mean_chosen)) - torch.log(-torch.expm1(mean_rejected))
    )
    nll = -mean_chosen
    return nll - lam * F.logsigmoid(log_odds), nll.detach(), log_odds.detach()


class ORPO(PairObjective):
    options_model = ORPOOptions

    def losses(self, logps, tokens, ref, batch: Batch | None):
        mean = logps / tokens.clamp_min(1)
        chosen, rejected = halves(mean)
        loss, nll, log_odds = orpo_losses(chosen, rejected, self.beta)
        metrics = pair_metrics(
            *halves(logps.detach()), self.beta * chosen.detach(), self.beta * rejected.detach()
        )
        return loss, {**metrics, "nll": nll, "log_odds_ratio": log_odds}
