"""Inside one arm's process: train the arm's recipe, record every step, write this rank's result.

Run as ``python -m ligertune.tools.compare.arm <arm dir>/arm.json`` (under torchrun for an arm
of several processes); `ligertune.tools.compare.runner` starts it and reads the result files.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ligertune.config import Recipe, load_recipe
from ligertune.distributed.env import launched_as
from ligertune.errors import OutOfMemoryError
from ligertune.run.metrics import Throughput, peak_bf16_flops, peak_memory_gib
from ligertune.tools.compare.runner import start_record, write_json
from ligertune.tools.env import kernel_mode
from ligertune.training import train


class _ArmFinished(Exception):
    """Raised by the step hook after the last step, so `train` stops before its final checkpoint."""


class _StepLog:
    """`train`'s ``on_step_end`` hook: keeps every step's numbers, ends the run after the last."""

    def __init__(self, steps: int):
        self.steps = steps
        self.records: list[Any] = []

    def __call__(self, record) -> None:
        self.records.append(record)
        if record.step >= self.steps:
            raise _ArmFinished


def _peak_host_rss_gib() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak * 1024 / 2**30  # bytes on macOS, KiB on Linux


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _measure(recipe: Recipe | None, log: _StepLog, run_dir: Path) -> dict[str, Any]:
    """Speed and memory of an arm from its step records (`ligertune.run.metrics` definitions)."""
    start = start_record(run_dir)
    device = torch.device(start.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    world = int(start.get("world_size") or launched_as().world_size)
    warmup = recipe.logging.throughput_warmup_steps if recipe is not None else 0
    flops = start.get("flops_per_token")
    throughput = Throughput(warmup, world, flops or 0.0, peak_bf16_flops(device) if flops else None)
    for r in log.records:
        throughput.add_step(r.seconds, r.label_tokens, r.tokens)
    rates = throughput.rates(throughput.run)
    timed = [r.seconds for r in log.records[warmup:]]
    allocated, reserved = peak_memory_gib(device) if torch.cuda.is_initialized() else (None, None)
    on_gpu = device.type == "cuda"
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if on_gpu else f"CPU ({os.cpu_count()} cores)",
        "kernel_mode": kernel_mode(),
        "world_size": world,
        "step_time_median_s": statistics.median(timed) if timed else None,
        "tokens_per_s": rates["tokens_per_s"],
        "tokens_per_s_per_gpu": rates["tokens_per_s_per_gpu"],
        "label_tokens_per_s": rates["label_tokens_per_s"],
        "mfu": rates["mfu"],
        "peak_mem_allocated_gib": allocated,
        "peak_mem_reserved_gib": reserved,
        "peak_host_rss_gib": _peak_host_rss_gib(),
    }


def run_arm(spec_path: Path) -> int:
    """Train one arm and write ``result-rank<r>.json`` next to its spec. Exit status 0 when the
    arm ran every step; 1 otherwise, so that torchrun stops the other ranks of a failed arm."""
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    rank = launched_as().rank
    log = _StepLog(spec["steps"])
    recipe = None
    status, error = "ok", None
    started = time.perf_counter()
    try:
        recipe = load_recipe(spec["recipe"], spec["overrides"])
        result = train(recipe, on_step_end=log)
        status = "error"
        error = f"training stopped after {result.steps} of {spec['steps']} steps" + (
            f" ({signal.Signals(result.signal).name})" if result.signal else ""
        )
    except _ArmFinished:
        if any(not (math.isfinite(r.loss) and math.isfinite(r.grad_norm)) for r in log.records):
            status = "nonfinite"
    except (torch.OutOfMemoryError, OutOfMemoryError) as e:
        status, error = "oom", str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    except Exception as e:  # reported, not raised: the parent reports every arm whatever happens
        traceback.print_exc()
        status, error = "error", f"{type(e).__name__}: {e}"
    wall = time.perf_counter() - started
    run_dir = Path(spec_path).parent
    record = {
        "rank": rank,
        "status": status,
        "error": error,
        "steps_completed": len(log.records),
        "losses": [_finite_or_none(r.loss) for r in log.records],
        "wall_s": wall,
        **_measure(recipe, log, run_dir),
    }
    write_json(run_dir / f"result-rank{rank}.json", record)
    print(f"arm {spec['name']} rank {rank}: {status}" + (f": {error}" if error else ""), flush=True)
    return 0 if status in ("ok", "nonfinite") else 1


if __name__ == "__main__":
    sys.exit(run_arm(Path(sys.argv[1])))
