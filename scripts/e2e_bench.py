"""End-to-end training throughput and memory: HF eager vs ligertune kernels vs Liger-patched HF.

Every provider trains the same recipe with the same loop (`ligertune.training.train`), seed,
weights, data and number of steps. Each provider (`ligertune.tools.providers`) is an arm of
`ligertune.tools.compare`, run by its arm runner: a process of its own (so its peak memory is its own), or ``--nproc-per-node G``
processes under torchrun with the peak taken over the ranks.

* ``eager``: the Hugging Face model as built, every kernel off;
* ``ligertune``: our kernels (the recipe's ``kernels: all`` selection);
* ``liger``: every kernel of ours off, then Liger-Kernel's own instance patch
  (``liger_kernel.transformers._apply_liger_kernel_to_instance``) on the built model through the
  ``plugins: [liger]`` extension point, before the parallel wrapper: the peer as a user of our
  loop would apply it. Liger also patches some functions process-wide, which is harmless in a
  process of its own.

Tokens/s (all input tokens, padding included), MFU and step time are medians/rates over the
steps after ``--warmup`` (`ligertune.tools.compare`'s definitions); memory is the CUDA caching
allocator's peak allocated and reserved over the run.

``--seq-lens`` sweeps ``data.max_seq_len``: the same providers at each length, shortest first;
a provider that fails (out of memory, error, timeout) is not tried at longer lengths. The
report gives, per provider, the longest length that ran, and ``e2e.png`` plots throughput and
peak memory against the length. A packed row shorter than the length is padded to it, so each
row holds exactly ``max_seq_len`` tokens of work. At lengths longer than the bundled sample
(37k tokens) use ``--random-rows N``: N rows of random token ids as long as the longest length
(the recipe's ``max_seq_len`` without ``--seq-lens``), written to ``<out>/random-tokens.jsonl``
and trained unpacked (every position a label), so that each row is one causal sequence and attention needs no packed-sample mask. For preference
objectives (``objective.name=dpo`` among the overrides), ``--random-pairs N`` writes N preference
rows of random words (``<out>/random-pairs.jsonl``): a prompt of length/8 words and two
different responses of `length` words each, so that truncation (`ligertune.data.preference`)
fills both sequences of every pair to exactly ``max_seq_len`` tokens. For vision-language
recipes, ``--image-rows N`` writes N chat rows of ``--images-per-row`` bundled images each
(``<out>/image-rows.jsonl``); the recipe's image pixel bounds set their size in tokens.

Outputs in ``--out``: ``e2e.json`` (every arm's result), ``e2e.md`` (the tables, printed last),
``e2e.png`` with ``--seq-lens``, and one directory per arm with its log and metrics.

    python scripts/e2e_bench.py recipes/llama3.2-1b-alpaca-bench.yaml --steps 15 --warmup 5 --out runs/e2e
    python scripts/e2e_bench.py recipes/llama3-8b-alpaca-bench.yaml --nproc-per-node 4 --out runs/e2e-8b
    python scripts/e2e_bench.py recipes/llama3.2-1b-alpaca-bench.yaml training.micro_batch_size=1 \\
        --seq-lens 8192,16384,32768,65536 --steps 4 --warmup 2 --out runs/e2e-seq
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from ligertune.tools.providers import DEFAULT_PROVIDERS, PROVIDERS


def run_provider(provider: str, name: str, args, overrides: list[str], timeout: float) -> dict:
    """One arm: `provider` on the recipe with `overrides`, in `args.out / name`, stopped after
    `timeout` seconds."""
    from ligertune.tools.compare.plan import ArmSpec, arm_recipe_overrides, make_plan
    from ligertune.tools.compare.runner import run_arm_process

    kernels = list(PROVIDERS[provider].kernels)
    with_provider = [*overrides, *PROVIDERS[provider].extra_overrides(args.recipe_attention)]
    directory = (args.out / name).resolve()
    spec = ArmSpec(
        name, kernels, arm_recipe_overrides(with_provider, kernels, args.steps, directory), directory
    )
    plan = make_plan(
        Path(args.recipe), overrides, steps=args.steps, out=args.out, nproc_per_node=args.nproc_per_node
    )
    result = run_arm_process(spec, plan, timeout=timeout)
    return {"provider": provider, **result}


def random_token_data(path: Path, rows: int, length: int) -> list[str]:
    """Write `rows` rows of `length` random token ids below 2048 (the bundled tokenizer's
    vocabulary, so any recipe's tokenizer accepts them); the overrides that train on them."""
    import numpy as np

    ids = np.random.default_rng(0).integers(0, 2048, size=(rows, length))
    path.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in ids))
    return ["data.format=pretokenized", f"data.path={json.dumps(str(path.resolve()))}", "data.packing=false"]


