"""Where a training step's GPU time goes, per provider: matmuls, attention, fused (Triton)
kernels, PyTorch's own elementwise/reduction kernels, the optimizer, copies.

Each provider trains the recipe in a process of its own (as in ``scripts/e2e_bench.py``:
``eager`` every kernel off, ``ligertune`` ours, ``liger`` Liger's instance patch) under
``torch.profiler`` recording CUDA kernels only: ``--wait`` steps unrecorded, one warm-up step,
then ``--active`` recorded steps. Kernel time is summed by category (by kernel name) and
divided by the recorded steps; the report also gives the wall-clock step time, so the gap
between the two is the time the GPU sat idle (launch overhead, host work).

    python scripts/profile_step.py recipes/llama3.2-1b-alpaca-bench.yaml --out runs/profile

Writes ``<out>/<provider>.md`` (categories and the top kernels) and prints it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

PROVIDERS = ("ligertune", "liger", "eager")
# First match wins; names are CUDA kernel names as the profiler records them.
CATEGORIES = (
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("attention (SDPA flash)", ("flash", "fmha", "attention")),
    ("optimizer (AdamW foreach)", ("multi_tensor", "foreach", "adam")),
    ("copies and fills", ("memcpy", "memset", "copy_kernel", "fill_kernel", "cat", "index")),
    ("PyTorch elementwise / reductions", ("at::native", "elementwise", "reduce", "vectorized", "softmax")),
    ("communication (NCCL)", ("nccl",)),
)
TRITON = "fused Triton kernels"


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return label
    # Triton kernels carry their Python function's name; PyTorch's carry C++ signatures.
    return TRITON if "(" not in name and "::" not in name else "other"


def profile(provider: str, recipe_path: str, overrides: list[str], wait: int, active: int, out: Path) -> str:
    """Inside the provider's process: train under the profiler, return the Markdown report."""
    import torch
    from torch.profiler import ProfilerActivity, schedule

    import ligertune.train as train_module
    from ligertune.recipe import load_recipe

    if provider == "liger":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from scripts.e2e_bench import inject

        inject("liger")
    steps = wait + 1 + active
    recipe = load_recipe(
        recipe_path,
        [
            *overrides,
            "kernels=all" if provider == "ligertune" else "kernels=none",
            f"training.max_steps={steps}",
            f"output_dir={out / provider}",
            "training.eval_every=null",
            "checkpoint.every_steps=null",
            "checkpoint.save_final=false",
            "checkpoint.export_hf=false",
            "checkpoint.resume=none",
            "logging.progress=plain",
        ],
    )
    seconds: list[float] = []
    with torch.profiler.profile(
        activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU],
        schedule=schedule(wait=wait, warmup=1, active=active, repeat=1),
    ) as prof:

        def on_step_end(record) -> None:
            if record.step > wait + 1:
                seconds.append(record.seconds)
            prof.step()

        train_module.train(recipe, on_step_end=on_step_end)

    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.time_range.elapsed_us() / 1e3 / active
    per_category: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        per_category[category(name)] += ms
    busy = sum(per_kernel.values())
    if busy == 0:
        return f"## {provider}: no CUDA kernel was recorded (a CPU run profiles nothing here)\n"
    step_ms = 1e3 * sorted(seconds)[len(seconds) // 2] if seconds else float("nan")
    lines = [
        f"## {provider}: {Path(recipe_path).name} {' '.join(overrides)}".rstrip(),
        "",
        f"median step {step_ms:.1f} ms wall; GPU kernels {busy:.1f} ms per step "
        f"({100 * busy / step_ms:.0f}% busy); {active} recorded steps after {wait + 1}",
        "",
        "| category | ms / step | % of kernel time |",
        "|---|---|---|",
    ]
    for label, ms in sorted(per_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {label} | {ms:.1f} | {100 * ms / busy:.1f}% |")
    lines += ["", "| top kernels | category | ms / step |", "|---|---|---|"]
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {category(name)} | {ms:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--wait", type=int, default=3, help="steps before the profiler's warm-up step")
    parser.add_argument("--active", type=int, default=3, help="recorded steps")
    parser.add_argument("--out", type=Path, default=Path("runs/profile"))
    parser.add_argument("--provider", help=argparse.SUPPRESS)  # inside a provider's process
    args = parser.parse_intermixed_args(argv)
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if unknown := sorted(set(providers) - set(PROVIDERS)):
        parser.error(f"unknown providers {unknown}; choose from {', '.join(PROVIDERS)}")
    if args.wait < 0 or args.active < 1:
        parser.error("--wait must be ≥ 0 and --active ≥ 1")
    args.out.mkdir(parents=True, exist_ok=True)

    if args.provider:
        report = profile(args.provider, args.recipe, args.overrides, args.wait, args.active, args.out)
        (args.out / f"{args.provider}.md").write_text(report)
        print(report, flush=True)
        return 0
    status = 0
    for provider in providers:
        started = time.monotonic()
        command = [sys.executable, __file__, args.recipe, *args.overrides, "--provider", provider,
                   "--wait", str(args.wait), "--active", str(args.active), "--out", str(args.out)]  # fmt: skip
        code = subprocess.run(command, env=os.environ.copy()).returncode
        print(f"[{provider}] exit {code} in {time.monotonic() - started:.0f} s", flush=True)
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main())
