"""`ligertune bench` outputs: JSON, CSV, Markdown, a rich table and plots, from a `BenchResult`.

Everything here reads a `BenchResult` and nothing else, so a saved ``bench.json`` can be
rendered again (``ligertune bench --from-json``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

from ligertune.tools.bench.results import FILES, BenchError, BenchResult, Row

CSV_FIELDS = [f.name if f.name != "pass_" else "pass" for f in dataclasses.fields(Row)]


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps(result.to_json(), indent=1) + "\n")


def write_csv(result: BenchResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in result.rows:
            writer.writerow(r.to_dict())


def _fmt(value: float | None, spec: str, empty: str = "") -> str:
    return empty if value is None else format(value, spec)


def _cell(r: Row | None) -> str:
    """One provider's result in the compact table: 'ms · MiB', or why there is none."""
    if r is None:
        return ""
    if r.status != "ok":
        return {"unavailable": "n/a", "oom": "OOM"}.get(r.status, r.status)
    mem = f" · {r.peak_extra_mib:.0f}" if r.peak_extra_mib is not None else ""
    flag = " ⚠" if r.note.startswith("MISMATCH") else ""
    return f"{r.ms:.3f}{mem}{flag}"


def markdown_report(result: BenchResult) -> str:
    """A compact report: one line per (kernel, shape, pass), providers side by side."""
    m = result.meta
    env = m.get("environment", {})
    versions = ", ".join(
        f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "liger-kernel") if k in env
    )
    providers = m["providers"]
    lines = [
        "# ligertune bench",
        "",
        f"- command: `{m['command']}`",
        f"- device: {m['device']} ({m['timing']}); {versions}",
        f"- measured in this run: copy {m['copy_gbps']:.3g} GB/s (read + write), "
        f"{m['matmul']} matmul {m['matmul_tflops']:.3g} TFLOP/s",
        f"- dtype {m['dtype']}; warmup {m['warmup_ms']:g} ms, rep {m['rep_ms']:g} ms (≤ 100 repetitions); "
        f"{m['created']}; {m['elapsed_s']} s",
        "",
        "Cells are `ms · peak extra MiB` (⚠: output differs from eager). Definitions:",
        "",
        *(f"- **{k}**: {v}" for k, v in m["definitions"].items()),
        "",
        "| kernel | shape | pass | "
        + " | ".join(providers)
        + " | ours % SOL | ours × eager | ours × liger |",
        "|" + "---|" * (len(providers) + 6),
    ]
    index = {(r.kernel, r.shape, r.pass_, r.provider): r for r in result.rows}
    for kernel, shape, pass_ in dict.fromkeys((r.kernel, r.shape, r.pass_) for r in result.rows):
        cells = [_cell(index.get((kernel, shape, pass_, p))) for p in providers]
        ours = index.get((kernel, shape, pass_, "ligertune"))
        liger = index.get((kernel, shape, pass_, "liger"))
        ok = ours is not None and ours.status == "ok"
        vs_liger = liger.ms / ours.ms if ok and liger is not None and liger.status == "ok" else None
        lines.append(
            f"| {kernel} | {shape} | {pass_} | "
            + " | ".join(cells)
            + f" | {_fmt(ours.pct_sol if ok else None, '.0f')} | {_fmt(ours.speedup_vs_eager if ok else None, '.2f')}"
            + f" | {_fmt(vs_liger, '.2f')} |"
        )
    # One line per distinct problem, with where it happened: a kernel failing on every shape and
    # pass must not push the table out of a log's tail.
    problems: dict[tuple[str, str, str, str], list[str]] = {}
    for r in result.rows:
        if r.status in ("error", "oom") or r.note.startswith("MISMATCH"):
            problems.setdefault((r.kernel, r.provider, r.status, r.note), []).append(f"{r.shape} {r.pass_}")
    if problems:
        lines += ["", "Problems:", ""]
        lines += [
            f"- {k} {p}: {st} {note} ({', '.join(where)})" for (k, p, st, note), where in problems.items()
        ]
    return "\n".join(lines) + "\n"


