"""Rendering a `ligertune compare` report: a rich table, a Markdown file and a PNG plot.

Everything here reads the JSON-ready mapping built by `ligertune.tools.compare.verdict.build_report` and
nothing else, so a saved ``compare.json`` can be rendered again. The terminal table and the
Markdown table come from the same rows (`metric_rows`): one arm per column, one metric per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

Arm = dict[str, Any]
Comparison = dict[str, Any] | None  # None for the baseline arm's own column

PLOT_FLOOR = 1e-12  # a relative loss difference of exactly 0 is drawn here on the log axis


def _value(value: float | None, fmt: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{suffix}"


def _status(arm: Arm) -> str:
    if arm["status"] == "oom":
        return f"OOM at step {arm['steps_completed'] + 1}"
    return arm["status"]


def _vs_baseline(key: str, fmt: str, suffix: str = "") -> Callable[[Arm, Comparison], str]:
    return lambda arm, cmp: "baseline" if cmp is None else _value(cmp[key], fmt, suffix)


def _verdict(arm: Arm, cmp: Comparison) -> str:
    if cmp is None:
        return "baseline"
    verdict = cmp["verdict"]
    return f"diverged at step {verdict['step']}" if verdict["status"] == "diverged" else verdict["status"]


def metric_rows(report: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(label, one cell per arm) for every metric of the comparison table."""
    speed_note = "" if report["speed_meaningful"] else " (CPU)"
    rows: list[tuple[str, Callable[[Arm, Comparison], str]]] = [
        ("kernels", lambda a, c: ", ".join(a["kernels"]) or "none"),
        ("status", lambda a, c: _status(a)),
        ("steps run", lambda a, c: f"{a['steps_completed']}/{report['steps']}"),
        (f"tokens/s{speed_note}", lambda a, c: _value(a["tokens_per_s"], ",.0f")),
        (f"tokens/s/GPU{speed_note}", lambda a, c: _value(a["tokens_per_s_per_gpu"], ",.0f")),
        ("MFU", lambda a, c: _value(None if a["mfu"] is None else 100 * a["mfu"], ".1f", "%")),
        (f"step time, median{speed_note}", lambda a, c: _value(a["step_time_median_s"], ".3f", " s")),
        ("peak memory allocated", lambda a, c: _value(a["peak_mem_allocated_gib"], ".2f", " GiB")),
        ("peak memory reserved", lambda a, c: _value(a["peak_mem_reserved_gib"], ".2f", " GiB")),
        ("peak host RSS", lambda a, c: _value(a["peak_host_rss_gib"], ".2f", " GiB")),
        ("speed-up (tokens/s)", _vs_baseline("speedup", ".2f", "×")),
        ("peak allocated vs baseline", _vs_baseline("memory_ratio_allocated", ".2f", "×")),
        ("max |Δ loss|", _vs_baseline("max_abs_loss_diff", ".2e")),
        ("max relative Δ loss", _vs_baseline("max_rel_loss_diff", ".2e")),
        ("verdict", _verdict),
    ]
    by_arm = {c["arm"]: c for c in report["comparisons"]}
    return [(label, [cell(arm, by_arm.get(arm["name"])) for arm in report["arms"]]) for label, cell in rows]


def _title(report: dict[str, Any]) -> str:
    where = report["device_name"] or report["device"] or "unknown device"
    world = f" × {report['world_size']}" if report["world_size"] > 1 else ""
    return (
        f"ligertune compare: {Path(report['recipe']).name}, {report['steps']} steps, "
        f"{report['precision']}, {where}{world}"
    )


def rich_table(report: dict[str, Any]):
    from rich.table import Table

    table = Table(title=_title(report), header_style="bold")
    table.add_column("")
    for arm in report["arms"]:
        table.add_column(arm["name"], justify="right")
    for label, cells in metric_rows(report):
        if label == "verdict":
            cells = [
                f"[green]{c}[/]" if c == "parity" else f"[red]{c}[/]" if c.startswith("diverged") else c
                for c in cells
            ]
        table.add_row(label, *cells)
    return table


def _headline_lines(report: dict[str, Any]) -> list[str]:
    lines = [c["summary"] for c in report["comparisons"]]
    lines += [f"arm {a['name']}: {a['status']}: {a['error']}" for a in report["arms"] if a["error"]]
    lines.append(f"tolerance: {report['tolerance']['rule']}")
    return lines + [f"note: {note}" for note in report["notes"]]


