"""``ligertune train RECIPE --nproc-per-node G``: torchrun, started for the user.

A multi-process run is one ``ligertune train`` per GPU, started by PyTorch's launcher, which
gives each process its RANK, LOCAL_RANK and WORLD_SIZE and a rendezvous to find the others.
Users can call torchrun themselves, on every node::

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m ligertune train recipe.yaml [key=value ...]

or let ``ligertune train`` build that command from its options (`torchrun_command`):

- ``--nproc-per-node G`` alone: one node, ``--standalone`` (torchrun picks a free local port).
- with ``--nnodes N --rdzv-endpoint HOST:PORT``: the same command on every node, dynamic c10d
  rendezvous; the node whose address is HOST hosts the rendezvous store, ranks are assigned
  as the nodes join.
- with ``--node-rank R`` as well: static rendezvous at HOST:PORT, node R gets the ranks
  R·G … R·G + G − 1; node 0 must run on HOST (as with a SLURM- or MPI-style launch).

The recipe is validated here first, so a bad recipe fails once, with exit status 2, before
any process starts. The launcher runs in its own process group and gets the environment
unchanged (NCCL_* and CUDA_VISIBLE_DEVICES settings reach every rank). SIGINT and SIGTERM
sent to ``ligertune`` are forwarded to it once, so Ctrl-C or a preemption reaches each rank
exactly once: each finishes its step, they save a checkpoint together and stop (torchrun
gives them 30 s after forwarding a signal before it kills them; large models should rely on
``checkpoint.every_steps``). The exit status is torchrun's (non-zero when any rank failed:
its summary names the first failing rank and, through `record_errors`, its traceback), or
128 + the signal number after a forwarded signal.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ligertune.config import Recipe
from ligertune.distributed.env import launched_by_torchrun
from ligertune.errors import UsageError


class LaunchError(UsageError):
    """Launch options that cannot work; the message says which and how to fix them."""


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None

    @property
    def requested(self) -> bool:
        """Whether the user asked for a launch at all (any option away from its default)."""
        return (
            self.nproc_per_node is not None
            or self.nnodes != 1
            or self.node_rank is not None
            or self.rdzv_endpoint is not None
        )

    @property
    def world_size(self) -> int:
        return (self.nproc_per_node or 1) * self.nnodes


def check_options(options: LaunchOptions, recipe: Recipe) -> None:
    """Raise LaunchError naming the first problem of these options for this recipe."""
    if launched_by_torchrun():
        raise LaunchError(
            "this ligertune was itself started by torchrun; drop --nproc-per-node/--nnodes/--node-rank/"
            "--rdzv-endpoint (torchrun's own options decide the processes)"
        )
    if options.nproc_per_node is None:
        raise LaunchError(
            "--nnodes, --node-rank and --rdzv-endpoint need --nproc-per-node G (processes per node)"
        )
    if options.nproc_per_node < 1 or options.nnodes < 1:
        raise LaunchError(
            f"--nproc-per-node and --nnodes must be at least 1, got {options.nproc_per_node} and {options.nnodes}"
        )
    if options.nnodes > 1 and options.rdzv_endpoint is None:
        raise LaunchError(
            f"--nnodes {options.nnodes} needs --rdzv-endpoint HOST:PORT, an address of one of the nodes that all "
            "of them reach (run the same command on every node)"
        )
    if options.node_rank is not None:
        if options.rdzv_endpoint is None:
            raise LaunchError("--node-rank needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if not 0 <= options.node_rank < options.nnodes:
            raise LaunchError(f"--node-rank must be in 0..{options.nnodes - 1} for --nnodes {options.nnodes}")
    if options.rdzv_endpoint is not None:
        host, sep, port = options.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(
                f"--rdzv-endpoint {options.rdzv_endpoint!r} is not HOST:PORT (e.g. node0:29500)"
            )
    if options.world_size > 1 and not recipe.parallel.multi_process:
        raise LaunchError(
            f"{options.world_size} processes need a multi-process strategy; add parallel.strategy=ddp "
            "(or fsdp, deepspeed) to the recipe or the command line"
        )
    shards = recipe.parallel.context_parallel
    if options.world_size % shards:
        raise LaunchError(
            f"parallel.context_parallel: {shards} does not divide the {options.world_size} processes; use "
            f"--nproc-per-node (× --nnodes) a multiple of {shards}, or a context_parallel that divides it"
        )
    _check_gpus(options, recipe)


def _check_gpus(options: LaunchOptions, recipe: Recipe) -> None:
    import torch

    if recipe.training.device == "cpu" or not torch.cuda.is_available():
        return  # CPU processes (gloo), or a device error each rank reports itself
    visible = torch.cuda.device_count()
    if options.nproc_per_node > visible:
        raise LaunchError(
            f"--nproc-per-node {options.nproc_per_node} but this node has {visible} visible GPU(s); one process per "
            f"GPU: use --nproc-per-node {visible} (CUDA_VISIBLE_DEVICES decides which GPUs are visible)"
        )


def torchrun(target: list[str], options: LaunchOptions) -> list[str]:
    """``python -m torch.distributed.run <rendezvous options> <target>``: the one place a torchrun
    command line is built. `target` is what each worker runs (``["-m", "ligertune", "train", …]``)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={options.nproc_per_node}",
        f"--nnodes={options.nnodes}",
    ]
    if options.rdzv_endpoint is None:
        command.append("--standalone")
    elif options.node_rank is None:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={options.rdzv_endpoint}"]
    else:
        command += [
            "--rdzv-backend=static",
            f"--rdzv-endpoint={options.rdzv_endpoint}",
            f"--node-rank={options.node_rank}",
        ]
    return command + target


def torchrun_command(recipe_path: Path, overrides: list[str], options: LaunchOptions) -> list[str]:
    """The torchrun command line that runs ``ligertune train`` on this node."""
    return torchrun(["-m", "ligertune", "train", str(recipe_path), *overrides], options)


def launch(recipe_path: Path, overrides: list[str], options: LaunchOptions) -> int:
    """Run torchrun for this node and wait for it; returns the exit status to exit with."""
    process = subprocess.Popen(torchrun_command(recipe_path, overrides, options), start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame) -> None:
        received.append(signum)
        process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and status != 0:
        return 128 + received[0]
    return 128 - status if status < 0 else status  # killed by a signal: conventional 128 + N


_F = TypeVar("_F", bound=Callable)


def record_errors(fn: _F) -> _F:
    """Under torchrun, `fn` with torch.elastic's error recording: an exception escaping it is
    written to the error file torchrun reads, so its failure summary shows that rank's
    exception and traceback. Elsewhere, `fn` itself."""
    if not launched_by_torchrun():
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)