def random_pair_data(path: Path, rows: int, length: int) -> list[str]:
    """Write `rows` preference rows (prompt, chosen, rejected) of random lowercase words, each
    response at least `length` tokens long (a word is at least one token, its leading space
    included), the prompt length/8 words; the overrides that train on them."""
    import numpy as np

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def words(n: int) -> str:
        sizes = rng.integers(2, 8, size=n)
        return " ".join("".join(rng.choice(letters, size=k)) for k in sizes)

    lines = [
        json.dumps({"prompt": words(max(length // 8, 1)), "chosen": " " + words(length),
                    "rejected": " " + words(length)}) + "\n"
        for _ in range(rows)
    ]  # fmt: skip
    path.write_text("".join(lines))
    return ["data.format=preference", f"data.path={json.dumps(str(path.resolve()))}", "data.packing=false"]


def image_chat_data(path: Path, rows: int, images_per_row: int) -> list[str]:
    """Write `rows` chat rows of `images_per_row` bundled images each (cycled, by absolute path),
    a question and a one-line answer; the overrides that train on them. Their size in tokens
    comes from the recipe's ``data.image_min_pixels``/``image_max_pixels``."""
    from ligertune.paths import ASSETS_DIR

    images = sorted((ASSETS_DIR / "vl_images").glob("*.png"))
    lines = []
    for row in range(rows):
        parts = [{"type": "image", "path": str(images[(row * images_per_row + i) % len(images)])}
                 for i in range(images_per_row)]  # fmt: skip
        question = {"type": "text", "text": "Describe each picture in order."}
        messages = [{"role": "user", "content": [*parts, question]},
                    {"role": "assistant", "content": "Shapes of several colours, one per picture."}]  # fmt: skip
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))
    return ["data.format=chat", f"data.path={json.dumps(str(path.resolve()))}", "data.packing=false"]


def synthetic_data(args, directory: Path, length: int) -> list[str]:
    """Write the data of ``--random-rows``, ``--random-pairs`` and ``--image-rows`` into
    `directory` (rows of `length` tokens); the overrides that train on it."""
    overrides = []
    if args.random_rows:
        overrides += random_token_data(directory / "random-tokens.jsonl", args.random_rows, length)
    if args.random_pairs:
        overrides += random_pair_data(directory / "random-pairs.jsonl", args.random_pairs, length)
    if args.image_rows:
        overrides += image_chat_data(directory / "image-rows.jsonl", args.image_rows, args.images_per_row)
    return overrides


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else format(value, spec) + suffix


