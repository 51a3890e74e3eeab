"""``simpo``: Simple Preference Optimization, reference-free, length-normalised rewards."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import ObjectiveOptions
from ligertune.catalog.objectives.metrics import PAIR_METRICS


class SimPOOptions(ObjectiveOptions):
    name: Literal["simpo"] = Field("simpo", description="The objective.")
    beta: float = Field(2.0, gt=0, description="β: the scale of the length-normalised reward.")
    gamma_beta_ratio: float = Field(0.5, ge=0.0, description="The target margin γ as a fraction of β.")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="Assumed fraction of flipped labels.")

    formats: ClassVar[tuple[str, ...]] = ("preference",)
    loss_head: ClassVar[str] = "pairs"
    metrics: ClassVar[tuple[str, ...]] = PAIR_METRICS
    summary: ClassVar[str] = "preference pairs, length-normalised reward with a margin, no reference"
