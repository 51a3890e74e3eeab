"""``sft``: next-token cross entropy on the label tokens (the default objective)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import ObjectiveOptions


class SFTOptions(ObjectiveOptions):
    name: Literal["sft"] = Field("sft", description="The objective.")

    summary: ClassVar[str] = "next-token cross entropy on the label tokens"
