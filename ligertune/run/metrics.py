"""Training metrics: throughput, MFU, memory, and where they are written.

Throughput
    Two token counts per step: *label tokens* (those the loss is computed on, the number
    that matters for fine-tuning cost) and *all tokens* (every input position the model
    computes on: whole packed rows, padded batches without their padding). Both are reported
    per second for the whole job and per GPU. The first
    ``logging.throughput_warmup_steps`` steps (compilation, allocator growth, autotuning) are
    left out of every rate: a logging window made only of warm-up steps reports n/a.

MFU (model FLOPs utilisation)
    Achieved model FLOP/s per GPU over the GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`, looked up
    by device name). Model FLOPs per token (`ligertune.catalog.shape.ModelShape.flops_per_token`,
    from the same sizes as the memory plan) follow the PaLM / Megatron convention:

        6·N  +  12·L·d_attn·S

    where N is the number of parameters that take part in matmuls (all parameters except the
    input embedding table, whose lookup is not a matmul; the output projection counts even
    when its weight is tied to the embedding; in a mixture of experts only the active ones:
    each token's top-k routed experts of each MoE layer, not all of them), L the number of layers, d_attn = heads ×
    head_dim and S the sequence length. 6·N is 2 FLOPs per multiply-add times 3 (forward,
    and backward for activations and weights). The attention term is the same 2·3 factor on
    the two S×S products (QKᵀ and PV) per layer: 2·3·2·d_attn·S. A causal kernel skips the
    masked upper triangle and so does about half of that attention work; the convention
    counts the full square (as published MFU figures do), so numbers here are comparable with
    those, and slightly flattering for long sequences. Activation recomputation is not
    counted (it is hardware FLOPs, not model FLOPs). With packing, S is the row length, an
    upper bound on each packed sample's own length.

Sinks
    A JSONL file (``metrics.jsonl`` in the run directory, appended across resumes; one object
    per line with an ``event`` of ``start``, ``train``, ``eval`` or ``summary``), the console
    (a rich progress bar with ETA on a terminal, plain lines otherwise), ``train.log`` (every
    line, timestamped), the metric loggers the recipe selects (TensorBoard, W&B, MLflow:
    `ligertune.run.loggers`), and an end-of-run summary table.

    Each JSONL record goes out in one ``write()`` of the whole line and its newline, on a file
    opened with ``O_APPEND``: a line is never split between two writes (nor between two
    writers), and a process killed or a disk filled mid-line leaves at most a torn last line.
    Opening the file again (a resume) repairs that: a last line without its newline, or one
    that is not JSON, is cut off with a warning, so the file is valid JSON lines again before
    the first new record; the records of the steps the resume replays are marked
    ``"superseded": true`` (`ligertune.run.jsonl`). A full disk, a permission taken away or a
    read-only filesystem while writing one is a `TrainingError` of one line saying so; every
    file here is opened without following a symbolic link.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from ligertune.errors import TrainingError
from ligertune.files import describe_os_error, open_nofollow
from ligertune.run.jsonl import METRICS_FILE, mark_superseded, repair_torn_tail
from ligertune.run.loggers import (
    LOGGER,
    ConsoleHandler,
    close_train_log,
    console_handler,
    open_metric_loggers,
    open_train_log,
    render_text,
    scalars,
)

# Dense (no sparsity) bf16 tensor-core peak in TFLOP/s, by a substring of
# torch.cuda.get_device_name(). Looked up longest key first, so "H100 PCIe" wins over "H100".
PEAK_BF16_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.4,
    "GH200": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,  # SXM ("NVIDIA H100 80GB HBM3")
    "H800": 989.4,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "MI300X": 1307.4,
    "MI250X": 383.0,
}

GIB = 2**30


def peak_bf16_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of `device`, or None when it is not a GPU in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over from what is allocated now, so a run's peak is its own (not that of
    earlier work in the same process: a notebook, `ligertune compare`'s tests, a sweep)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> tuple[float | None, float | None]:
    """Peak memory allocated and reserved by the caching allocator since `reset_peak_memory` (GiB)."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


@dataclass
class _Counts:
    seconds: float = 0.0
    label_tokens: int = 0
    tokens: int = 0
    steps: int = 0

    def add(self, seconds: float, label_tokens: int, tokens: int) -> None:
        self.seconds += seconds
        self.label_tokens += label_tokens
        self.tokens += tokens
        self.steps += 1


