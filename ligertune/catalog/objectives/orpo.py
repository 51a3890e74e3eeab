"""``orpo``: Odds Ratio Preference Optimization, reference-free, on preference pairs."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import ObjectiveOptions
from ligertune.catalog.objectives.metrics import PAIR_METRICS


class ORPOOptions(ObjectiveOptions):
    name: Literal["orpo"] = Field("orpo", description="The objective.")
    beta: float = Field(0.1, gt=0, description="λ: the weight of the odds-ratio term beside the NLL.")

    formats: ClassVar[tuple[str, ...]] = ("preference",)
    loss_head: ClassVar[str] = "pairs"
    metrics: ClassVar[tuple[str, ...]] = (*PAIR_METRICS, "nll", "log_odds_ratio")
    summary: ClassVar[str] = "preference pairs, NLL plus an odds-ratio term, no reference"
