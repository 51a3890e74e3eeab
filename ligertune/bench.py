"""`ligertune bench`: time and memory of every kernel against eager PyTorch, torch.compile and Liger.

What is measured (the kernels, their inputs, providers and minimal bytes) is in
`ligertune.bench_cases`; this module measures it and writes the results.

Method (DESIGN.md "Method for kernels"), all in one process, the same inputs for every provider:

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

import csv
import dataclasses
import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from ligertune.bench_cases import (
    ALIASES,
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

SCHEMA = "ligertune-bench/1"
CPU_LABEL = "CPU — not meaningful"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (warmup ms, rep ms) for do_bench. rep 50 ms is hundreds of samples for a sub-ms kernel; the
# run's wall time is dominated by compilation, not by these (see scripts/gpu_check.sh).
TIMING = {"full": (10.0, 50.0), "quick": (5.0, 25.0), "cpu": (0.0, 20.0)}
# A provider whose forward output differs from eager's by more than this (relative L2) is flagged.
MISMATCH_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
TABLE_WIDTH = 150
FILES = (
    "bench.json",
    "bench.csv",
    "bench.md",
    "bench_time.png",
    "bench_memory.png",
    "flce_memory_vs_vocab.png",
)

DEFINITIONS = {
    "ms": "median device time of one call (CUDA events, cold L2, launches queued behind a GPU spin); bwd times the backward alone, after a fresh forward",
    "peak_extra_mib": (
        "max allocated during one call minus allocated before it (inputs, upstream grads, and for bwd "
        "the forward's outputs and saved tensors), minus the storage of the returned gradients that "
        "the call allocated (bwd, full): their final home"
    ),
    "gbps": "minimal bytes (each input read once, each output written once) / time",
    "pct_sol": "speed-of-light time / time; SOL = max(minimal bytes / copy bandwidth, minimal FLOPs / matmul rate)",
    "speedup_vs_eager": "eager time / this time, same kernel, shape and pass",
    "ce/flce": "liger (and ligertune) compute the gradient during the forward: compare the full pass",
}


class BenchError(ValueError):
    """A bad option; the message names it and says what is accepted."""


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    pass_: str
    provider: str
    status: str  # ok | unavailable | error | oom | skipped
    note: str = ""
    ms: float | None = None
    peak_extra_mib: float | None = None
    bytes: int = 0
    flops: int = 0
    gbps: float | None = None
    tflops: float | None = None
    pct_sol: float | None = None
    speedup_vs_eager: float | None = None
    rel_err_vs_eager: float | None = None
    case_wall_s: float | None = None  # wall time of this provider on this shape, all passes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        d = dict(d)
        d["pass_"] = d.pop("pass")
        return cls(**d)


@dataclass
class BenchResult:
    meta: dict
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**self.meta, "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> BenchResult:
        if data.get("schema") != SCHEMA:
            raise BenchError(f"not a {SCHEMA} file (schema {data.get('schema')!r})")
        meta = {k: v for k, v in data.items() if k != "rows"}
        return cls(meta, [Row.from_dict(r) for r in data["rows"]])


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timer:
    """Median milliseconds of a call's device work (CUDA) or of its wall clock (CPU).

    On CUDA every repetition runs after a cold L2 (a 256 MiB write) and behind a GPU spin
    (``torch.cuda._sleep``, ~1 ms) queued ahead of it, with CUDA events around the call alone.
    The spin lets the host enqueue the whole call before the GPU reaches it, so the time is the
    kernels' own, not the host's launch latency: a single op timed back to back with nothing
    queued ahead is bound by Python/launch overhead on a busy host (seen on the H200 VM: the same
    SwiGLU backward read 0.28 and 0.39 ms in two runs), while in training the host runs ahead
    of the GPU and that overhead is hidden. End-to-end throughput (scripts/e2e_bench.py) shows
    whatever host cost remains.
    """

    device: torch.device
    warmup_ms: float
    rep_ms: float
    lead_cycles: int = 2_000_000  # ~1 ms at the H200's 1.98 GHz: longer than any call's launches

    def __call__(self, fn: Callable[[], object]) -> float:
        return self.after(lambda: None, lambda _: fn())

    def after(self, setup: Callable[[], object], fn: Callable[[object], object]) -> float:
        """Median ms of ``fn(setup())``, timing `fn` alone: `setup` runs, untimed, before every
        repetition. On CUDA it follows do_bench's protocol (an estimate, warm-up for warmup_ms,
        repetitions for rep_ms, a cold L2 before each) with events around `fn` only."""
        if self.device.type != "cuda":
            return _wall_clock_median_ms(setup, fn, self.rep_ms)
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=self.device)

        def once() -> tuple[torch.cuda.Event, torch.cuda.Event]:
            state = setup()
            flush.zero_()
            torch.cuda._sleep(self.lead_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(state)
            end.record()
            return start, end

        def median_of(n: int) -> float:
            times = []
            for _ in range(n):
                start, end = once()
                # One repetition at a time: a spin queued behind the previous repetition would
                # otherwise let the host fall behind again.
                end.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)

        # Each repetition also waits out its spin, so the counts are capped: a median of 100
        # cold-cache repetitions is stable to well under the run-to-run spread.
        estimate = max(median_of(3), 1e-3)
        median_of(min(20, max(1, int(self.warmup_ms / estimate))))
        return median_of(min(100, max(3, int(self.rep_ms / estimate))))


def _wall_clock_median_ms(
    setup: Callable[[], object], fn: Callable[[object], object], rep_ms: float
) -> float:
    """CPU timing: at least two runs, then more until rep_ms of timed work."""
    times: list[float] = []
    while len(times) < 2 or sum(times) < rep_ms:
        state = setup()
        t0 = time.perf_counter()
        fn(state)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_rates(device: torch.device, timer: Timer) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and dense matmul rate (TFLOP/s) of this device."""
    if device.type == "cuda":
        copy_bytes, n, dtype = 2**30, 8192, torch.bfloat16
    else:
        copy_bytes, n, dtype = 2**26, 512, torch.float32
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    mm_ms = timer(lambda: a @ b)
    return {
        "copy_gbps": 2 * copy_bytes / copy_ms / 1e6,
        "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
        "matmul": f"{n}x{n}x{n} {dtype_name(dtype)}",
    }


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _live_cuda_blocks() -> set[int]:
    """Start addresses of the CUDA caching allocator's allocated blocks. Each allocation is its own
    block, so a tensor's storage data_ptr is its block's start address."""
    live = set()
    for segment in torch.cuda.memory_snapshot():
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live.add(address)
            address += block["size"]
    return live


