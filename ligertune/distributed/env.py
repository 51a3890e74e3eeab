"""What the launcher told this process: the one place that reads torchrun's environment.

torchrun (and ``ligertune train --nproc-per-node``, which runs it) starts one process per GPU and
gives each RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE, plus TORCHELASTIC_RUN_ID, which
marks a process torchrun started. A process started without a launcher is rank 0 of 1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# torchrun sets this for every process it starts (and for nothing else).
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"
# Variables torchrun sets for its workers: a launch from inside one must not inherit them.
LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


@dataclass(frozen=True)
class LaunchedAs:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # processes on this node

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1


def launched_as() -> LaunchedAs:
    """This process's place in the job, as the launcher set it (rank 0 of 1 without one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return LaunchedAs(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def launched_by_torchrun() -> bool:
    return TORCHRUN_MARK in os.environ


def has_rendezvous() -> bool:
    """Whether a launcher set up an env:// rendezvous (WORLD_SIZE and the master address)."""
    return "WORLD_SIZE" in os.environ


def rank_label() -> str:
    """``"rank 2/4: "`` in a process of a multi-process launch, else ``""``: prefixes this
    process's error messages so that a failing rank names itself in the job's output."""
    launched = launched_as()
    return f"rank {launched.rank}/{launched.world_size}: " if launched.multi_process else ""


def child_environment() -> dict[str, str]:
    """This process's environment without the launcher's variables, for a child process that is
    launched on its own (a compare arm, a profiled provider), with unbuffered Python output."""
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env
