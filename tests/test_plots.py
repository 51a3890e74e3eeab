"""The compare and bench plots, drawn from the H200 results in docs/data: what a reader sees."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")  # the plots extra (and the dev extra)

from matplotlib.figure import Figure  # noqa: E402

from ligertune.tools.bench.report import load_json, write_outputs  # noqa: E402
from ligertune.tools.compare import report as compare_report  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "docs" / "data"


@pytest.fixture
def figures(monkeypatch):
    """The figures saved while the test runs, kept for inspection (savefig still writes them)."""
    saved: list[Figure] = []
    real = Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_compare_bars_show_the_ratio_to_the_baseline(tmp_path, figures):
    report = json.loads((DATA / "h200-compare-1b.json").read_text())
    compare_report.plot(report, tmp_path / "compare.png")
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    _, _, speed, memory = fig.axes[:4]
    speedup = report["comparisons"][0]["speedup"]
    ratio = report["comparisons"][0]["memory_ratio_allocated"]
    assert f"{speedup:.2f}×" in _texts(speed) and f"{ratio:.2f}×" in _texts(memory)
    for ax in (speed, memory):
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    assert "memory" in memory.get_title()


def test_bench_bars_are_linear_from_zero_and_every_bar_is_labelled(tmp_path, figures):
    result = load_json(DATA / "h200-kernels-bench.json")
    written = write_outputs(result, tmp_path, warn=pytest.fail)
    assert {p.name for p in written} >= {"bench_time.png", "bench_memory.png", "flce_memory_vs_vocab.png"}
    time_fig, memory_fig, _ = figures
    for fig in (time_fig, memory_fig):
        for ax in fig.axes:
            if ax.patches:
                assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
                assert len(ax.texts) == len(ax.patches)  # a value on every bar
    assert "time" in time_fig._suptitle.get_text()
    title = memory_fig._suptitle.get_text()
    assert "memory" in title and "CUDA-event" not in title  # not the timing method
    # rope's liger bar is 0 MiB: it stays visible as a labelled bar.
    rope = next(ax for ax in memory_fig.axes if ax.get_title().startswith("rope"))
    assert "0" in _texts(rope)


def test_without_matplotlib_the_reports_are_written_and_the_plot_skipped(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    report = json.loads((DATA / "h200-compare-1b.json").read_text())

    class Printer:
        lines: list[str] = []

        def print(self, line, **kwargs):
            self.lines.append(line)

    files = compare_report.write_outputs(report, tmp_path, Printer())
    assert set(files) == {"markdown"} and (tmp_path / "compare.md").exists()
    assert Printer.lines == [
        "note: no compare.png: plots need matplotlib (pip install 'ligertune[plots]'); "
        "compare.json and compare.md are written"
    ]
    warnings: list[str] = []
    written = write_outputs(load_json(DATA / "h200-kernels-bench.json"), tmp_path / "bench", warnings.append)
    assert [p.suffix for p in written] == [".json", ".csv", ".md"]
    assert len(warnings) == 1 and "pip install 'ligertune[plots]'" in warnings[0]