def rich_table(result: BenchResult):
    from rich.table import Table

    m = result.meta
    title = f"ligertune bench — {m['device']}, {m['dtype']} ({m['timing']})"
    caption = (
        f"copy {m['copy_gbps']:.3g} GB/s, matmul {m['matmul_tflops']:.3g} TFLOP/s (this run). "
        f"peak extra = {m['definitions']['peak_extra_mib']}. % SOL = {m['definitions']['pct_sol']}."
    )
    table = Table(title=title, caption=caption, header_style="bold")
    for name in ("kernel", "shape", "pass", "provider"):
        table.add_column(name, no_wrap=True)
    for name in ("ms", "peak extra MiB", "GB/s", "TFLOP/s", "% SOL", "× eager"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("notes", max_width=60, no_wrap=True, overflow="ellipsis")
    for r in result.rows:
        if r.status == "ok":
            values = [
                _fmt(r.ms, ".3f"),
                _fmt(r.peak_extra_mib, ".1f", "n/a"),
                _fmt(r.gbps, ".0f"),
                _fmt(r.tflops, ".0f"),
                _fmt(r.pct_sol, ".0f"),
                _fmt(r.speedup_vs_eager, ".2f"),
            ]
            note = f"[red]{r.note}[/]" if r.note else ""
        else:
            values = [""] * 6
            note = f"[{'yellow' if r.status in ('unavailable', 'skipped') else 'red'}]{r.status}[/] {r.note}"
        table.add_row(r.kernel, r.shape, r.pass_, r.provider, *values, note)
    return table


def _plot_pass(result: BenchResult) -> str:
    passes = result.meta["passes"]
    return "full" if "full" in passes else passes[0]


def _value_label(value: float) -> str:
    """Three significant digits, thousands written out (0.179, 12.4, 20,032)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _plot_per_kernel(result: BenchResult, path: Path, metric: str, ylabel: str, title: str) -> None:
    """Grouped bars: one panel per kernel, shapes along x, one bar per provider, each labelled
    with its value. A provider without a value there (failed, unavailable, no memory on CPU)
    gets a grey label instead.

    The axis is linear from 0: bar lengths are then proportional to the values, so a 1.75×
    difference looks like 1.75× (a log axis cut at the smallest bar made it look like 10×).
    The value labels keep a bar that is 0, or a sliver next to a tall one, readable."""
    import matplotlib.pyplot as plt

    pass_ = _plot_pass(result)
    providers = result.meta["providers"]
    kernels = list(dict.fromkeys(r.kernel for r in result.rows))
    cols = min(3, len(kernels))
    nrows = math.ceil(len(kernels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.9 * nrows), squeeze=False)
    width = 0.8 / len(providers)
    for ax, kernel in zip(axes.flat, kernels, strict=False):  # spare panels stay blank
        rows = [r for r in result.rows if r.kernel == kernel and r.pass_ == pass_]
        shapes = list(dict.fromkeys(r.shape for r in rows))
        for i, provider in enumerate(providers):
            for j, shape in enumerate(shapes):
                r = next((r for r in rows if r.provider == provider and r.shape == shape), None)
                x = j + (i - (len(providers) - 1) / 2) * width
                value = getattr(r, metric) if r is not None and r.status == "ok" else None
                if value is None:
                    label = "n/a" if r is None or r.status in ("ok", "unavailable") else r.status
                    ax.text(x, 0, label, rotation=90, ha="center", va="bottom", fontsize=7, color="grey")
                else:
                    bar = ax.bar(x, value, width, color=f"C{i}", label=provider if j == 0 else None)[0]
                    ax.annotate(
                        _value_label(value),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 2),
                        textcoords="offset points",
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=6.5,
                    )
        # Long shapes (8192x4096x128256) side by side overlap: slant them.
        slanted = sum(len(s) for s in shapes) > 36
        ax.set_xticks(
            range(len(shapes)),
            shapes,
            fontsize=8,
            rotation=15 if slanted else 0,
            ha="right" if slanted else "center",
        )
        ax.set_title(f"{kernel} ({pass_})", fontsize=10)
        ax.set_ylabel(ylabel)
        # From 0, with room for the rotated value labels above the tallest bar.
        tallest = max((p.get_height() for p in ax.patches), default=0.0)
        ax.set_ylim(0, tallest * 1.22 if tallest > 0 else 1.0)
    for ax in list(axes.flat)[len(kernels) :]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(providers))]
    fig.suptitle(f"{title} — {result.meta['device']}, {result.meta['dtype']}", fontsize=11)
    fig.legend(handles, providers, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=len(providers))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_vocab(result: BenchResult, path: Path) -> None:
    """Peak extra memory against vocabulary size for the two losses: one colour per provider (as in
    the bar plots), one line style per rows (× hidden) when several are present."""
    import matplotlib.pyplot as plt

    pass_ = _plot_pass(result)
    providers = result.meta["providers"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, kernel in zip(axes.flat, ("cross_entropy", "fused_linear_cross_entropy"), strict=True):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in result.rows:
            if r.kernel != kernel or r.pass_ != pass_ or r.status != "ok" or r.peak_extra_mib is None:
                continue
            *others, vocab = (int(p) for p in r.shape.split("x"))
            series.setdefault((r.provider, "x".join(map(str, others))), []).append((vocab, r.peak_extra_mib))
        sizes = sorted({size for _, size in series}, key=lambda t: tuple(map(int, t.split("x"))))
        for (provider, size), points in sorted(series.items(), key=lambda kv: providers.index(kv[0][0])):
            xs, ys = zip(*sorted(points), strict=True)
            style = ("-", "--", ":", "-.")[sizes.index(size) % 4]
            color = f"C{providers.index(provider)}"
            ax.plot(xs, ys, style, color=color, marker="o", label=f"{provider} ({size})")
        if series:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no memory data (measured on CUDA only)", ha="center", transform=ax.transAxes)
        ax.set_xlabel("vocabulary size")
        ax.set_ylabel(f"peak extra MiB ({pass_})")
        dims = "rows x hidden" if kernel == "fused_linear_cross_entropy" else "rows"
        ax.set_title(f"{kernel}: memory vs vocabulary (legend: provider ({dims}))", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: BenchResult, out: Path, warn: Callable[[str], None] = print) -> list[Path]:
    """Write every output file into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, md_path, time_png, mem_png, vocab_png = (out / f for f in FILES)
    write_json(result, json_path)
    write_csv(result, csv_path)
    md_path.write_text(markdown_report(result))
    written = [json_path, csv_path, md_path]
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        warn(
            "no plots: they need matplotlib (pip install 'ligertune[plots]'); JSON, CSV and Markdown are "
            f"written, and `ligertune bench --from-json {json_path}` draws the plots once it is installed"
        )
        return written
    _plot_per_kernel(
        result, time_png, "ms", "median ms", f"time per call, median ms ({result.meta['timing']})"
    )
    _plot_per_kernel(
        result,
        mem_png,
        "peak_extra_mib",
        "peak extra MiB",
        "peak extra memory per call, MiB (allocated beyond the inputs; lower is better)",
    )
    _plot_vocab(result, vocab_png)
    return written + [time_png, mem_png, vocab_png]


def load_json(path: Path) -> BenchResult:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"--from-json {path}: cannot read it ({e})") from None
    return BenchResult.from_json(data)