class Throughput:
    """Token rates over the current logging window and over the whole run, both without the
    warm-up steps. Token counts are job-wide (summed over ranks)."""

    def __init__(self, warmup_steps: int, world_size: int, flops_per_token: float, peak_flops: float | None):
        self.warmup_steps = warmup_steps
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.window = _Counts()
        self.run = _Counts()
        self._steps_seen = 0

    def add_step(self, seconds: float, label_tokens: int, tokens: int) -> None:
        self._steps_seen += 1
        if self._steps_seen <= self.warmup_steps:
            return
        self.window.add(seconds, label_tokens, tokens)
        self.run.add(seconds, label_tokens, tokens)

    def rates(self, counts: _Counts) -> dict[str, float | None]:
        if counts.steps == 0 or counts.seconds <= 0:
            return dict.fromkeys(
                (
                    "tokens_per_s",
                    "label_tokens_per_s",
                    "tokens_per_s_per_gpu",
                    "label_tokens_per_s_per_gpu",
                    "mfu",
                )
            )
        tokens_per_s = counts.tokens / counts.seconds
        per_gpu = tokens_per_s / self.world_size
        return {
            "tokens_per_s": tokens_per_s,
            "label_tokens_per_s": counts.label_tokens / counts.seconds,
            "tokens_per_s_per_gpu": per_gpu,
            "label_tokens_per_s_per_gpu": counts.label_tokens / counts.seconds / self.world_size,
            "mfu": per_gpu * self.flops_per_token / self.peak_flops if self.peak_flops else None,
        }

    def take_window(self) -> dict[str, float | None]:
        """Rates over the steps since the last call, then start a new window."""
        rates = self.rates(self.window)
        self.window = _Counts()
        return rates


