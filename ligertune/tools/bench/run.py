"""`ligertune bench`: time and memory of every kernel against eager PyTorch, torch.compile and Liger.

What is measured (the kernels, their inputs, providers and minimal bytes) is in
`ligertune.tools.bench.cases`; the timer and memory probes in `timing`; the outputs in `report`.
This module resolves the options and measures every case.

Method, all in one process, the same inputs for every provider:

* **Time**: median device time (CUDA events) after a warm-up, do_bench's protocol with two
  changes (`Timer`): a 256 MB buffer is zeroed before every repetition, so each one starts with a
  cold L2 (60 MB on an H200), and a ~1 ms GPU spin is queued ahead of the call, so the host's
  launch latency is not timed (training queues work ahead of the GPU).
  The first call of every provider (Triton JIT, torch.compile) is a separate warm-up and never
  timed. Passes: ``fwd`` is the forward with autograd recording (as in training); ``bwd`` is
  ``torch.autograd.grad`` alone, each repetition after a fresh untimed forward (CUDA events
  around the backward only; no retain_graph, which fused losses do not support); ``full`` is
  forward + backward together. Gradients are returned by ``autograd.grad``, never accumulated
  into ``.grad``, so no extra add kernel is timed.
* **Peak extra memory**: ``torch.cuda.max_memory_allocated()`` during one call of the pass, minus
  what was allocated just before it (the inputs and upstream gradients; for ``bwd`` also the
  forward's outputs and saved tensors), minus, for ``bwd`` and ``full``, the storage that the
  call allocated for the gradients it returns (their final home, which any implementation
  needs). It is the transient working memory plus, for ``fwd``, the outputs and what the
  forward saves for the backward.
* **Speed of light**: ``max(minimal bytes / copy bandwidth, minimal FLOPs / matmul rate)``, both
  rates measured at the start of the same run (a 1 GiB device-to-device copy counting read +
  write, and a bf16 8192³ matmul). ``% SOL`` is that time over the measured one.
* A provider that is missing, fails or runs out of memory gets a row saying so; the run goes on.

On a machine without CUDA the command still runs end to end (tiny shapes, eager + ligertune,
wall-clock timing) so the whole path can be tested; those timings are labelled not meaningful.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from ligertune.tools.bench.cases import (
    PASSES,
    PROVIDERS,
    SPECS,
    Inputs,
    KernelSpec,
    ProviderUnavailable,
    Shape,
    minimal_bytes,
    minimal_flops,
)
from ligertune.tools.bench.report import load_json, rich_table, write_outputs
from ligertune.tools.bench.results import (
    CPU_LABEL,
    DEFINITIONS,
    DTYPES,
    MISMATCH_TOL,
    SCHEMA,
    TABLE_WIDTH,
    TIMING,
    BenchError,
    BenchResult,
    Row,
    dtype_name,
)
from ligertune.tools.bench.timing import Timer, measure_rates, peak_extra_mib
from ligertune.tools.env import describe_environment, kernel_mode


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ over all output tensors, in fp32 (a mismatch flag, not a test)."""
    num = den = 0.0
    for o, r in zip(_as_tuple(out), _as_tuple(ref), strict=True):
        o, r = o.detach().float(), r.detach().float()
        num += float((o - r).pow(2).sum())
        den += float(r.pow(2).sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


@dataclass
class RunContext:
    """How `run_cases` measures: where, in what dtype, which passes, and until when."""

    device: torch.device
    dtype: torch.dtype
    passes: tuple[str, ...]
    timer: Timer
    deadline: float | None = None  # time.monotonic() after which remaining providers are skipped
    log: Callable[[str], None] = print


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def _release(device: torch.device) -> None:
    """After a failure: drop what the exception's frames still held, and return cached blocks to
    the device so the next provider starts from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure_pass(ctx: RunContext, fn, inputs: Inputs, pass_: str) -> tuple[float, float | None]:
    """(median ms, peak extra MiB or None on CPU) of one pass of `fn` on `inputs`.

    The backward is timed after a fresh, untimed forward each repetition (`Timer.after`), not by
    repeating one backward with retain_graph: that is how training runs it, and losses that
    compute their gradient in the forward (ours, liger) cannot run a backward twice.
    """
    args, wrt, grad_out = inputs.args, inputs.differentiable, inputs.grad_outputs
    on_cuda = ctx.device.type == "cuda"

    def forward():
        return fn(*args)

    def backward(out):
        return torch.autograd.grad(_as_tuple(out), wrt, grad_out)

    if pass_ == "bwd":
        mib = None
        if on_cuda:
            out = forward()
            mib = peak_extra_mib(lambda: backward(out), returns_grads=True)
            del out
        return ctx.timer.after(forward, backward), mib
    run = forward if pass_ == "fwd" else lambda: backward(forward())
    return ctx.timer(run), peak_extra_mib(run, returns_grads=pass_ == "full") if on_cuda else None


def _run_provider(
    ctx: RunContext, spec: KernelSpec, shape: Shape, provider: str, base: Inputs, ref
) -> tuple[list[Row], object]:
    """Rows for one provider on one shape, and its forward output (the reference, for eager)."""

    def row(pass_: str, status: str, note: str = "", **measured) -> Row:
        return Row(
            spec.name, spec.shape_str(shape), dtype_name(ctx.dtype), pass_, provider, status, note, **measured
        )

    if ctx.deadline is not None and time.monotonic() > ctx.deadline:
        return [row(p, "skipped", "time budget spent") for p in ctx.passes], None
    t0 = time.monotonic()
    inputs = base.clone()
    try:
        fn = spec.build(provider, inputs)
    except ProviderUnavailable as e:
        return [row(p, "unavailable", str(e)) for p in ctx.passes], None

    # Warm-up: the first forward and backward compile (Triton JIT, torch.compile); the forward's
    # output is also what the correctness flag compares.
    try:
        out = fn(*inputs.args)
        err = rel_err(out, ref) if ref is not None else None
        check = tuple(t.detach().clone() for t in _as_tuple(out)) if provider == "eager" else None
        torch.autograd.grad(_as_tuple(out), inputs.differentiable, inputs.grad_outputs)
        del out
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        status, note = "oom", _short(e)
    except Exception as e:  # a provider's failure is a result, never the end of the run
        status, note = "error", _short(e)
    else:
        status, note = "ok", ""
    if status != "ok":
        _release(ctx.device)
        return [row(p, status, note) for p in ctx.passes], None

    note = ""
    if err is not None and err > MISMATCH_TOL[ctx.dtype]:
        note = f"MISMATCH vs eager: rel err {err:.2g}"
    rows = []
    for pass_ in ctx.passes:
        try:
            ms, mib = _measure_pass(ctx, fn, inputs, pass_)
        except torch.OutOfMemoryError as e:
            rows.append(row(pass_, "oom", _short(e)))
            _release(ctx.device)
        except Exception as e:
            rows.append(row(pass_, "error", _short(e)))
            _release(ctx.device)
        else:
            rows.append(row(pass_, "ok", note, ms=ms, peak_extra_mib=mib, rel_err_vs_eager=err))
    wall = time.monotonic() - t0
    for r in rows:
        r.case_wall_s = wall
    del fn, inputs
    if ctx.device.type == "cuda":  # hand this provider's cached blocks back before the next one
        torch.cuda.empty_cache()
    return rows, check


def run_cases(
    cases: list[tuple[KernelSpec, Shape]],
    providers: tuple[str, ...],
    ctx: RunContext,
) -> list[Row]:
    """Measure every provider on every (kernel, shape) case; rows in case order."""
    rows: list[Row] = []
    for spec, shape in cases:
        try:
            base = spec.make_inputs(shape, ctx.dtype, ctx.device)
        except Exception as e:  # e.g. a --shape too large for the device: every provider's rows say so
            status = "oom" if isinstance(e, torch.OutOfMemoryError) else "error"
            note = f"making the inputs: {_short(e)}"
            rows += [
                Row(spec.name, spec.shape_str(shape), dtype_name(ctx.dtype), p, prov, status, note)
                for prov in providers
                for p in ctx.passes
            ]
            _release(ctx.device)
            continue
        ref = None
        for provider in providers:
            got, check = _run_provider(ctx, spec, shape, provider, base, ref)
            if provider == "eager":
                ref = check
            rows.extend(got)
            ctx.log(_progress_line(got))
    return rows


def _progress_line(rows: list[Row]) -> str:
    r0 = rows[0]
    parts = [f"{r.pass_} {r.ms:.3f} ms" if r.status == "ok" else f"{r.pass_} {r.status}" for r in rows]
    wall = f" ({r0.case_wall_s:.1f} s)" if r0.case_wall_s is not None else ""
    return f"{r0.kernel} {r0.shape} {r0.provider}: {', '.join(parts)}{wall}"


def derive_metrics(rows: list[Row], copy_gbps: float, matmul_tflops: float) -> None:
    """Fill bytes-derived rates, % of speed of light and speed-up vs eager, in place."""
    eager = {(r.kernel, r.shape, r.pass_): r.ms for r in rows if r.provider == "eager" and r.status == "ok"}
    for r in rows:
        if r.status != "ok" or not r.ms:
            continue
        r.gbps = r.bytes / r.ms / 1e6
        r.tflops = r.flops / r.ms / 1e9 if r.flops else None
        sol_ms = max(r.bytes / (copy_gbps * 1e6), r.flops / (matmul_tflops * 1e9))
        r.pct_sol = 100.0 * sol_ms / r.ms
        base = eager.get((r.kernel, r.shape, r.pass_))
        r.speedup_vs_eager = base / r.ms if base else None


@dataclass
class BenchOptions:
    kernels: str = "all"
    providers: str = ""  # empty: all four on CUDA, eager + ligertune on CPU
    dtype: str = ""  # empty: bf16 on CUDA, fp32 on CPU
    shapes: list[str] = field(default_factory=list)
    passes: str = ",".join(PASSES)
    out: Path = Path("bench-out")
    quick: bool = False
    warmup_ms: float | None = None
    rep_ms: float | None = None
    time_budget_s: float = 0.0
    from_json: Path | None = None


def parse_list(value: str, allowed: Iterable[str], what: str) -> tuple[str, ...]:
    """A comma list of names from `allowed` (or "all"), in the order given, without repeats."""
    allowed = tuple(allowed)
    if value.strip() == "all":
        return allowed
    names: list[str] = []
    for raw in value.split(","):
        name = raw.strip()
        if name not in allowed:
            raise BenchError(
                f"unknown {what} {raw.strip()!r}; choose from {', '.join(allowed)} (comma-separated)"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise BenchError(f"no {what} given; choose from {', '.join(allowed)}")
    return tuple(names)


def parse_shapes(items: list[str], kernels: tuple[str, ...]) -> dict[str, list[Shape]]:
    """``kernel=AxB[,AxB...]`` items into shapes per kernel, checked against the kernel's dims."""
    shapes: dict[str, list[Shape]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SPECS:
            raise BenchError(
                f"--shape {item!r}: expected KERNEL=SHAPE, e.g. rms_norm=16384x4096, with KERNEL one of {', '.join(SPECS)}"
            )
        if name not in kernels:
            raise BenchError(
                f"--shape {item!r}: kernel {name!r} is not among --kernels ({','.join(kernels)})"
            )
        dims = SPECS[name].dims
        for text in value.split(","):
            parts = text.strip().lower().split("x")
            if len(parts) != len(dims) or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise BenchError(
                    f"--shape {item!r}: a {name} shape is {'x'.join(d.upper() for d in dims)} "
                    f"({len(dims)} positive integers joined by 'x'), got {text.strip()!r}"
                )
            shapes.setdefault(name, []).append(tuple(int(p) for p in parts))
    return shapes


def plan_cases(
    kernels: tuple[str, ...], overrides: dict[str, list[Shape]], tier: str
) -> list[tuple[KernelSpec, Shape]]:
    """Cases in run order: every kernel's headline shape first (its --quick shape, or the first
    one given with --shape), then the other shapes, so a time budget that runs out drops
    secondary sizes, never a whole kernel."""
    per_kernel: dict[str, list[Shape]] = {}
    for name in kernels:
        spec = SPECS[name]
        shapes = list(
            overrides.get(
                name, {"full": spec.shapes, "quick": spec.quick_shapes, "cpu": spec.cpu_shapes}[tier]
            )
        )
        if name not in overrides:
            headline = next((s for s in shapes if s in spec.quick_shapes), shapes[0])
            shapes.insert(0, shapes.pop(shapes.index(headline)))
        per_kernel[name] = shapes
    first = [(SPECS[k], s[0]) for k, s in per_kernel.items()]
    rest = [(SPECS[k], shape) for k, s in per_kernel.items() for shape in s[1:]]
    return first + rest


def _table_order(row: Row, kernels: tuple[str, ...]) -> tuple:
    """Kernel by kernel as selected, sizes ascending, whatever order the cases ran in."""
    return kernels.index(row.kernel), tuple(int(d) for d in row.shape.split("x"))


def _command_line(opts: BenchOptions, kernels, providers, dtype: str, passes, warmup, rep) -> str:
    parts = ["ligertune bench", f"--kernels {','.join(kernels)}", f"--providers {','.join(providers)}"]
    parts += [f"--dtype {dtype}", f"--pass {','.join(passes)}", f"--warmup {warmup:g}", f"--rep {rep:g}"]
    parts += [f"--shape {s}" for s in opts.shapes]
    if opts.quick:
        parts.append("--quick")
    if opts.time_budget_s:
        parts.append(f"--time-budget {opts.time_budget_s:g}")
    parts.append(f"--out {opts.out}")
    return " ".join(parts)


def run(opts: BenchOptions, log: Callable[[str], None] = print) -> BenchResult:
    """Resolve the options, measure, and return the result (nothing written yet)."""
    kernels = parse_list(opts.kernels, SPECS, "kernel")
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda") if on_cuda else torch.device("cpu")
    providers = parse_list(opts.providers or ("all" if on_cuda else "eager,ligertune"), PROVIDERS, "provider")
    passes = parse_list(opts.passes, PASSES, "pass")
    dtype_s = opts.dtype or ("bf16" if on_cuda else "fp32")
    if dtype_s not in DTYPES:
        raise BenchError(f"unknown --dtype {dtype_s!r}; choose from {', '.join(DTYPES)}")
    overrides = parse_shapes(opts.shapes, kernels)
    tier = "cpu" if not on_cuda else ("quick" if opts.quick else "full")
    warmup, rep = TIMING[tier]
    warmup = opts.warmup_ms if opts.warmup_ms is not None else warmup
    rep = opts.rep_ms if opts.rep_ms is not None else rep
    if warmup < 0 or rep <= 0:
        raise BenchError("--warmup must be ≥ 0 and --rep > 0 (milliseconds)")
    if opts.time_budget_s < 0:
        raise BenchError("--time-budget must be ≥ 0 seconds (0: no limit)")

    cases = plan_cases(kernels, overrides, tier)
    timer = Timer(device, warmup, rep)
    start = time.monotonic()
    deadline = start + opts.time_budget_s if opts.time_budget_s else None
    log(
        f"{len(cases)} cases × {len(providers)} providers × {len(passes)} passes on "
        f"{torch.cuda.get_device_name() if on_cuda else CPU_LABEL}"
    )
    rates = measure_rates(device, timer)
    log(f"copy {rates['copy_gbps']:.3g} GB/s, {rates['matmul']} matmul {rates['matmul_tflops']:.3g} TFLOP/s")
    ctx = RunContext(device, DTYPES[dtype_s], passes, timer, deadline, log)
    rows = sorted(run_cases(cases, providers, ctx), key=lambda r: _table_order(r, kernels))
    for r in rows:
        shape = tuple(int(p) for p in r.shape.split("x"))
        r.bytes = minimal_bytes(r.kernel, shape, DTYPES[dtype_s])[r.pass_]
        r.flops = minimal_flops(r.kernel, shape)[r.pass_]
    derive_metrics(rows, rates["copy_gbps"], rates["matmul_tflops"])

    meta = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(opts, kernels, providers, dtype_s, passes, warmup, rep),
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "timing": "median of CUDA-event device times, cold L2, launches queued behind a GPU spin"
        if on_cuda
        else CPU_LABEL,
        "kernel_mode": kernel_mode(),
        "dtype": dtype_s,
        "warmup_ms": warmup,
        "rep_ms": rep,
        "passes": list(passes),
        "providers": list(providers),
        "kernels": list(kernels),
        **rates,
        "time_budget_s": opts.time_budget_s,
        "elapsed_s": round(time.monotonic() - start, 1),
        "environment": describe_environment(),
        "definitions": DEFINITIONS,
    }
    return BenchResult(meta, rows)


def run_command(opts: BenchOptions, console) -> BenchResult:
    """The `ligertune bench` command: measure (or load --from-json), write files, print the table."""
    if opts.from_json is not None:
        result = load_json(opts.from_json)
    else:
        result = run(opts, log=lambda line: console.print(line, markup=False, highlight=False))
    written = write_outputs(result, opts.out, warn=lambda line: console.print(f"[yellow]warning:[/] {line}"))
    if not console.is_terminal:  # a log file: rich would assume 80 columns and squeeze every one
        from rich.console import Console

        console = Console(file=console.file, width=TABLE_WIDTH)
    console.print(rich_table(result))
    console.print("wrote " + ", ".join(str(p) for p in written), markup=False, highlight=False)
    return result