def print_report(report: dict[str, Any], console) -> None:
    console.print(rich_table(report))
    for line in _headline_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    files = report.get("files", {})
    if files:
        console.print("wrote " + ", ".join(files.values()), markup=False, highlight=False, soft_wrap=True)


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def _loss(value: float | None) -> str:
    return "non-finite" if value is None else f"{value:.6f}"


def loss_table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per-step losses of every arm, then each arm's relative difference to the baseline."""
    arms, comparisons = report["arms"], report["comparisons"]
    base = arms[0]
    header = ["step"] + [a["name"] for a in arms] + [f"rel Δ {c['arm']}" for c in comparisons]
    rows = []
    by_name = {a["name"]: a for a in arms}
    for k in range(max(len(a["losses"]) for a in arms)):
        row = [str(k + 1)] + [_loss(a["losses"][k]) if k < len(a["losses"]) else "" for a in arms]
        for c in comparisons:
            other = by_name[c["arm"]]["losses"]
            rel = _relative(base["losses"][k], other[k]) if k < min(len(other), len(base["losses"])) else None
            row.append("" if rel is None else f"{rel:.2e}")
        rows.append(row)
    return header, rows


def _relative(base: float | None, other: float | None) -> float | None:
    if base is None or other is None:
        return None
    return abs(other - base) / abs(base) if base else (0.0 if other == base else math.inf)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# {_title(report)}", ""]
    lines += [f"- {line}" for line in _headline_lines(report)]
    lines += ["", "## Arms", ""]
    header = [""] + [a["name"] for a in report["arms"]]
    lines += _md_table(header, [[label, *cells] for label, cells in metric_rows(report)])
    lines += ["", "## Loss per step", ""]
    lines += _md_table(*loss_table_rows(report))
    lines += ["", "## Run", ""]
    lines += [
        f"- recipe: `{report['recipe']}`"
        + (f" with `{' '.join(report['overrides'])}`" if report["overrides"] else ""),
        f"- kernels compared: {', '.join(report['kernels'])}"
        + (" (ablation: one arm per kernel)" if report["ablate"] else ""),
        f"- kernels ran as: {report['kernel_mode'] or 'unknown'}",
        f"- processes per arm: {report['world_size']}",
    ]
    lines += [f"- arm {a['name']} log: `{a['log']}`" for a in report["arms"]]
    lines += ["", "How to read this report: docs/compare.md.", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Loss curves, relative loss difference per step, throughput bars and memory bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    arms, names = report["arms"], [a["name"] for a in report["arms"]]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_loss, ax_diff), (ax_speed, ax_mem) = axes
    _plot_losses(ax_loss, arms)
    _plot_differences(ax_diff, report)
    _plot_speed_and_memory(ax_speed, ax_mem, report)
    for ax in (ax_speed, ax_mem):
        # Ablation arms carry kernel names, too long to sit side by side.
        slanted = len(names) > 3
        ax.set_xticks(
            range(len(names)), names, rotation=20 if slanted else 0, ha="right" if slanted else "center"
        )
    for ax in (ax_loss, ax_diff):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    fig.suptitle(_title(report))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_losses(ax_loss, arms: list[dict[str, Any]]) -> None:
    for i, arm in enumerate(arms):
        steps = [k + 1 for k, v in enumerate(arm["losses"]) if v is not None]
        # Arms at parity draw on top of each other: dashes let the baseline show through, and
        # each later arm's markers are smaller and of another shape, so every arm stays visible.
        style = "-" if i == 0 else "--"
        ax_loss.plot(
            steps,
            [v for v in arm["losses"] if v is not None],
            style,
            marker="os^Dvp*"[i % 7],
            markersize=max(2.5, 8 - 1.2 * i),
            markerfacecolor="none" if i == 0 else None,
            label=arm["name"],
        )
    ax_loss.set(title="training loss per step", xlabel="step", ylabel="loss")
    ax_loss.legend()


def _plot_differences(ax_diff, report: dict[str, Any]) -> None:
    arms = report["arms"]
    base = arms[0]["losses"]
    by_name = {a["name"]: a for a in arms}
    for c in report["comparisons"]:
        other = by_name[c["arm"]]["losses"]
        pairs = [(k + 1, _relative(base[k], other[k])) for k in range(min(len(base), len(other)))]
        pairs = [(k, max(rel, PLOT_FLOOR)) for k, rel in pairs if rel is not None and math.isfinite(rel)]
        ax_diff.plot(
            [k for k, _ in pairs], [r for _, r in pairs], marker=".", label=f"{c['arm']} vs {c['baseline']}"
        )
    ax_diff.axhline(
        report["tolerance"]["rtol"],
        color="red",
        linestyle="--",
        label=f"tolerance {report['tolerance']['rtol']:g}",
    )
    ax_diff.set_yscale("log")
    ax_diff.set(
        title=f"relative loss difference (0 drawn at {PLOT_FLOOR:g})", xlabel="step", ylabel="|Δ loss| / loss"
    )
    ax_diff.legend()


