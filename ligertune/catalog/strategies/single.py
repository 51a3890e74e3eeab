"""``none``: one process on one device (the default)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.strategies.base import ParallelOptions
from ligertune.catalog.strategies.fsdp import shard_with_fsdp


class SingleProcess(ParallelOptions):
    strategy: Literal["none"] = Field("none", description="The parallel strategy.")

    summary: ClassVar[str] = "one process, one device"
    label: ClassVar[str] = "one process"
    multi_process: ClassVar[bool] = False
    unsupported: ClassVar[dict[str, str]] = {
        "context parallel": "one process has no ranks to split a sequence over"
    }

    def memory_fixes(self, precision: str, world_size: int) -> list[tuple[str, dict]]:
        return [shard_with_fsdp(world_size)]