def _new_storage_bytes(tensors: Iterable[torch.Tensor | None], existing: set[int]) -> int:
    """Bytes of the storages behind `tensors` that are not already in `existing`, each counted
    once (a gradient written in place into an input, or one tensor returned for two inputs,
    costs nothing extra)."""
    seen, total = set(existing), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _peak_extra_mib(run: Callable[[], object], returns_grads: bool) -> float:
    """Run once on the current CUDA device and return the peak extra MiB (see DEFINITIONS).

    With `returns_grads`, `run` returns a tuple of gradients; the storage among them that was
    allocated during the run is their final home and is subtracted. Storage that already existed
    is not: a gradient written into an input (liger's cross entropy) or computed by the forward
    and only handed over by the backward (fused losses) costs the backward nothing.
    """
    torch.cuda.synchronize()
    existing = _live_cuda_blocks() if returns_grads else set()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = _new_storage_bytes(result, existing) if returns_grads else 0
    return (peak - before - grads) / 2**20


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
            mib = _peak_extra_mib(lambda: backward(out), returns_grads=True)
            del out
        return ctx.timer.after(forward, backward), mib
    run = forward if pass_ == "fwd" else lambda: backward(forward())
    return ctx.timer(run), _peak_extra_mib(run, returns_grads=pass_ == "full") if on_cuda else None


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


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


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


def parse_list(
    value: str, allowed: Iterable[str], what: str, aliases: dict[str, str] | None = None
) -> tuple[str, ...]:
    """A comma list of names from `allowed` (or "all"), in the order given, without repeats."""
    allowed = tuple(allowed)
    if value.strip() == "all":
        return allowed
    names: list[str] = []
    for raw in value.split(","):
        name = (aliases or {}).get(raw.strip(), raw.strip())
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
        name = ALIASES.get(name.strip(), name.strip())
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
    from ligertune.environment import describe_environment, kernel_mode

    kernels = parse_list(opts.kernels, SPECS, "kernel", ALIASES)
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


# ---------------------------------------------------------------------------------------------
# Output: JSON, CSV, Markdown, rich table, plots
# ---------------------------------------------------------------------------------------------

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


def _plot_per_kernel(result: BenchResult, path: Path, metric: str, ylabel: str, log_scale: bool) -> None:
    """Grouped bars: one panel per kernel, shapes along x, one bar per provider. A provider
    without a value there (failed, unavailable, no memory on CPU) gets a grey label instead."""
    import matplotlib.pyplot as plt

    pass_ = _plot_pass(result)
    providers = result.meta["providers"]
    kernels = list(dict.fromkeys(r.kernel for r in result.rows))
    cols = min(3, len(kernels))
    nrows = math.ceil(len(kernels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 3.6 * nrows), squeeze=False)
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
                    ax.bar(x, value, width, color=f"C{i}", label=provider if j == 0 else None)
        ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
        ax.set_title(f"{kernel} ({pass_})", fontsize=10)
        ax.set_ylabel(ylabel)
        if log_scale and ax.patches:  # times of one kernel span orders of magnitude across providers
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(kernels) :]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(providers))]
    fig.suptitle(
        f"{ylabel} — {result.meta['device']}, {result.meta['dtype']} ({result.meta['timing']})", fontsize=11
    )
    fig.legend(handles, providers, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=len(providers))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_vocab(result: BenchResult, path: Path) -> None:
    """Peak extra memory against vocabulary size for ce and flce: one colour per provider (as in
    the bar plots), one line style per rows (× hidden) when several are present."""
    import matplotlib.pyplot as plt

    pass_ = _plot_pass(result)
    providers = result.meta["providers"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, kernel in zip(axes.flat, ("ce", "flce"), strict=True):
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
        dims = "rows x hidden" if kernel == "flce" else "rows"
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
        warn(f"matplotlib is not installed: no plots; render them elsewhere with --from-json {json_path}")
        return written
    _plot_per_kernel(result, time_png, "ms", "median ms", log_scale=True)
    _plot_per_kernel(result, mem_png, "peak_extra_mib", "peak extra MiB", log_scale=False)
    _plot_vocab(result, vocab_png)
    return written + [time_png, mem_png, vocab_png]


def load_json(path: Path) -> BenchResult:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"--from-json {path}: cannot read it ({e})") from None
    return BenchResult.from_json(data)


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
