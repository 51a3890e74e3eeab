"""``ddp``: DistributedDataParallel, a whole replica per rank, gradients all-reduced."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from ligertune.catalog.strategies.base import ParallelOptions
from ligertune.catalog.strategies.fsdp import shard_with_fsdp


class DDPParallel(ParallelOptions):
    strategy: Literal["ddp"] = Field("ddp", description="The parallel strategy.")

    summary: ClassVar[str] = "DistributedDataParallel: every rank holds the whole model"
    label: ClassVar[str] = "DDP"

    def memory_fixes(self, precision: str, world_size: int) -> list[tuple[str, dict]]:
        return [shard_with_fsdp(world_size)]