def _json_safe(value: Any) -> Any:
    # JSON has no NaN/inf; a non-finite number is recorded as null (the record says why).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def count_label(n: int) -> str:
    """A parameter count as people say it: 1.24B, 350.0M, 4.1k (a tiny model is not "0.00B")."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.{2 if suffix == 'B' else 1}f}{suffix}"
    return str(n)


def _si(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}{unit}"
    return f"{value:.1f}{unit}"


def _window(steps: int | None) -> str:
    """How many step losses a logged loss is the mean of, when more than one."""
    return f" (mean of {steps} steps)" if steps and steps > 1 else ""


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def format_train_line(record: dict[str, Any], total_steps: int) -> str:
    """One human-readable line for a `train` record."""
    loss, norm = record.get("loss"), record.get("grad_norm")
    parts = [
        f"step {record['step']}/{total_steps}",
        (f"loss {loss:.4f}" if _finite(loss) else "loss non-finite") + _window(record.get("loss_steps")),
        f"lr {record['lr']:.3e}",
        f"grad norm {norm:.3f}" if _finite(norm) else "grad norm non-finite",
        f"{_si(record['tokens_per_s'])} tok/s ({_si(record['label_tokens_per_s'])} label)",
        f"{_si(record['tokens_per_s_per_gpu'])} tok/s/GPU",
        f"MFU {record['mfu'] * 100:.1f}%" if record.get("mfu") is not None else "MFU n/a",
    ]
    if record.get("peak_mem_allocated_gib") is not None:
        parts.append(f"mem {record['peak_mem_allocated_gib']:.1f}/{record['peak_mem_reserved_gib']:.1f} GiB")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    return " | ".join(parts)


# The summary table's words for the record's snake_case keys (other keys, the eval.tasks scores
# among them, show as written).
_EXTRA_LABELS = {"skipped_steps": "skipped steps", "stopped_by": "stopped by"}


@dataclass
class RunSummary:
    steps: int
    seconds: float
    rates: dict[str, float | None]
    peak_mem_allocated_gib: float | None
    peak_mem_reserved_gib: float | None
    final_loss: float | None
    eval_loss: float | None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        return {
            "event": "summary",
            "steps": self.steps,
            "seconds": self.seconds,
            **self.rates,
            "peak_mem_allocated_gib": self.peak_mem_allocated_gib,
            "peak_mem_reserved_gib": self.peak_mem_reserved_gib,
            "final_loss": self.final_loss,
            "eval_loss": self.eval_loss,
            **self.extra,
        }

    def table(self) -> Table:
        table = Table(title="run summary", show_header=False)
        mem = (
            f"{self.peak_mem_allocated_gib:.2f} GiB allocated, {self.peak_mem_reserved_gib:.2f} GiB reserved"
            if self.peak_mem_allocated_gib is not None
            else "n/a (CPU)"
        )
        rows = [
            ("steps", str(self.steps)),
            ("time", f"{self.seconds:.1f} s"),
            (
                "mean tokens/s",
                f"{_si(self.rates['tokens_per_s'])} ({_si(self.rates['label_tokens_per_s'])} label)",
            ),
            ("mean tokens/s/GPU", _si(self.rates["tokens_per_s_per_gpu"])),
            ("MFU", f"{self.rates['mfu'] * 100:.1f}%" if self.rates["mfu"] is not None else "n/a"),
            ("peak memory", mem),
            ("loss, last step", f"{self.final_loss:.4f}" if self.final_loss is not None else "n/a"),
            ("eval loss", self._eval_cell()),
        ]
        extra = {k: v for k, v in self.extra.items() if k != "eval_skipped"}
        labelled = [
            (_EXTRA_LABELS.get(k, k), f"{v:.4f}" if isinstance(v, float) else str(v))
            for k, v in extra.items()
        ]
        for key, value in rows + labelled:
            table.add_row(key, value)
        return table

    def _eval_cell(self) -> str:
        if self.eval_loss is not None:
            return f"{self.eval_loss:.4f}"
        skipped = self.extra.get("eval_skipped")
        return f"n/a (not evaluated: {skipped})" if skipped else "n/a"


class MetricsLogger:
    """Writes records to the JSONL file, the console, train.log and the metric loggers. Only the
    main rank should create one; every method is cheap and never touches the GPU.

    Lines go through the ``ligertune`` logging logger (`ligertune.run.loggers`): through the
    console handler the CLI installed (``--quiet``/``--verbose`` apply), or, for library use
    without one, a handler on this logger's console that lives as long as it does."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        progress: str = "auto",
        tensorboard: bool = False,
        console: Console | None = None,
        loggers: Sequence[str] = (),
        options: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        self.path = run_dir / METRICS_FILE
        self.total_steps = total_steps
        installed = console_handler()
        self._own_handler: ConsoleHandler | None = None
        self._replaced: logging.Handler | None = None
        if console is not None or installed is None:
            # Library use, or a caller that hands its own console: print through that console.
            self.console = console or Console(highlight=False)
            self._own_handler = ConsoleHandler(self.console, installed.level if installed else logging.INFO)
            if installed is not None:
                LOGGER.removeHandler(installed)
            self._replaced = installed
            LOGGER.addHandler(self._own_handler)
            if LOGGER.getEffectiveLevel() > logging.DEBUG:
                LOGGER.setLevel(logging.DEBUG)
        else:
            self.console = installed.console
        self._quiet = (self._own_handler or installed).level > logging.INFO
        self._train_log = self._fd = self._progress = None
        self._sinks: list = []
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._train_log = open_train_log(run_dir)
            repaired = repair_torn_tail(self.path)
            if repaired:
                LOGGER.warning(repaired)
            superseded = mark_superseded(self.path, start_step)
            if superseded:
                LOGGER.info(
                    f"marked {superseded} records of {self.path.name} after step {start_step} superseded: "
                    "this run replays those steps"
                )
            self._fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as e:
            self.close()
            raise TrainingError(f"cannot write the run's logs in {run_dir}: {describe_os_error(e)}") from e
        # --quiet: no bar either (warnings, errors and the summary only).
        use_rich = not self._quiet and (progress == "rich" or (progress == "auto" and sys.stdout.isatty()))
        self._progress = None
        if use_rich:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()
        names = list(loggers) + (["tensorboard"] if tensorboard else [])
        self._sinks = open_metric_loggers(names, run_dir, options or {}, config or {}, start_step)

    def info(self, message: str) -> None:
        LOGGER.info(message)

    def debug(self, message: str) -> None:
        """Shown with --verbose; always in train.log."""
        LOGGER.debug(message)

    def warning(self, message: str) -> None:
        LOGGER.warning(message)

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _json_safe(v) for k, v in record.items()}
        record.setdefault("time", time.time())
        self._append((json.dumps(record) + "\n").encode())
        if self._sinks and "step" in record:
            values = scalars(record)
            for sink in self._sinks:
                sink.log(record["event"], values, record["step"])

    def _append(self, line: bytes) -> None:
        """One write() of the whole line (see the module docstring). A regular file takes it
        whole unless the disk fills; what is left of a short write is then written after it,
        and the error it meets says so."""
        try:
            written = os.write(self._fd, line)
            while written < len(line):
                written += os.write(self._fd, line[written:])
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TrainingError(
                    f"no space left on {self.path.parent} while writing {self.path.name}; free space and "
                    "resume from the last checkpoint (a torn last line is repaired on resume)"
                ) from e
            raise TrainingError(
                f"cannot write {self.path}: {e.strerror or e}; make {self.path.parent} writable and resume "
                "from the last checkpoint"
            ) from e

    def step_done(self, step: int, loss: float | None) -> None:
        """Advance the progress bar (every step, so the ETA stays current)."""
        if self._progress is not None:
            status = f"loss {loss:.4f}" if loss is not None else ""
            self._progress.update(self._task, completed=step, status=status)

    def train(self, record: dict[str, Any]) -> None:
        self.write({"event": "train", **record})
        self.info(format_train_line(record, self.total_steps))

    def eval(self, record: dict[str, Any]) -> None:
        self.write({"event": "eval", **record})
        ppl = record.get("eval_ppl")
        self.info(
            f"eval step {record['step']} | loss {record['eval_loss']:.4f} | ppl {ppl:.2f} | "
            f"{record['eval_label_tokens']} label tokens"
        )

    def summary(self, summary: RunSummary) -> None:
        """The summary table, printed even with --quiet (it is the run's result), and in train.log."""
        self.write(summary.as_record())
        self.close_progress()
        table = summary.table()
        self.console.print(table)
        LOGGER.info("summary\n" + render_text(table), extra={"console": False})

    def close_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def close(self) -> None:
        self.close_progress()
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._train_log is not None:
            close_train_log(self._train_log)
            self._train_log = None
        if self._own_handler is not None:
            LOGGER.removeHandler(self._own_handler)
            if self._replaced is not None:
                LOGGER.addHandler(self._replaced)
            self._own_handler = None
