"""``kto``: Kahneman-Tversky Optimization on unpaired desirable/undesirable examples, against a
reference model."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import ReferenceOptions


class KTOOptions(ReferenceOptions):
    name: Literal["kto"] = Field("kto", description="The objective.")
    beta: float = Field(0.1, gt=0, description="β: the strength of the KL constraint to the reference.")
    desirable_weight: float = Field(1.0, gt=0, description="Weight of desirable examples' losses.")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of undesirable examples' losses.")

    formats: ClassVar[tuple[str, ...]] = ("kto",)
    # z₀ is a mean over the micro-batch, so its loss is not separable by pairs: log-probs first.
    loss_head: ClassVar[str] = "logprobs"
    metrics: ClassVar[tuple[str, ...]] = ("kl", "rewards", "logps", "desirable")
    summary: ClassVar[str] = "unpaired desirable/undesirable examples against a reference model"
