"""Where a training step's GPU time goes, per provider: matmuls, attention, fused (Triton)
kernels, PyTorch's own elementwise/reduction kernels, the optimizer, copies, communication.

Method. Each provider trains the recipe in a process of its own (as in ``scripts/e2e_bench.py``:
``eager`` every kernel off, ``ligertune`` ours, ``liger`` Liger's instance patch), or with
``--nproc-per-node G`` in G processes under torchrun (the recipe must then name a multi-process
``parallel.strategy``). Every process runs the same ``torch.profiler`` schedule, advanced once
per optimizer step by `train`'s step hook: ``--wait`` steps unrecorded, one warm-up step, then
``--active`` recorded steps, recording CUDA kernels. Rank 0 alone writes the report: each kernel
falls in the first category whose name fragment it contains (`category`), and the times are
divided by the recorded steps.

- *kernel time* is the sum of the kernels' durations; *GPU busy* is the time during which at
  least one kernel ran (the union of their intervals). They differ when streams overlap, as
  NCCL's communication stream does with compute under FSDP; busy against the median wall-clock
  step gives the time the GPU sat idle (launch overhead, host work, waiting for data).
- *exposed communication* is the time during which NCCL kernels ran and nothing else did: the
  communication that the overlap did not hide, which a multi-GPU step pays in full.

Limits. The categories come from kernel names, not from what the kernels compute: a C++
signature of an unknown family is "other", and a kernel name without a signature is taken to
be Triton (a ``torch.compile`` kernel would be too). CUPTI adds a little host overhead to each
launch, so the wall-clock step under the profiler is slightly longer than without it. The report
is rank 0's view; another rank may wait at different places. On a CPU no CUDA kernel is
recorded, and the report says so: a CPU run only checks that the script runs.

    python scripts/profile_step.py recipes/llama3.2-1b-alpaca-bench.yaml --out runs/profile
    python scripts/profile_step.py recipes/llama3-8b-alpaca-bench.yaml parallel.strategy=fsdp \\
        --nproc-per-node 4 --out runs/prof8b

Writes ``<out>/<provider>.md`` (categories and the top kernels) and prints it; each provider's
training run (metrics, log) goes to ``<out>/<provider>/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ligertune.tools.providers import PROVIDERS

PROVIDER_ORDER = ("ligertune", "liger", "eager")
NCCL = "communication (NCCL)"
TRITON = "fused Triton kernels"
# First match wins; names are CUDA kernel names as the profiler records them. NCCL comes first:
# its kernel names (ncclDevKernel_ReduceScatter_..., ..._AllReduce_...) contain "reduce" and "cat".
CATEGORIES = (
    (NCCL, ("nccl",)),
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("attention (SDPA, flash, flex)", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer (AdamW foreach)", ("multi_tensor", "foreach", "adam")),
    ("copies and fills", ("memcpy", "memset", "copy_kernel", "fill_kernel", "cat", "index")),
    ("PyTorch elementwise / reductions", ("at::native", "elementwise", "reduce", "vectorized", "softmax")),
)
# Recipe keys each provider's run sets itself, and the option that sets them instead.
CONTROLLED = {"kernels": "--providers", "training.max_steps": "--wait/--active", "output_dir": "--out"}


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return label
    # Triton kernels carry their Python function's name; PyTorch's carry C++ signatures.
    return TRITON if "(" not in name and "::" not in name else "other"


@dataclass(frozen=True)
class Kernel:
    """One recorded kernel execution, in the profiler's microseconds."""

    name: str
    start_us: float
    end_us: float


def covered_us(kernels: list[Kernel]) -> float:
    """Length of the union of the kernels' intervals: the time at least one of them ran."""
    total, reach = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.end_us > reach:
            total += k.end_us - max(k.start_us, reach)
            reach = k.end_us
    return total


