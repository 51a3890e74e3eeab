"""The parent side of a compare: start each arm in a process of its own (or torchrun), wait for it
with a timeout, and merge its ranks' result files into one arm result."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ligertune.distributed.env import child_environment
from ligertune.distributed.launch import LaunchOptions, torchrun
from ligertune.tools.compare.plan import ARM_LOG, ARM_SPEC, STATUSES, ArmSpec, ComparePlan


def start_record(run_dir: Path) -> dict[str, Any]:
    """The ``start`` record `train` wrote to metrics.jsonl (main rank only): device, world
    size and FLOPs per token."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    starts = [
        r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines()) if r.get("event") == "start"
    ]
    return starts[-1] if starts else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def arm_command(spec_path: Path, nproc: int) -> list[str]:
    """The command that runs one arm: a plain process, or torchrun with `nproc` processes."""
    target = ["-m", "ligertune.tools.compare.arm", str(spec_path)]
    if nproc == 1:
        return [sys.executable, *target]
    return torchrun(target, LaunchOptions(nproc_per_node=nproc))


def _log_tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def _exit_description(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (often the host running out of memory)" if -code == signal.SIGKILL else ""
        return f"the arm process was killed by {name}{hint}"
    return f"the arm process exited with status {code} without writing a result"


def merge_rank_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's result from its ranks' files: rank 0's numbers (or the lowest rank's), the
    most telling status (an OOM on any rank explains the others' failures), and the peak
    memory over all ranks."""
    ranks = sorted(results, key=lambda r: r["rank"])
    merged = dict(ranks[0])
    worst = min(ranks, key=lambda r: STATUSES.index(r["status"]))
    merged["status"], merged["error"] = worst["status"], worst["error"]
    for key in ("peak_mem_allocated_gib", "peak_mem_reserved_gib", "peak_host_rss_gib"):
        values = [r[key] for r in ranks if r.get(key) is not None]
        merged[key] = max(values) if values else None
    merged["ranks_reported"] = len(ranks)
    del merged["rank"]
    return merged


def _empty_result() -> dict[str, Any]:
    return {
        "status": "error", "error": None, "steps_completed": 0, "losses": [], "wall_s": None,
        "device": None, "device_name": None, "kernel_mode": None, "world_size": None,
        "step_time_median_s": None, "tokens_per_s": None, "tokens_per_s_per_gpu": None,
        "label_tokens_per_s": None, "mfu": None, "peak_mem_allocated_gib": None,
        "peak_mem_reserved_gib": None, "peak_host_rss_gib": None, "ranks_reported": 0,
    }  # fmt: skip


def run_arm_process(
    arm: ArmSpec, plan: ComparePlan, *, env: dict[str, str] | None = None, timeout: float | None = None
) -> dict[str, Any]:
    """Run one arm to the end and return its result; failures become a result, never an exception.

    `env` adds variables to the arm's environment. After `timeout` seconds the arm is stopped
    (see below) and reported as an error, "timed out"."""
    if arm.directory.exists():
        shutil.rmtree(arm.directory)
    arm.directory.mkdir(parents=True)
    spec_path = arm.directory / ARM_SPEC
    write_json(spec_path, arm.as_json(plan.recipe_path, plan.steps))
    log_path = arm.directory / ARM_LOG
    timed_out = False
    with log_path.open("w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(
            arm_command(spec_path, plan.nproc),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_environment() | (env or {}),
            start_new_session=timeout is not None,  # so a timeout can stop torchrun's workers too
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            # torchrun passes the signal it gets on to its workers (they run in sessions of their
            # own) and kills them if they linger. SIGHUP, because `train` answers SIGTERM by
            # saving a checkpoint (minutes for an 8B model) and SIGHUP ends a worker at once. A
            # single process has nothing to pass a signal on to.
            proc.send_signal(signal.SIGHUP if plan.nproc > 1 else signal.SIGKILL)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    files = sorted(arm.directory.glob("result-rank*.json"))
    if files:
        result = merge_rank_results([json.loads(p.read_text(encoding="utf-8")) for p in files])
        if timed_out:
            result["status"] = "error"
            result["error"] = f"timed out after {timeout:g} s" + (
                f" ({result['error']})" if result["error"] else ""
            )
    else:
        result = _empty_result()
        tail = _log_tail(log_path)
        reason = f"timed out after {timeout:g} s" if timed_out else _exit_description(proc.returncode)
        result["error"] = reason + (f"; last lines of {log_path}:\n{tail}" if tail else "")
    return {"name": arm.name, "kernels": arm.kernels, **result, "log": str(log_path)}
