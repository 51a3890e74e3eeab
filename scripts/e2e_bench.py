"""End-to-end training throughput and memory: HF eager vs ligertune kernels vs Liger-patched HF.

Every provider trains the same recipe with the same loop (`ligertune.train.train`), the same
seed, weights and data, for the same number of steps, each in a process of its own so that its
peak memory is its own:

* ``eager``: the Hugging Face model as built, ``kernels=none``;
* ``ligertune``: our kernels patched in (``kernels=all`` unless the overrides say otherwise);
* ``liger``: ``kernels=none``, then Liger-Kernel's own instance patch
  (``liger_kernel.transformers._apply_liger_kernel_to_instance``) on the built model — the peer
  as a user of our loop would apply it. Liger patches some functions process-wide; its process
  is its own.

Tokens/s, MFU and step time are medians over the steps after ``--warmup`` (the recipe's
``logging.throughput_warmup_steps`` is set to match); memory is the CUDA caching allocator's
peak allocated and reserved over the run. Results go to ``--out`` as ``e2e.json`` and
``e2e.md``; the Markdown table is printed last.

    python scripts/e2e_bench.py recipes/llama3.2-1b-alpaca-bench.yaml --steps 20 --out runs/e2e
    python scripts/e2e_bench.py recipes/llama3.2-1b-alpaca-bench.yaml data.max_seq_len=4096 --providers ligertune,liger
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROVIDERS = ("eager", "ligertune", "liger")


def _arm_overrides(provider: str, steps: int, warmup: int, out: Path, user: list[str]) -> list[str]:
    kernels = ["kernels=all"] if provider == "ligertune" else ["kernels=none"]
    # User overrides come after kernels=all so `kernels.rope=false` can still switch one off,
    # but never re-enable our kernels in the eager/liger arms.
    user = [o for o in user if provider == "ligertune" or not o.startswith("kernels")]
    return (
        kernels
        + user
        + [
            f"output_dir={out / provider}",
            f"training.max_steps={steps}",
            f"logging.throughput_warmup_steps={warmup}",
            "logging.log_every=1",
            "logging.progress=plain",
            "training.eval_every=null",
            "checkpoint.every_steps=null",
            "checkpoint.save_final=false",
            "checkpoint.export_hf=false",
            "checkpoint.resume=none",
        ]
    )


def run_arm(provider: str, recipe_path: str, overrides: list[str], warmup: int, result_path: Path) -> None:
    """Inside the arm's process: train and write the arm's result JSON."""
    import torch

    import ligertune.train as train_module
    from ligertune.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    steps: list[dict] = []
    result: dict = {"provider": provider, "status": "ok", "error": None}
    started = time.perf_counter()
    try:
        if provider == "liger":
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            build = train_module.build_model

            def build_with_liger(recipe, device):
                model = build(recipe, device)
                _apply_liger_kernel_to_instance(model=model)
                return model

            train_module.build_model = build_with_liger
        train_module.train(recipe, on_step_end=lambda record: steps.append(vars(record).copy()) and None)
    except torch.OutOfMemoryError as e:
        result.update(status="oom", error=str(e).splitlines()[0])
    except Exception as e:  # an arm's failure is a result, not a crash of the whole benchmark
        result.update(status="error", error=f"{type(e).__name__}: {e}")
    result["wall_s"] = time.perf_counter() - started
    records = (
        [
            json.loads(line)
            for line in (recipe.run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        if (recipe.run_dir / "metrics.jsonl").exists()
        else []
    )
    timed = [r for r in records if r.get("event") == "train" and r["step"] > warmup]

    def median(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    result.update(
        steps=len(steps),
        losses=[s["loss"] for s in steps],
        tokens_per_s=median("tokens_per_s"),
        tokens_per_s_per_gpu=median("tokens_per_s_per_gpu"),
        mfu=median("mfu"),
        step_s=statistics.median([s["seconds"] for s in steps[warmup:]]) if len(steps) > warmup else None,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else None,
    )
    result_path.write_text(json.dumps(result, indent=1))


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(results: list[dict], command: str) -> str:
    base = next((r for r in results if r["provider"] == "eager" and r["tokens_per_s"]), None)
    liger = next((r for r in results if r["provider"] == "liger" and r["tokens_per_s"]), None)
    lines = [
        f"command: `{command}`",
        "",
        "| provider | status | tok/s | tok/s/GPU | MFU | step s | peak alloc GiB | peak reserved GiB | × eager tok/s | × liger tok/s | × liger memory | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        speed = r["tokens_per_s"]
        lines.append(
            f"| {r['provider']} | {r['status']} | {_fmt(speed, ',.0f')} | {_fmt(r['tokens_per_s_per_gpu'], ',.0f')} | "
            f"{_fmt(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | {_fmt(r['step_s'], '.3f')} | "
            f"{_fmt(r['peak_allocated_gib'], '.1f')} | {_fmt(r['peak_reserved_gib'], '.1f')} | "
            f"{_fmt(speed / base['tokens_per_s'] if speed and base else None, '.2f')} | "
            f"{_fmt(speed / liger['tokens_per_s'] if speed and liger else None, '.2f')} | "
            f"{_fmt(r['peak_allocated_gib'] / liger['peak_allocated_gib'] if liger and r['peak_allocated_gib'] and liger['peak_allocated_gib'] else None, '.2f')} | "
            f"{_fmt(r['losses'][-1] if r['losses'] else None, '.4f')} |"
        )
        if r["error"]:
            error = " ".join(r["error"].split())[-300:].replace("|", "/")
            lines.append(f"|   ↳ {r['provider']}: {error} |||||||||||")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--out", type=Path, default=Path("runs/e2e"))
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per arm")
    args = parser.parse_args(argv)

    if args.arm:
        run_arm(args.arm, args.recipe, args.overrides, args.warmup, args.out / args.arm / "result.json")
        return 0

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"unknown providers {unknown}; choose from {', '.join(PROVIDERS)}")
    results = []
    for provider in providers:
        arm_dir = args.out / provider
        arm_dir.mkdir(parents=True, exist_ok=True)
        overrides = _arm_overrides(provider, args.steps, args.warmup, args.out, args.overrides)
        command = [sys.executable, __file__, args.recipe, *overrides, "--arm", provider,
                   "--out", str(args.out), "--warmup", str(args.warmup)]  # fmt: skip
        print(f"[{provider}] running {args.steps} steps ...", flush=True)
        with open(arm_dir / "arm.log", "w") as log:
            try:
                code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                      env=os.environ.copy()).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                code = "timeout"
        result_path = arm_dir / "result.json"
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            tail = (arm_dir / "arm.log").read_text()[-600:]
            result = {"provider": provider, "status": "error", "error": f"arm exited {code}: {tail}",
                      "tokens_per_s": None, "tokens_per_s_per_gpu": None, "mfu": None, "step_s": None,
                      "peak_allocated_gib": None, "peak_reserved_gib": None, "losses": []}  # fmt: skip
        print(f"[{provider}] {result['status']}: {_fmt(result['tokens_per_s'], ',.0f')} tok/s, "
              f"peak {_fmt(result['peak_allocated_gib'], '.1f')} GiB", flush=True)  # fmt: skip
        results.append(result)

    command = "python scripts/e2e_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "e2e.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    table = markdown(results, command)
    (args.out / "e2e.md").write_text(table)
    print(table)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