def report(
    heading: str, run: str, kernels: list[Kernel], step_seconds: list[float], wait: int, active: int
) -> str:
    """The Markdown report of `active` recorded steps; `heading` names the provider (and rank),
    `run` the recipe and overrides."""
    if not kernels:
        return f"## {heading}: no CUDA kernel was recorded (a CPU run profiles nothing here)\n"
    per_kernel: dict[str, float] = defaultdict(float)
    for k in kernels:
        per_kernel[k.name] += (k.end_us - k.start_us) / 1e3 / active
    per_category: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        per_category[category(name)] += ms
    kernel_ms = sum(per_kernel.values())
    busy_ms = covered_us(kernels) / 1e3 / active
    step_ms = 1e3 * sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else float("nan")
    lines = [
        f"## {heading}: {run}".rstrip(),
        "",
        f"median step {step_ms:.1f} ms wall; GPU busy {busy_ms:.1f} ms per step ({100 * busy_ms / step_ms:.0f}% busy), "
        f"kernel time {kernel_ms:.1f} ms; {active} recorded steps after {wait + 1}",
    ]
    if NCCL in per_category:
        compute_ms = covered_us([k for k in kernels if category(k.name) != NCCL]) / 1e3 / active
        lines.append(
            f"communication (NCCL) {per_category[NCCL]:.1f} ms per step, {busy_ms - compute_ms:.1f} ms of it "
            "exposed (no other kernel running)"
        )
    lines += ["", "| category | ms / step | % of kernel time |", "|---|---|---|"]
    for label, ms in sorted(per_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {label} | {ms:.1f} | {100 * ms / kernel_ms:.1f}% |")
    lines += ["", "| top kernels | category | ms / step |", "|---|---|---|"]
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {category(name)} | {ms:.2f} |")
    return "\n".join(lines) + "\n"


def provider_overrides(
    provider: str, recipe_path: str, overrides: list[str], steps: int, out: Path
) -> list[str]:
    """The user's overrides plus what a profiled run sets: the provider's kernels (and attention
    backend, where the recipe leaves it to auto), `steps` steps, its own output directory, and no
    evaluation or checkpoint during the steps."""
    from ligertune.config import load_recipe

    attention = load_recipe(recipe_path, overrides).model.attn_implementation
    return [
        *overrides,
        *PROVIDERS[provider].recipe_overrides(attention),
        f"training.max_steps={steps}",
        f"output_dir={json.dumps(str((out / provider).resolve()))}",  # a JSON string is YAML, whatever the path
        "training.eval_every=null",
        "checkpoint.every_steps=null",
        "checkpoint.save_final=false",
        "checkpoint.export_hf=false",
        "checkpoint.resume=none",
        "logging.progress=plain",
    ]


def profile(
    provider: str, recipe_path: str, overrides: list[str], wait: int, active: int, out: Path
) -> str | None:
    """Inside one of the provider's processes: train under the profiler; rank 0 returns the
    Markdown report, the other ranks None."""
    import torch
    from torch.profiler import ProfilerActivity, schedule

    from ligertune.config import load_recipe
    from ligertune.distributed.env import launched_as
    from ligertune.training import train

    rank, world = launched_as().rank, launched_as().world_size
    recipe = load_recipe(
        recipe_path, provider_overrides(provider, recipe_path, overrides, wait + 1 + active, out)
    )
    seconds: list[float] = []
    with torch.profiler.profile(
        activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU],
        schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
    ) as prof:

        def on_step_end(record) -> None:
            if record.step > wait + 1:
                seconds.append(record.seconds)
            prof.step()  # on every rank after every step: the ranks record the same steps

        train(recipe, on_step_end=on_step_end)

    if rank != 0:
        return None
    kernels = [
        Kernel(e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    heading = provider + (f" (rank 0 of {world})" if world > 1 else "")
    run = f"{Path(recipe_path).name} {' '.join(overrides)}"
    return report(heading, run, kernels, seconds, wait, active)


def provider_command(provider: str, args: argparse.Namespace) -> list[str]:
    """This script in provider mode: one process, or torchrun with --nproc-per-node processes."""
    script = [__file__, args.recipe, *args.overrides, "--provider", provider, "--wait", str(args.wait),
              "--active", str(args.active), "--out", str(args.out)]  # fmt: skip
    if args.nproc_per_node == 1:
        return [sys.executable, *script]
    from ligertune.distributed.launch import LaunchOptions, torchrun

    return torchrun(script, LaunchOptions(nproc_per_node=args.nproc_per_node))


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace, providers: list[str]) -> None:
    """Every option and the recipe, before anything runs (an argparse error, exit status 2)."""
    from ligertune.config import RecipeError, load_recipe
    from ligertune.distributed.env import launched_as

    if not providers:
        parser.error(f"--providers names none; choose from {', '.join(PROVIDER_ORDER)}")
    if unknown := sorted(set(providers) - set(PROVIDERS)):
        parser.error(f"unknown providers {unknown}; choose from {', '.join(PROVIDER_ORDER)}")
    if args.wait < 0 or args.active < 1:
        parser.error(f"--wait must be ≥ 0 and --active ≥ 1, got --wait {args.wait} --active {args.active}")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if launched_as().multi_process:
        parser.error("this script launches torchrun itself: run it as one process with --nproc-per-node G")
    for item in args.overrides:
        key = item.partition("=")[0]
        for controlled, option in CONTROLLED.items():
            if key == controlled or key.startswith(controlled + "."):
                parser.error(f"{item}: the script sets {controlled} for each provider (see {option})")
    try:
        for provider in providers:  # the recipe as each provider's run will load it
            recipe = load_recipe(
                args.recipe, provider_overrides(provider, args.recipe, args.overrides, 1, args.out)
            )
    except RecipeError as e:
        parser.error(str(e))
    if args.nproc_per_node > 1 and recipe.parallel.strategy == "none":
        parser.error(
            f"--nproc-per-node {args.nproc_per_node} needs a multi-process strategy, but the recipe's "
            "parallel.strategy is none: add parallel.strategy=fsdp (or ddp, deepspeed)"
        )
    if "liger" in providers and importlib.util.find_spec("liger_kernel") is None:
        parser.error(
            "the liger provider needs liger-kernel (pip install liger-kernel); or leave it out of --providers"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value (every provider)")
    parser.add_argument("--providers", default=",".join(PROVIDER_ORDER))
    parser.add_argument("--wait", type=int, default=3, help="steps before the profiler's warm-up step")
    parser.add_argument("--active", type=int, default=3, help="recorded steps")
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="processes (GPUs) per provider, torchrun"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/profile"))
    parser.add_argument("--provider", help=argparse.SUPPRESS)  # inside a provider's process
    args = parser.parse_intermixed_args(argv)

    if args.provider:
        text = profile(args.provider, args.recipe, args.overrides, args.wait, args.active, args.out)
        if text is not None:  # rank 0
            (args.out / f"{args.provider}.md").write_text(text)
            print(text, flush=True)
        return 0
    from ligertune.distributed.env import child_environment

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    check_options(parser, args, providers)
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for provider in providers:
        started = time.monotonic()
        # Without the variables of an enclosing launcher, unbuffered output.
        code = subprocess.run(provider_command(provider, args), env=child_environment()).returncode
        print(f"[{provider}] exit {code} in {time.monotonic() - started:.0f} s", flush=True)
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main())
