"""`ligertune compare`: what the kernels buy on *your* recipe, and proof they do not change training.

The recipe runs as several *arms*, one after another, each in a process of its own so that its
peak memory is its own: ``off`` (every kernel off), ``on`` (the chosen kernels on) and, with
``--ablate``, one arm per kernel with only that kernel on (a kernel for which the ``on`` arm
patched no module, such as LayerNorm in a Llama, gets no arm: it would only repeat ``off``;
the report's notes name it). Every arm gets the same seed, hence
the same random initial weights (`ligertune.models.build_model` seeds the init before
patching) or the same loaded checkpoint, the same data order and the same number of steps, so
the per-step losses of two arms differ only by what the kernels compute differently.

Each arm is `train` with these overrides on top of the user's recipe and overrides::

    kernels=none [kernels.<k>=true ...]      training.max_steps=N     output_dir=<out>/<arm>
    training.eval_every=null   training.on_nonfinite=skip   checkpoint.every_steps=null
    checkpoint.resume=none     checkpoint.export_hf=false   logging.progress=plain

``on_nonfinite=skip`` keeps a NaN step in the record (it would otherwise end the arm), and the
arm stops right after its last step, before `train` writes its final checkpoint: the arms are
measurements, and an 8B model's weights and optimizer state would cost minutes and ~100 GB of
disk per arm. With more than one process per arm (``--nproc-per-node G``, or a compare that was
itself started by torchrun with G processes on one node) each arm is launched with
``python -m torch.distributed.run --standalone --nproc-per-node G``, so every arm has the same
world size; every rank writes a result file and the parent merges them (peak memory is the
maximum over ranks).

Arm result
    ``status``: ``ok``; ``oom`` (``torch.OutOfMemoryError``; the peak memory reached before it
    is kept: in the headline case the ``off`` arm does not fit and the ``on`` arm does);
    ``nonfinite`` (some step's loss or gradient norm was NaN/inf); ``error`` (anything else,
    with the message; the arm's full output is in ``<out>/<arm>/arm.log``). The parent never
    stops on an arm's failure: the other arms run and are reported.
    Speed: tokens/s and tokens/s/GPU over all input tokens, MFU and the median step time, all
    without the recipe's ``logging.throughput_warmup_steps`` first steps (the definitions of
    `ligertune.metrics`, computed by its `Throughput`). Memory: peak allocated and reserved by
    the CUDA caching allocator, and the process's peak host RSS (the only memory number on CPU).

Verdict (each arm against ``off``)
    Per step k, with L the token-mean training loss of the step:

        rel_k = |L_arm(k) − L_off(k)| / |L_off(k)|

    *parity* when both arms ran every step and rel_k ≤ rtol for all k (a step where both losses
    are non-finite counts as agreeing); *diverged at step k* at the first k with rel_k > rtol,
    or where exactly one of the two losses is non-finite; otherwise (an arm stopped early
    without a divergence before) *incomplete*. rtol depends on the precision:

    - ``fp32``: 1e-4. Both arms compute the same math in fp32 in a different order (fused
      reductions, recomputation in the backward); each op differs by a few fp32 ulps (~1e-7).
      Measured on the quickstart (CPU, 20 steps): at most 1.6e-7, one or two ulps of the
      loss. The ~500× margin absorbs longer runs and larger models; what it lets through is
      smaller than what the kernels' own float64-reference tests catch, while gross errors (a
      wrong scale, a mis-rotated channel, a wrong gradient) move the loss far beyond it.
    - ``bf16`` and ``bf16-mixed``: 2e-2. bf16 keeps 8 significant bits (one rounding: up to
      2⁻⁹ ≈ 2e-3 relative). The kernels keep fp32 intermediates where eager PyTorch rounds every
      op's output to bf16, so the arms legitimately round differently in every layer (~1e-3 on
      one forward's loss); the optimizer then feeds the differences back into the weights
      (with bf16 parameters an update rounds away or not depending on the last bit), and the
      two trajectories drift apart with the number of steps. 2e-2 (about ten bf16 roundings)
      is chosen to hold over the default 20 steps (the GPU tests check it on the quickstart
      and on a 4-layer Llama-3.2-1B shape). Compare over few steps: any two runs of chaotic
      training separate eventually, so a long comparison says less, not more. ``--rtol``
      overrides the rule.

Outputs in ``--out`` (default ``<run_dir>-compare``): ``compare.json`` (schema
`SCHEMA`, described in docs/compare.md), ``compare.md``, ``compare.png`` and one directory per
arm with its metrics and log; a rich table on the terminal (`ligertune.report`).

Test-only: when ``LIGERTUNE_COMPARE_INJECT`` names a Python module, each arm process imports it
and calls its ``inject(arm_name)`` before training. The test suite uses it to break a kernel or
to raise an out-of-memory error in one arm; nothing else in ligertune reads it.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ligertune.recipe import KERNEL_NAMES, KernelsSection, Recipe, RecipeError, load_recipe

SCHEMA = "ligertune-compare/1"
BASELINE = "off"
DEFAULT_STEPS = 20
# Relative per-step loss tolerance by training.precision (see the module docstring).
RTOL = {"fp32": 1e-4, "bf16": 2e-2, "bf16-mixed": 2e-2}
INJECT_ENV = "LIGERTUNE_COMPARE_INJECT"

ARM_SPEC = "arm.json"  # written into each arm directory; also marks the directory as ours
ARM_LOG = "arm.log"
# Arm statuses, most telling first: an OOM on one rank explains the errors of the others.
STATUSES = ("oom", "error", "nonfinite", "ok")

# Recipe keys the compare sets itself, and the option that sets them instead.
_CONTROLLED = {"kernels": "--kernels", "training.max_steps": "--steps", "output_dir": "--out"}
# Variables torchrun sets for its workers: a nested launch must not inherit the parent's.
_LAUNCHER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


class CompareError(ValueError):
    """Bad options for `ligertune compare`; the message says what to change."""


# --------------------------------------------------------------------------------------------
# The plan: which arms, with which overrides
# --------------------------------------------------------------------------------------------


@dataclass
class ArmSpec:
    name: str
    kernels: list[str]
    overrides: list[str]
    directory: Path

    def as_json(self, recipe: Path, steps: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "kernels": self.kernels,
            "recipe": str(recipe),
            "overrides": self.overrides,
            "steps": steps,
        }


@dataclass
class ComparePlan:
    recipe_path: Path
    overrides: list[str]
    recipe: Recipe  # the user's recipe with the user's overrides
    steps: int
    kernels: list[str]
    ablate: bool
    out: Path
    nproc: int
    rtol: float
    rtol_rule: str
    arms: list[ArmSpec] = field(default_factory=list)


def parse_kernels(text: str | None, recipe: Recipe) -> list[str]:
    """``--kernels``: a comma list of kernel names or ``all`` (the default selection of a
    recipe's ``kernels: all``). Left out: the kernels the recipe enables, or ``all`` when it
    enables none."""
    if text is None or not text.strip():
        return recipe.kernels.enabled() or KernelsSection.preset("all").enabled()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return KernelsSection.preset("all").enabled()
    problems = []
    for name in names:
        if name not in KERNEL_NAMES:
            close = difflib.get_close_matches(name, KERNEL_NAMES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{name!r}{hint}")
    if problems:
        raise CompareError(
            f"--kernels: unknown kernel {', '.join(problems)}; choose from {', '.join(KERNEL_NAMES)}, or all"
        )
    if {"cross_entropy", "fused_linear_cross_entropy"} <= set(names):
        raise CompareError(
            "--kernels: cross_entropy and fused_linear_cross_entropy replace the same loss; choose one"
        )
    return sorted(set(names), key=KERNEL_NAMES.index)


def _check_user_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.partition("=")[0]
        for controlled, option in _CONTROLLED.items():
            if key == controlled or key.startswith(controlled + "."):
                raise CompareError(f"{item}: compare sets {controlled} for each arm; use {option} instead")


def launched_world() -> tuple[int, int, int]:
    """(rank, world size, processes on this node) of this process as torchrun started it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def processes_per_arm(requested: int | None) -> int:
    """``--nproc-per-node``, or the world size of a compare launched by torchrun."""
    _, world, local = launched_world()
    if world > 1:
        if world != local:
            raise CompareError(
                f"compare was launched as {world} processes over several nodes; arms run on one node: "
                "launch it once and pass --nproc-per-node G"
            )
        if requested is not None and requested != world:
            raise CompareError(
                f"--nproc-per-node {requested} disagrees with the {world} processes torchrun started; "
                "pass one or the other"
            )
        return world
    if requested is not None and requested < 1:
        raise CompareError(f"--nproc-per-node must be at least 1, got {requested}")
    return requested or 1


def arm_recipe_overrides(overrides: list[str], kernels: list[str], steps: int, directory: Path) -> list[str]:
    """The user's overrides plus what every arm sets: only `kernels` on, `steps` steps, its own
    output directory, and nothing that an arm does not need (eval, checkpoints, export)."""
    return [
        *overrides,
        "kernels=none",
        *(f"kernels.{k}=true" for k in kernels),
        f"training.max_steps={steps}",
        f"output_dir={json.dumps(str(directory))}",  # a JSON string is YAML, whatever the path holds
        "training.eval_every=null",
        "training.on_nonfinite=skip",
        "checkpoint.every_steps=null",
        "checkpoint.resume=none",
        "checkpoint.export_hf=false",
        "logging.progress=plain",
    ]


def make_plan(
    recipe_path: Path,
    overrides: list[str],
    *,
    steps: int = DEFAULT_STEPS,
    kernels: str | None = None,
    ablate: bool = False,
    out: Path | None = None,
    nproc_per_node: int | None = None,
    rtol: float | None = None,
) -> ComparePlan:
    """Check every option and every arm's recipe before anything runs."""
    if steps < 1:
        raise CompareError(f"--steps must be at least 1, got {steps}")
    if rtol is not None and not (rtol > 0 and math.isfinite(rtol)):
        raise CompareError(f"--rtol must be a positive number, got {rtol}")
    _check_user_overrides(overrides)
    recipe = load_recipe(recipe_path, overrides)
    nproc = processes_per_arm(nproc_per_node)
    if nproc > 1 and recipe.parallel.strategy == "none":
        raise CompareError(
            f"{nproc} processes per arm need a multi-process strategy: add parallel.strategy=ddp (or fsdp, deepspeed)"
        )
    selected = parse_kernels(kernels, recipe)
    precision = recipe.training.precision
    rule = f"training.precision {precision}: per-step relative loss difference ≤ {RTOL[precision]:g}"
    if rtol is not None:
        rule = f"--rtol: per-step relative loss difference ≤ {rtol:g}"
    out = (out or recipe.run_dir.with_name(recipe.run_dir.name + "-compare")).resolve()
    plan = ComparePlan(
        recipe_path=recipe_path.resolve(),
        overrides=list(overrides),
        recipe=recipe,
        steps=steps,
        kernels=selected,
        ablate=ablate,
        out=out,
        nproc=nproc,
        rtol=rtol if rtol is not None else RTOL[precision],
        rtol_rule=rule,
    )
    arm_kernels = {BASELINE: [], "on": selected}
    if ablate and len(selected) > 1:
        arm_kernels |= {name: [name] for name in selected}
    for name, arm_selection in arm_kernels.items():
        directory = out / name
        arm_overrides = arm_recipe_overrides(overrides, arm_selection, steps, directory)
        try:
            load_recipe(recipe_path, arm_overrides)
        except RecipeError as e:
            e.problems = [
                f"arm {name!r} (kernels: {', '.join(arm_selection) or 'none'}): {p}" for p in e.problems
            ]
            raise
        if directory.exists() and not (directory / ARM_SPEC).exists():
            raise CompareError(
                f"{directory} exists and was not written by ligertune compare; choose another --out"
            )
        plan.arms.append(ArmSpec(name, arm_selection, arm_overrides, directory))
    return plan


# --------------------------------------------------------------------------------------------
# One arm, inside its own process (python -m ligertune.compare <arm dir>/arm.json)
# --------------------------------------------------------------------------------------------


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


def _start_record(run_dir: Path) -> dict[str, Any]:
    """The ``start`` record `train` wrote to metrics.jsonl (main rank only): device, world
    size and FLOPs per token."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    starts = [
        r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines()) if r.get("event") == "start"
    ]
    return starts[-1] if starts else {}


def _peak_host_rss_gib() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak * 1024 / 2**30  # bytes on macOS, KiB on Linux


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _measure(recipe: Recipe | None, log: _StepLog, run_dir: Path) -> dict[str, Any]:
    """Speed and memory of an arm from its step records (`ligertune.metrics` definitions)."""
    import torch

    from ligertune.environment import kernel_mode
    from ligertune.metrics import Throughput, peak_bf16_flops, peak_memory_gib

    start = _start_record(run_dir)
    device = torch.device(start.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    world = int(start.get("world_size") or os.environ.get("WORLD_SIZE", "1"))
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


def _inject(arm_name: str) -> None:
    """Test-only: see the module docstring."""
    module = os.environ.get(INJECT_ENV)
    if module:
        importlib.import_module(module).inject(arm_name)


def run_arm(spec_path: Path) -> int:
    """Train one arm and write ``result-rank<r>.json`` next to its spec. Exit status 0 when the
    arm ran every step; 1 otherwise, so that torchrun stops the other ranks of a failed arm."""
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    rank = int(os.environ.get("RANK", "0"))
    _inject(spec["name"])

    import torch

    from ligertune.train import train

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
    except torch.OutOfMemoryError as e:
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
    _write_json(run_dir / f"result-rank{rank}.json", record)
    print(f"arm {spec['name']} rank {rank}: {status}" + (f": {error}" if error else ""), flush=True)
    return 0 if status in ("ok", "nonfinite") else 1


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# The parent: launch each arm, merge its rank files
# --------------------------------------------------------------------------------------------


def arm_command(spec_path: Path, nproc: int) -> list[str]:
    """The command that runs one arm: a plain process, or torchrun with `nproc` processes."""
    if nproc == 1:
        return [sys.executable, "-m", "ligertune.compare", str(spec_path)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "ligertune.compare", str(spec_path),
    ]  # fmt: skip


def arm_environment() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
    _write_json(spec_path, arm.as_json(plan.recipe_path, plan.steps))
    log_path = arm.directory / ARM_LOG
    timed_out = False
    with log_path.open("w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(
            arm_command(spec_path, plan.nproc),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=arm_environment() | (env or {}),
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


# --------------------------------------------------------------------------------------------
# Comparing arms
# --------------------------------------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _status_phrase(arm: dict[str, Any], steps: int) -> str:
    if arm["status"] == "oom":
        return f"{arm['name']} ran out of memory at step {arm['steps_completed'] + 1}"
    if arm["status"] == "error" or arm["steps_completed"] < steps:
        return f"{arm['name']} stopped after {arm['steps_completed']} of {steps} steps ({arm['status']})"
    return ""


def loss_verdict(base: dict[str, Any], arm: dict[str, Any], steps: int, rtol: float) -> dict[str, Any]:
    """Compare the per-step losses of `arm` with those of `base` (see the module docstring)."""
    n = min(len(base["losses"]), len(arm["losses"]))
    max_abs = max_rel = None
    worst_step = diverged = None
    for k in range(n):
        b, a = base["losses"][k], arm["losses"][k]
        if b is None and a is None:
            continue  # both non-finite: the arms agree
        if b is None or a is None:
            diverged = diverged or (k + 1, b, a, math.inf)
            continue
        abs_diff = abs(a - b)
        rel = abs_diff / abs(b) if b else (0.0 if a == b else math.inf)
        max_abs = abs_diff if max_abs is None else max(max_abs, abs_diff)
        if max_rel is None or rel > max_rel:
            max_rel, worst_step = rel, k + 1
        if rel > rtol and diverged is None:
            diverged = (k + 1, b, a, rel)

    def show(value: float | None) -> str:
        return f"{value:.6g}" if value is not None else "non-finite"

    verdict: dict[str, Any] = {
        "status": "",
        "parity": False,
        "step": None,
        "baseline_loss": None,
        "arm_loss": None,
    }
    if diverged is not None:
        step, b, a, rel = diverged
        verdict |= {"status": "diverged", "step": step, "baseline_loss": b, "arm_loss": a}
        how = f"relative difference {rel:.2e} > {rtol:g}" if math.isfinite(rel) else "one loss is non-finite"
        verdict["message"] = (
            f"diverged at step {step}: {base['name']} {show(b)}, {arm['name']} {show(a)} ({how})"
        )
    elif n == steps and all(x["status"] in ("ok", "nonfinite") for x in (base, arm)):
        verdict |= {"status": "parity", "parity": True}
        worst = f"; largest {max_rel:.2e} at step {worst_step}" if max_rel is not None else ""
        verdict["message"] = f"parity: every one of the {n} steps within relative {rtol:g}{worst}"
    else:
        verdict["status"] = "incomplete"
        reasons = "; ".join(p for p in (_status_phrase(base, steps), _status_phrase(arm, steps)) if p)
        agree = f"the {n} steps both ran agree within {rtol:g}" if n else "no step ran in both arms"
        verdict["message"] = f"no verdict: {reasons}; {agree}"
    return {
        "steps_compared": n,
        "max_abs_loss_diff": max_abs,
        "max_rel_loss_diff": max_rel,
        "max_rel_loss_diff_step": worst_step,
        "verdict": verdict,
    }


def _fits_phrase(arm: dict[str, Any]) -> str:
    peak = arm["peak_mem_allocated_gib"]
    return f" ({peak:.2f} GiB peak allocated)" if peak is not None else ""


def compare_arms(base: dict[str, Any], arm: dict[str, Any], steps: int, rtol: float) -> dict[str, Any]:
    """Speed, memory and loss agreement of `arm` against `base`, with a one-line summary."""
    losses = loss_verdict(base, arm, steps, rtol)
    result = {
        "arm": arm["name"],
        "baseline": base["name"],
        "speedup": _ratio(arm["tokens_per_s"], base["tokens_per_s"]),
        "memory_ratio_allocated": _ratio(arm["peak_mem_allocated_gib"], base["peak_mem_allocated_gib"]),
        "memory_ratio_reserved": _ratio(arm["peak_mem_reserved_gib"], base["peak_mem_reserved_gib"]),
        **losses,
    }
    if base["status"] == "oom" and arm["status"] in ("ok", "nonfinite"):
        reached = _fits_phrase(base).replace("peak allocated", "allocated when it failed")
        summary = f"{base['name']} runs out of memory{reached}; {arm['name']} fits{_fits_phrase(arm)}"
    else:
        parts = [f"{arm['name']} vs {base['name']}:"]
        if result["speedup"] is not None:
            parts.append(f"{result['speedup']:.2f}× tokens/s,")
        if result["memory_ratio_allocated"] is not None:
            parts.append(f"{result['memory_ratio_allocated']:.2f}× peak memory,")
        parts.append(losses["verdict"]["message"])
        summary = " ".join(parts)
    result["summary"] = summary
    return result


def build_report(
    plan: ComparePlan, arms: list[dict[str, Any]], notes: list[str] | None = None
) -> dict[str, Any]:
    """The whole comparison as one JSON-ready mapping (schema `SCHEMA`); `notes` are added to
    the report's own."""
    base = arms[0]
    comparisons = [compare_arms(base, arm, plan.steps, plan.rtol) for arm in arms[1:]]
    reporting = next((a for a in arms if a["device"] is not None), base)
    device = reporting["device"]
    notes = list(notes or [])
    if device == "cpu":
        notes.append(
            f"CPU run (kernels: {reporting['kernel_mode']}): speed numbers only check the path and say nothing "
            "about GPU performance; memory is host RSS"
        )
    warmup = plan.recipe.logging.throughput_warmup_steps
    if plan.steps <= warmup:
        notes.append(
            f"--steps {plan.steps} leaves no step after logging.throughput_warmup_steps ({warmup}): no speed numbers"
        )
    return {
        "schema": SCHEMA,
        "recipe": str(plan.recipe_path),
        "overrides": plan.overrides,
        "steps": plan.steps,
        "world_size": plan.nproc,
        "precision": plan.recipe.training.precision,
        "kernels": plan.kernels,
        "ablate": plan.ablate,
        "device": device,
        "device_name": reporting["device_name"],
        "kernel_mode": reporting["kernel_mode"],
        "speed_meaningful": device == "cuda",
        "tolerance": {"rtol": plan.rtol, "rule": plan.rtol_rule},
        "arms": arms,
        "comparisons": comparisons,
        "verdict": next(c for c in comparisons if c["arm"] == "on")["verdict"],
        "notes": notes,
        "out_dir": str(plan.out),
    }


def exit_status(report: dict[str, Any]) -> int:
    """0 when nothing is wrong; 1 when the kernels changed the training (a divergence) or an
    arm failed for a reason other than memory (an OOM is a finding, not a failure)."""
    diverged = any(c["verdict"]["status"] == "diverged" for c in report["comparisons"])
    failed = any(a["status"] == "error" for a in report["arms"])
    return 1 if diverged or failed else 0


def run_compare(plan: ComparePlan, console) -> dict[str, Any]:
    """Run every arm of the plan in turn, then write compare.json/.md/.png and print the table."""
    from ligertune import report as render

    plan.out.mkdir(parents=True, exist_ok=True)
    launcher = f"torchrun × {plan.nproc}" if plan.nproc > 1 else "one process"
    arms, unused, notes = [], set(), []
    for arm in plan.arms:
        if unused.intersection(arm.kernels):  # an ablation arm that would equal `off`
            notes.append(
                f"arm {arm.name} not run: the 'on' arm patched no module with it (this model has none)"
            )
            console.print(notes[-1], markup=False, highlight=False)
            continue
        console.print(
            f"arm {arm.name} (kernels: {', '.join(arm.kernels) or 'none'}): {plan.steps} steps, {launcher}; "
            f"log: {arm.directory / ARM_LOG}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        result = run_arm_process(arm, plan)
        line = f"  {result['status']}" + (f": {result['error']}" if result["error"] else "")
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        arms.append(result)
        if arm.name == "on" and plan.ablate:
            # The on arm's patch report says which selected kernels found nothing to patch.
            patched = _start_record(arm.directory).get("kernels_patched")
            unused = {k for k in arm.kernels if k not in patched} if patched is not None else set()
    report = build_report(plan, arms, notes)
    report["files"] = {
        "json": str(plan.out / "compare.json"),
        **render.write_outputs(report, plan.out, console),
    }
    _write_json(plan.out / "compare.json", report)
    render.print_report(report, console)
    return report


def compare_command(recipe: Path, overrides: list[str], console, **options) -> int:
    """`ligertune compare`: plan, run, report; returns the exit status (see `exit_status`).

    Started by torchrun with G processes, only rank 0 runs the comparison (its arms get G
    processes each); the other ranks return at once."""
    if launched_world()[0] != 0:
        return 0
    plan = make_plan(recipe, overrides, **options)
    return exit_status(run_compare(plan, console))


if __name__ == "__main__":
    sys.exit(run_arm(Path(sys.argv[1])))