def _plot_speed_and_memory(ax_speed, ax_mem, report: dict[str, Any]) -> None:
    arms = report["arms"]
    speed_note = "" if report["speed_meaningful"] else "\n(CPU: not meaningful)"
    by_arm = {c["arm"]: c for c in report["comparisons"]}
    speedups = [by_arm[a["name"]]["speedup"] if a["name"] in by_arm else None for a in arms]
    _bars(
        ax_speed,
        arms,
        [[a["tokens_per_s"] for a in arms]],
        [""],
        f"tokens/s (× baseline's){speed_note}",
        [speedups],
    )
    if any(a["peak_mem_allocated_gib"] is not None for a in arms):
        series = [[a["peak_mem_allocated_gib"] for a in arms], [a["peak_mem_reserved_gib"] for a in arms]]
        ratios = [by_arm[a["name"]]["memory_ratio_allocated"] if a["name"] in by_arm else None for a in arms]
        _bars(
            ax_mem,
            arms,
            series,
            ["allocated", "reserved"],
            "peak GPU memory, GiB (allocated: × baseline's)",
            [ratios, [None] * len(arms)],
        )
    else:
        _bars(
            ax_mem,
            arms,
            [[a["peak_host_rss_gib"] for a in arms]],
            ["host RSS"],
            "peak host memory, GiB (CPU run)",
        )


def _bar_label(value: float | None) -> str:
    """Whole thousands for rates (59,493), three significant digits for GiB (29.8)."""
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _bars(
    ax,
    arms: list[Arm],
    series: list[list[float | None]],
    labels: list[str],
    title: str,
    ratios: list[list[float | None]] | None = None,
) -> None:
    """Grouped bars, one group per arm, on a linear axis from 0 (bar lengths compare as the
    values do). Each bar is labelled with its value and, where `ratios` gives one, the ratio to
    the baseline ("1.29×"): the number a reader wants, not one to estimate from bar heights. An
    arm that failed is hatched and labelled with its status (for an OOM the bar is the memory it
    had reached); a bar of 0 keeps its label, so it stays visible."""
    width = 0.8 / len(series)
    ratios = ratios or [[None] * len(arms) for _ in series]
    tallest_value = max((v for values in series for v in values if v is not None), default=0.0)
    for i, (values, label, ratio) in enumerate(zip(series, labels, ratios, strict=True)):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(arms))]
        heights = [v or 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=label or None)
        for bar, arm, value, r in zip(bars, arms, values, ratio, strict=True):
            failed = arm["status"] in ("oom", "error")
            if failed:
                bar.set_hatch("//")
            text = _status(arm) if failed else _bar_label(value)
            if r is not None and not failed:
                if bar.get_height() >= 0.15 * tallest_value:  # inside the bar: clear of its neighbours
                    ax.annotate(
                        f"{r:.2f}×",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, -4),
                        textcoords="offset points",
                        ha="center",
                        va="top",
                        fontsize=8 if len(series) == 1 else 6.5,  # grouped bars are narrow
                        fontweight="bold",
                        color="white",
                    )
                else:
                    text += f"\n{r:.2f}×"
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    tallest = max((b.get_height() for b in ax.patches), default=0.0)
    # Headroom for the two-line labels and, above them, the legend.
    ax.set_ylim(0, tallest * (1.35 if any(labels) else 1.2) if tallest > 0 else 1.0)
    ax.set_title(title)
    if any(labels):
        ax.legend(loc="upper center", ncol=len(labels))


def write_outputs(report: dict[str, Any], out: Path, console) -> dict[str, str]:
    """compare.md and compare.png in `out`; returns their paths. Without matplotlib (the
    ``plots`` extra) the plot is left out with one line saying how to get it."""
    files = {}
    md_path = out / "compare.md"
    md_path.write_text(markdown(report), encoding="utf-8")
    files["markdown"] = str(md_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        console.print(
            "note: no compare.png: plots need matplotlib (pip install 'ligertune[plots]'); "
            "compare.json and compare.md are written",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return files
    png_path = out / "compare.png"
    plot(report, png_path)
    files["plot"] = str(png_path)
    return files
