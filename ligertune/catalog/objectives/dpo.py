"""``dpo``: Direct Preference Optimization and its IPO and hinge variants, on preference pairs,
against a reference model's log-probs (`ligertune.objectives.dpo` has the formulas)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import ReferenceOptions
from ligertune.catalog.objectives.metrics import PAIR_METRICS

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


class DPOOptions(ReferenceOptions):
    name: Literal["dpo"] = Field("dpo", description="The objective.")
    beta: float = Field(0.1, gt=0, description="β: the strength of the KL constraint to the reference.")
    loss_type: Literal[LOSS_TYPES] = Field(
        "sigmoid", description="sigmoid (DPO), ipo (IPO, on mean token log-probs) or hinge (SLiC)."
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="sigmoid: assumed fraction of flipped labels (conservative DPO)."
    )

    formats: ClassVar[tuple[str, ...]] = ("preference",)
    loss_head: ClassVar[str] = "pairs"
    metrics: ClassVar[tuple[str, ...]] = PAIR_METRICS
    summary: ClassVar[str] = "preference pairs against a reference model (DPO, IPO, hinge)"