def table(results: list[dict]) -> list[str]:
    """One Markdown table of `results` (arms of one sequence length), ratios against eager and Liger."""
    by = {r["provider"]: r for r in results if r["status"] == "ok"}

    def ratio(r, other, key):
        base = by.get(other)
        return r[key] / base[key] if base and r[key] and base[key] else None

    def drift(r):
        """The largest per-step relative loss difference from eager's (the parity check)."""
        base = by.get("eager")
        if not base or not r["losses"] or len(base["losses"]) != len(r["losses"]):
            return None
        return max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"], strict=True))

    lines = [
        "| provider | status | tok/s | tok/s/GPU | MFU | step s | peak alloc GiB | peak reserved GiB "
        "| × eager tok/s | × Liger tok/s | × Liger memory | final loss | max Δloss vs eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        status = "OOM" if r["status"] == "oom" else r["status"]
        loss = r["losses"][-1] if r["losses"] else None
        lines.append(
            f"| {r['provider']} | {status} | {_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['tokens_per_s_per_gpu'], ',.0f')} "
            f"| {_fmt(r['mfu'] and 100 * r['mfu'], '.1f', '%')} | {_fmt(r['step_time_median_s'], '.3f')} "
            f"| {_fmt(r['peak_mem_allocated_gib'], '.1f')} | {_fmt(r['peak_mem_reserved_gib'], '.1f')} "
            f"| {_fmt(ratio(r, 'eager', 'tokens_per_s'), '.2f')} | {_fmt(ratio(r, 'liger', 'tokens_per_s'), '.2f')} "
            f"| {_fmt(ratio(r, 'liger', 'peak_mem_allocated_gib'), '.2f')} | {_fmt(loss, '.4f')} "
            f"| {_fmt(drift(r), '.2%')} |"
        )
    for r in results:
        if r["status"] != "ok" and r.get("error"):
            lines.append(f"\n{r['provider']}: {' '.join(str(r['error']).split())[:400]}")
    return lines


def markdown(report: dict) -> str:
    lines = [f"command: `{report['command']}`", ""]
    results = report["results"]
    lengths = sorted({r["seq_len"] for r in results if r.get("seq_len")})
    if not lengths:
        return "\n".join(lines + table(results)) + "\n"
    for length in lengths:
        lines += [
            f"### max_seq_len {length}",
            "",
            *table([r for r in results if r.get("seq_len") == length]),
            "",
        ]
    lines += [
        "### Longest sequence that ran",
        "",
        "| provider | longest max_seq_len | first failure |",
        "|---|---|---|",
    ]
    for provider, longest in report["longest"].items():
        failure = longest["first_failure"]
        failed = f"{failure['seq_len']} ({failure['status']})" if failure else "none up to the longest tried"
        lines.append(f"| {provider} | {_fmt(longest['seq_len'], 'd')} | {failed} |")
    return "\n".join(lines) + "\n"


def longest_per_provider(results: list[dict], providers: list[str]) -> dict:
    out = {}
    for provider in providers:
        runs = sorted((r for r in results if r["provider"] == provider), key=lambda r: r["seq_len"])
        ok = [r["seq_len"] for r in runs if r["status"] == "ok"]
        failed = next((r for r in runs if r["status"] not in ("ok", "skipped")), None)
        out[provider] = {
            "seq_len": max(ok) if ok else None,
            "first_failure": {"seq_len": failed["seq_len"], "status": failed["status"]} if failed else None,
        }
    return out


def plot(report: dict, path: Path) -> None:
    """Throughput and peak memory against max_seq_len, one line per provider; an × marks the
    length at which a provider ran out of memory (at the peak it had reached)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for provider in report["providers"]:
        runs = sorted((r for r in report["results"] if r["provider"] == provider), key=lambda r: r["seq_len"])
        ok = [r for r in runs if r["status"] == "ok"]
        (line,) = speed.plot(
            [r["seq_len"] for r in ok], [r["tokens_per_s_per_gpu"] for r in ok], "o-", label=provider
        )
        memory.plot(
            [r["seq_len"] for r in ok],
            [r["peak_mem_allocated_gib"] for r in ok],
            "o-",
            color=line.get_color(),
            label=provider,
        )
        for r in runs:
            if r["status"] == "oom" and r["peak_mem_allocated_gib"] is not None:
                memory.plot(
                    r["seq_len"],
                    r["peak_mem_allocated_gib"],
                    "x",
                    color=line.get_color(),
                    markersize=10,
                    mew=2,
                )
    for axis, label in ((speed, "tokens/s per GPU"), (memory, "peak memory allocated (GiB)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("max_seq_len (tokens per row)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    memory.set_title("× = out of memory (peak reached)", fontsize=9)
    fig.suptitle(report["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value (every provider)")
    parser.add_argument(
        "--providers", default=",".join(DEFAULT_PROVIDERS), help=f"comma list of: {', '.join(PROVIDERS)}"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the rates")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="GPUs per arm (torchrun)")
    parser.add_argument("--seq-lens", help="comma list of data.max_seq_len values to sweep")
    parser.add_argument("--out", type=Path, default=Path("runs/e2e"))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per arm")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: arms not started by then are skipped, none runs past it",
    )
    parser.add_argument("--title", default=None, help="plot title")
    parser.add_argument("--random-rows", type=int, default=None, help="train on N rows of random token ids")
    parser.add_argument(
        "--random-pairs",
        type=int,
        default=None,
        help="preference objectives: train on N pairs of random words",
    )
    parser.add_argument(
        "--image-rows", type=int, default=None, help="vision-language: train on N chat rows of bundled images"
    )
    parser.add_argument("--images-per-row", type=int, default=4, help="with --image-rows")
    args = parser.parse_intermixed_args(argv)

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"unknown providers {unknown}; choose from {', '.join(PROVIDERS)}")
    if any(o.startswith(("kernels", "data.max_seq_len" if args.seq_lens else "\0")) for o in args.overrides):
        parser.error(
            "the providers set kernels (and --seq-lens sets data.max_seq_len); leave them out of the overrides"
        )
    try:
        lengths = sorted(int(x) for x in args.seq_lens.split(",")) if args.seq_lens else [None]
    except ValueError:
        parser.error(f"--seq-lens takes a comma list of token counts, got {args.seq_lens!r}")
    from ligertune.config import RecipeError, load_recipe
    from ligertune.tools.compare import CompareError, make_plan

    try:  # every option checked before anything is written or run
        with tempfile.TemporaryDirectory() as scratch:
            # The synthetic data's overrides, pointing at a few short rows (data.path must exist).
            checked = [*args.overrides, *synthetic_data(args, Path(scratch), 8)]
            recipe = load_recipe(args.recipe, checked)
            make_plan(
                Path(args.recipe), checked, steps=args.steps, out=args.out, nproc_per_node=args.nproc_per_node
            )
    except (CompareError, RecipeError) as e:
        parser.error(str(e))
    args.recipe_attention = recipe.model.attn_implementation
    args.out.mkdir(parents=True, exist_ok=True)
    base = [*args.overrides, f"logging.throughput_warmup_steps={args.warmup}"]
    base += synthetic_data(args, args.out, lengths[-1] or recipe.data.max_seq_len)

    started = time.monotonic()
    results, failed = [], set()
    for length in lengths:
        for provider in providers:
            name = provider if length is None else f"{provider}-{length}"
            overrides = base if length is None else [*base, f"data.max_seq_len={length}"]
            left = math.inf if args.time_budget is None else args.time_budget - (time.monotonic() - started)
            over_budget = left <= 0
            if provider in failed or over_budget:
                why = "a shorter length failed" if provider in failed else "time budget"
                print(f"[{name}] not run: {why}", flush=True)
                if over_budget:
                    results.append({"provider": provider, "seq_len": length, "status": "skipped", "error": why,
                                    "losses": [], "tokens_per_s": None, "tokens_per_s_per_gpu": None, "mfu": None,
                                    "step_time_median_s": None, "peak_mem_allocated_gib": None,
                                    "peak_mem_reserved_gib": None})  # fmt: skip
                continue
            print(f"[{name}] {args.steps} steps ...", flush=True)
            result = run_provider(provider, name, args, overrides, timeout=min(args.timeout, left))
            result["seq_len"] = length
            if result["status"] != "ok":
                failed.add(provider)
            print(f"[{name}] {result['status']}: {_fmt(result['tokens_per_s'], ',.0f')} tok/s, "
                  f"peak {_fmt(result['peak_mem_allocated_gib'], '.1f')} GiB"
                  + (f"; {' '.join(str(result['error']).split())[:300]}" if result["error"] else ""), flush=True)  # fmt: skip
            results.append(result)

    command = "python scripts/e2e_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command, "providers": providers, "results": results,
              "title": args.title or f"{Path(args.recipe).name} {' '.join(args.overrides)}".strip()}  # fmt: skip
    if args.seq_lens:
        report["longest"] = longest_per_provider(results, providers)
        plot(report, args.out / "e2e.png")
    (args.out / "e2e.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "e2e.md").write_text(text)
    print(text)
    # Running out of memory at some length is what a sweep looks for; any other failure is not.
    expected = ("ok", "oom", "skipped") if args.seq_lens else ("ok",)
    return 0 if all(r["status"] in expected for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
