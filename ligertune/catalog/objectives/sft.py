"""``sft``: next-token cross entropy on the label tokens (the default objective)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import ObjectiveOptions


class SFTOptions(ObjectiveOptions):
    name: Literal["sft"] = Field("sft", description="The objective.")

    summary: ClassVar[str] = "next-token cross entropy on the label tokens"
    # Mixture-of-experts models with their router loss on only (docs/moe.md).
    metrics: ClassVar[tuple[str, ...]] = ("aux_loss", "expert_load_max", "expert_load_mean")
