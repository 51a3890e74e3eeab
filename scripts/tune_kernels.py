#!/usr/bin/env python3
"""Profile and tune the row-norm (RMSNorm, add+RMSNorm, LayerNorm) and RoPE kernels on one GPU.

Run on the GPU machine from the repo root; about 3-4 minutes on an H200, never more than
``--budget`` seconds of sweeping (variants not started by then are reported as skipped)::

    source .whl/install.sh && python3 scripts/tune_kernels.py --out $OUT/tune

One process, three parts:

1. **Profile** one call of each op exactly as ``ligertune bench`` runs it (its inputs from
   `ligertune.tools.bench.cases`; ours, and Liger's when installed): the bench-protocol times (fwd and
   full with do_bench, bwd timed after a fresh forward); the host time to issue the forward, the
   backward (``autograd.grad``) and, for ours, each bare Triton launch in them; and from
   torch.profiler the GPU kernels per call (summed time, names) and the CUDA runtime calls
   (launches, allocations, synchronisations). ``full`` far above the summed kernel time means
   the GPU waited for the host.
2. **Sweep** the launch parameters of our kernels through the internal ``config=`` of their
   launchers (`kernels/rms_norm.py` `_RowNormConfig`: rows per block, warps, pipeline depth,
   programs per SM; `kernels/rope.py` `_RopeConfig`: positions and heads per tile, warps) over
   the benchmark shapes, timing pure GPU time (`GpuTimer`), and checking every variant's output
   against the default configuration's.
3. **Report**: the sweep table (per op, shape, dtype and pass: the default's time and % of speed
   of light, the best variant and its time) is printed last; ``tune.json`` (every variant) and
   ``tune.md`` go to ``--out``.

Speed of light = minimal bytes (`ligertune.tools.bench.cases.minimal_bytes`) / the device-to-device
copy bandwidth measured at the start of the same run (read + write counted).

``--smoke`` runs everything on tiny shapes with few variants, on the CPU interpreter when there
is no GPU (``TRITON_INTERPRET=1`` is set for it): a check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    # The interpreter must be chosen before triton (and ligertune.kernels) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ligertune.kernels import rms_norm as rms
from ligertune.kernels import rope
from ligertune.kernels._utils import sm_count
from ligertune.tools.bench.cases import SPECS, ProviderUnavailable, minimal_bytes
from ligertune.tools.bench.timing import Timer

BF16 = torch.bfloat16
RMS_EPS, LN_EPS = 1e-6, 1e-5


def log(msg: str = "") -> None:
    print(msg, flush=True)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class GpuTimer:
    """Median GPU time of ``fn`` in ms, host overhead excluded, L2 cold.

    Before every repetition: zero a 256 MiB buffer (evicts L2, as do_bench does), then make the
    GPU spin for ``lead_us`` (``torch.cuda._sleep``) so the host has queued all of ``fn``'s
    launches before the start event is reached. CUDA events then bracket only GPU work. (do_bench
    alone measures host-bound when the host needs longer than its 256 MiB memset to issue ``fn``.)
    On CPU (``--smoke``): wall-clock median.
    """

    def __init__(self, device: torch.device, reps: int, lead_us: float = 300.0):
        self.device, self.reps = device, reps
        self.cuda = device.type == "cuda"
        if not self.cuda:
            return
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
        self.sleep_cycles = 0
        if hasattr(torch.cuda, "_sleep"):
            probe = 1_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(probe)  # first call loads the kernel
            start.record()
            torch.cuda._sleep(probe)
            end.record()
            torch.cuda.synchronize()
            us_per_cycle = start.elapsed_time(end) * 1e3 / probe
            self.sleep_cycles = int(lead_us / max(us_per_cycle, 1e-6))

    def __call__(self, fn: Callable[[], object], reps: int | None = None) -> float:
        reps = reps or self.reps
        fn()
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return median(times)
        torch.cuda.synchronize()
        events = []
        for _ in range(reps):
            self.flush.zero_()
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return median(s.elapsed_time(e) for s, e in events)


def host_us(fn: Callable[[], object], setup: Callable[[], object] | None = None, n: int = 20) -> float:
    """Median host (CPU) microseconds to issue ``fn(setup())``, the GPU idle and the queue empty
    before each call, so no launch ever blocks: this is pure host cost."""
    times = []
    for _ in range(n):
        state = setup() if setup else None
        sync()
        t0 = time.perf_counter()
        out = fn(state) if setup else fn()
        times.append((time.perf_counter() - t0) * 1e6)
        del out
        sync()
    return median(times)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(timer: GpuTimer, device: torch.device, smoke: bool) -> float:
    """Device-to-device copy rate in bytes/s, read + write counted (the SOL denominator)."""
    n = 2**20 if smoke else 2**30
    src = torch.empty(n, dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# Launch capture: which Triton kernels a call launches, with what, and what a bare launch costs
# ---------------------------------------------------------------------------------------------


class _RecordingKernel:
    """Stands in for a module's @triton.jit kernel: records each launch, then performs it."""

    def __init__(self, real, name: str, sink: list):
        self._real, self._name, self._sink = real, name, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self._sink.append((self._name, self._real, grid, args, kwargs))
            return self._real[grid](*args, **kwargs)

        return launch

    def __getattr__(self, attr):  # .warmup(...) for the occupancy query, etc.
        return getattr(self._real, attr)


OUR_KERNELS = [
    (rms, "_row_norm_fwd_kernel"),
    (rms, "_row_norm_bwd_kernel"),
    (rope, "_rope_kernel"),
]


def record_launches(fn: Callable[[], object]) -> list:
    """Run ``fn`` once with our kernels wrapped; return [(name, kernel, grid, args, kwargs)]."""
    sink: list = []
    saved = [(mod, name, getattr(mod, name)) for mod, name in OUR_KERNELS]
    try:
        for mod, name, real in saved:
            setattr(mod, name, _RecordingKernel(real, name, sink))
        fn()
        sync()
    finally:
        for mod, name, real in saved:
            setattr(mod, name, real)
    return sink


# ---------------------------------------------------------------------------------------------
# Part 1: profile one call per op the way `ligertune bench` runs it
# ---------------------------------------------------------------------------------------------


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _is_runtime_call(name: str) -> bool:
    """CUDA runtime (cudaLaunchKernel, cudaMalloc, cudaStreamSynchronize, ...) or driver
    (cuLaunchKernelEx, ...) API calls, as the profiler names them."""
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def profile_op(kernel: str, shape: tuple, provider: str, device: torch.device, smoke: bool) -> dict:
    spec = SPECS[kernel]
    inputs = spec.make_inputs(shape, BF16, device)
    fn = spec.build(provider, inputs)
    args, wrt, grad_out = inputs.args, inputs.differentiable, inputs.grad_outputs

    def forward():
        return fn(*args)

    def backward(out):
        return torch.autograd.grad(_as_tuple(out), wrt, grad_out)

    def full():
        return backward(forward())

    for _ in range(3):
        full()
    sync()
    result: dict = {"kernel": kernel, "shape": "x".join(map(str, shape)), "provider": provider}

    if device.type == "cuda":
        timer = Timer(device, 5.0, 25.0) if smoke else Timer(device, 10.0, 50.0)
        result["bench_ms"] = {
            "fwd": timer(forward),
            "bwd": timer.after(forward, backward),
            "full": timer(full),
        }
    result["host_us"] = {
        "fwd": host_us(forward),
        "bwd": host_us(backward, setup=forward),
        "full": host_us(full),
    }
    if provider == "ligertune":
        launches = record_launches(full)
        result["bare_launch_us"] = [
            {"kernel": name, "us": host_us(lambda k=k, g=g, a=a, kw=kw: k[g](*a, **kw))}
            for name, k, g, a, kw in launches
        ]

    n_calls = 5
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n_calls):
            full()
        sync()
    kernels: dict[str, list[float]] = defaultdict(list)
    runtime: Counter = Counter()
    runtime_us: Counter = Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name].append(evt.time_range.elapsed_us())
        elif _is_runtime_call(evt.name):
            runtime[evt.name] += 1
            runtime_us[evt.name] += evt.time_range.elapsed_us()
    # Where the host time goes: the ops with the most self CPU time (aten::empty, aten::sum, the
    # autograd Function nodes, ...).
    host_ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    result["host_ops"] = [
        {"name": e.key, "per_call": e.count / n_calls, "self_us": e.self_cpu_time_total / n_calls}
        for e in host_ops
    ]
    result["gpu_kernels"] = [
        {"name": name, "per_call": len(ts) / n_calls, "us": sum(ts) / len(ts)}
        for name, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    ]
    result["gpu_us_per_call"] = sum(sum(ts) for ts in kernels.values()) / n_calls
    result["runtime_per_call"] = {
        name: {"count": runtime[name] / n_calls, "us": runtime_us[name] / n_calls} for name in runtime
    }
    return result


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def print_profile(r: dict) -> None:
    head = f"{r['kernel']} {r['shape']} {r['provider']}:"
    if "bench_ms" in r:
        b = r["bench_ms"]
        head += f" bench fwd {b['fwd']:.3f} bwd {b['bwd']:.3f} full {b['full']:.3f} ms |"
    head += f" GPU kernels {r['gpu_us_per_call']:.1f} us/full call"
    log(head)
    h = r["host_us"]
    line = f"    host: fwd {h['fwd']:.0f} us, bwd {h['bwd']:.0f} us, full {h['full']:.0f} us"
    if r.get("bare_launch_us"):
        bare = ", ".join(f"{x['kernel']} {x['us']:.0f}" for x in r["bare_launch_us"])
        line += f" | bare Triton launches (us): {bare}"
    log(line)
    for k in r["gpu_kernels"]:
        log(f"    {k['per_call']:.0f}x {k['us']:8.1f} us  {_short(k['name'])}")
    calls = ", ".join(
        f"{n} {v['count']:.0f} ({v['us']:.0f} us)" for n, v in sorted(r["runtime_per_call"].items())
    )
    log(f"    runtime calls per full call: {calls or 'none recorded'}")
    ops = ", ".join(f"{_short(o['name'], 40)} {o['per_call']:.0f}x {o['self_us']:.0f}" for o in r["host_ops"])
    log(f"    host self time per full call (us): {ops}")


# ---------------------------------------------------------------------------------------------
# Part 2: sweeps
# ---------------------------------------------------------------------------------------------


@dataclass
class Variant:
    config: dict  # the config's fields (for the default: what `_default_config` chose)
    ms: float | None = None
    status: str = "ok"  # ok | mismatch: ... | error: ... | skipped
    note: str = ""  # e.g. programs per SM of a backward


@dataclass
class Group:
    """One op × shape × dtype × pass: its default and every variant tried."""

    op: str
    shape: str
    dtype: str
    pass_: str
    sol_ms: float
    default: Variant
    variants: list[Variant] = field(default_factory=list)

    def best(self) -> Variant | None:
        ok = [v for v in self.variants if v.status == "ok" and v.ms is not None]
        return min(ok, key=lambda v: v.ms) if ok else None


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def close_enough(out: torch.Tensor, ref: torch.Tensor) -> str:
    """'' if ``out`` equals ``ref`` up to reduction order, else what differs.

    Configs change only summation orders: rstd (and dw) move in their last fp32 bits, which can
    flip a rounding of n (llama casting) and of the output; allow 4 ulps of bf16/fp16 elementwise
    (plus the mean magnitude as a floor, for values small through cancellation), 1e-5 relative
    norm for fp32.
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return "non-finite values"
    if ref.dtype in (torch.bfloat16, torch.float16):
        bad = (o - r).abs() > 2.0**-6 * (r.abs() + r.abs().mean())
        return f"{int(bad.sum())} elements differ" if bad.any() else ""
    err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    return f"relative error {err:.2e}" if err > 1e-5 else ""


def compare_outputs(outs, refs) -> str:
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o is None and r is None:
            continue
        if (o is None) != (r is None):
            return f"output {i}: missing"
        msg = close_enough(o, r)
        if msg:
            return f"output {i}: {msg}"
    return ""


def measure_default(group: Group, run: Callable[[object], tuple], timer: GpuTimer, note=None) -> tuple:
    """Time the default configuration of a group; return its outputs (the variants' reference)."""
    ref = run(None)
    group.default.ms = timer(lambda: run(None))
    group.default.note = note(None) if note else ""
    return ref


def try_variants(
    group: Group,
    run: Callable[[object], tuple],
    ref: tuple,
    make_config: Callable[[dict], object],
    variants: list[dict],
    timer: GpuTimer,
    budget: Budget,
    note: Callable[[object], str] | None = None,
) -> None:
    """Time every variant whose outputs match the default's; record why the others were dropped."""
    for fields in variants:
        v = Variant(fields)
        group.variants.append(v)
        if budget.left() <= 0:
            v.status = "skipped"
            continue
        cfg = make_config(fields)
        try:
            mismatch = compare_outputs(run(cfg), ref)
            if mismatch:
                v.status = f"mismatch: {mismatch}"
                continue
            v.ms = timer(lambda cfg=cfg: run(cfg))
            v.note = note(cfg) if note else ""
        except Exception as e:  # a variant that fails to compile or launch is reported, not fatal
            first_line = str(e).splitlines()[0][:120] if str(e) else ""
            v.status = f"error: {type(e).__name__}: {first_line}"


def group_line(g: Group) -> str:
    best = g.best()
    d = g.default
    s = f"{g.op} {g.shape} {g.dtype} {g.pass_}: default {fmt_ms(d.ms)} ({pct(g, d.ms)}) {cfg_str(d.config)} {d.note}"
    if best is not None:
        gain = f" {d.ms / best.ms:.2f}x" if d.ms else ""
        s += f" | best {fmt_ms(best.ms)} ({pct(g, best.ms)}{gain}) {cfg_str(best.config)} {best.note}"
    bad = [v for v in g.variants if v.status not in ("ok", "skipped")]
    skipped = sum(v.status == "skipped" for v in g.variants)
    if bad:
        s += f" | {len(bad)} bad: {bad[0].status[:80]}"
    if skipped:
        s += f" | {skipped} skipped (budget)"
    return s


def fmt_ms(ms: float | None) -> str:
    return "  -   " if ms is None else f"{ms:.4f}"


def pct(g: Group, ms: float | None) -> str:
    return "-" if not ms else f"{100 * g.sol_ms / ms:.0f}% SOL"


def cfg_str(fields: dict) -> str:
    short = {
        "block_m": "bm",
        "num_warps": "w",
        "num_stages": "st",
        "programs_per_sm": "per_sm",
        "block_s": "bs",
        "block_h": "bh",
    }
    return ",".join(f"{short.get(k, k)}={v}" for k, v in fields.items())


# ---- row norms ------------------------------------------------------------------------------


def norm_variants(block_n: int, backward: bool, smoke: bool) -> list[dict]:
    """Rows per block × warps (× pipeline depth for the backward), at 8-32 elements per thread
    (forward) or 8-16 (backward: its registers limit occupancy), blocks of at most 16384."""
    stages = (1, 2, 3) if backward else (None,)
    if smoke:
        return [_norm_fields(bm, 4, st) for bm in (1, 2) for st in stages]
    per_thread = (8, 16) if backward else (8, 16, 32)
    out = []
    for block_m in (1, 2, 4, 8):
        elems = block_m * block_n
        if elems > 16384 or (block_m > 1 and elems > 4 * max(block_n, 2048)):
            continue
        for warps in (2, 4, 8, 16, 32):
            if elems // (32 * warps) in per_thread:
                out += [_norm_fields(block_m, warps, st) for st in stages]
    return out


def _norm_fields(block_m: int, num_warps: int, num_stages: int | None) -> dict:
    fields = dict(block_m=block_m, num_warps=num_warps)
    return fields if num_stages is None else dict(fields, num_stages=num_stages)


def norm_problem(op: str, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
    """Inputs and the fwd/bwd launcher calls of one norm op (ours, no autograd)."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    x, dy = randn(rows, hidden), randn(rows, hidden)
    w = (1.0 + randn(hidden, scale=0.1).float()).to(dtype)
    center = op == "layer_norm"
    llama = not center
    b = randn(hidden) if center else None
    res = randn(rows, hidden) if op == "add_rms_norm" else None
    ds = randn(rows, hidden) if op == "add_rms_norm" else None
    eps = LN_EPS if center else RMS_EPS

    def fwd(cfg):
        y, s, _, mean, rstd = rms._row_norm_forward(x, res, w, b, eps, 0.0, center, llama, dtype, config=cfg)
        return y, s, mean, rstd

    _, _, x_saved, mean, rstd = rms._row_norm_forward(x, res, w, b, eps, 0.0, center, llama, dtype)

    def bwd(cfg):
        return rms._row_norm_backward(
            dy, x_saved, w, mean, rstd, 0.0, llama, True, center, dres=ds, config=cfg
        )

    return fwd, bwd


def bwd_programs_note(bwd: Callable, device: torch.device) -> Callable[[object], str]:
    """A backward variant's persistent grid, as programs per SM (read from its launch)."""

    def note(cfg) -> str:
        launches = record_launches(lambda: bwd(cfg))
        grids = [grid[0] for name, _, grid, _, _ in launches if name == "_row_norm_bwd_kernel"]
        return f"[{grids[0] / sm_count(device):.2g}/SM]" if grids else ""

    return note


def sweep_norm(op, rows, hidden, dtype, device, timer, bw, budget, smoke) -> list[Group]:
    fwd, bwd = norm_problem(op, rows, hidden, dtype, device)
    block_n = triton_next_pow2(hidden)
    sol = {p: b / bw * 1e3 for p, b in minimal_bytes(op, (rows, hidden), dtype).items()}
    shape, dname = f"{rows}x{hidden}", str(dtype).replace("torch.", "")
    config = lambda fields: rms._RowNormConfig(**fields)  # noqa: E731

    def default(backward: bool) -> Variant:
        fields = asdict(rms._default_config(backward, hidden, device.type))
        return Variant(fields if backward else {k: fields[k] for k in ("block_m", "num_warps")})

    fwd_group = Group(op, shape, dname, "fwd", sol["fwd"], default(False))
    ref = measure_default(fwd_group, fwd, timer)
    try_variants(fwd_group, fwd, ref, config, norm_variants(block_n, False, smoke), timer, budget)
    log(group_line(fwd_group))

    note = bwd_programs_note(bwd, device)
    bwd_group = Group(op, shape, dname, "bwd", sol["bwd"], default(True))
    ref = measure_default(bwd_group, bwd, timer, note)
    try_variants(bwd_group, bwd, ref, config, norm_variants(block_n, True, smoke), timer, budget, note)
    # Then the persistent grid of the best variant: fewer programs per SM than fit (less partial
    # dw traffic, more rows each), or more than fit at once (waves).
    best = bwd_group.best()
    if best is not None and not smoke:
        grids = [dict(best.config, programs_per_sm=n) for n in (1, 2, 4)]
        try_variants(bwd_group, bwd, ref, config, grids, timer, budget, note)
    log(group_line(bwd_group))
    return [fwd_group, bwd_group]


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ---- RoPE -----------------------------------------------------------------------------------


def rope_variants(smoke: bool) -> list[dict]:
    """Tiles of 16, 32 or 64 (positions × heads) half-rows, 4 or 8 warps."""
    if smoke:
        return [dict(block_s=1, block_h=2, num_warps=4), dict(block_s=4, block_h=1, num_warps=4)]
    out = []
    for rows in (16, 32, 64):
        for block_s in (1, 2, 4, 8, 16, 32, 64):
            block_h = rows // block_s
            if block_h < 1 or block_h > 32:
                continue
            for warps in (4, 8):
                out.append(dict(block_s=block_s, block_h=block_h, num_warps=warps))
    return out


def sweep_rope(shape, dtype, device, timer, bw, budget, smoke) -> list[Group]:
    """Forward on HF's q/k (position-major memory); backward on head-major gradients, as the
    benchmark (and attention kernels that return contiguous [B, H, S, D]) hand them over."""
    inputs = SPECS["rope"].make_inputs(shape, dtype, device)
    t = inputs.tensors
    q, k = t["q"].detach().transpose(1, 2), t["k"].detach().transpose(1, 2)
    cos, sin = t["cos"], t["sin"]
    dq, dk = inputs.grad_outputs

    def fwd(cfg):
        return rope._rope_launch(q, k, cos, sin, 1, backward=False, config=cfg)

    def bwd(cfg):
        return rope._rope_launch(dq, dk, cos, sin, 1, backward=True, config=cfg)

    sol = {p: b / bw * 1e3 for p, b in minimal_bytes("rope", shape, dtype).items()}
    shape_s, dname = "x".join(map(str, shape)), str(dtype).replace("torch.", "")
    groups = []
    half = cos.shape[-1] // 2
    for pass_, run, layout, x in (("fwd", fwd, "pos-major", q), ("bwd", bwd, "head-major", dq)):
        default = Variant(asdict(rope._default_config(x, 1, half)))
        g = Group("rope", f"{shape_s} {layout}", dname, pass_, sol[pass_], default)
        ref = measure_default(g, run, timer)
        try_variants(g, run, ref, lambda f: rope._RopeConfig(**f), rope_variants(smoke), timer, budget)
        groups.append(g)
        log(group_line(g))
    return groups


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def markdown(meta: dict, profiles: list[dict], groups: list[Group]) -> str:
    lines = [
        "# tune_kernels",
        "",
        f"- {meta['device']}; torch {meta['torch']}, triton {meta['triton']}",
        f"- copy bandwidth {meta['copy_gbps']:.0f} GB/s (read + write); SOL = minimal bytes / that",
        f"- wall time {meta['wall_s']:.0f} s",
        "",
        "## Profile (one call as `ligertune bench` runs it)",
        "",
        "| op | provider | bench fwd | bench bwd | bench full | GPU kernels/full (us) | host fwd/bwd/full (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in profiles:
        b = r.get("bench_ms", {})
        h = r["host_us"]
        lines.append(
            f"| {r['kernel']} {r['shape']} | {r['provider']} | {b.get('fwd', 0):.3f} | {b.get('bwd', 0):.3f} | "
            f"{b.get('full', 0):.3f} | {r['gpu_us_per_call']:.1f} | {h['fwd']:.0f} / {h['bwd']:.0f} / {h['full']:.0f} |"
        )
    lines += [
        "",
        "## Sweep (GPU time, host excluded, cold L2)",
        "",
        "| op | shape | dtype | pass | default config | default ms | % SOL | best config | best ms | % SOL | SOL ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        best = g.best()
        lines.append(
            f"| {g.op} | {g.shape} | {g.dtype} | {g.pass_} | {cfg_str(g.default.config)} {g.default.note} | "
            f"{fmt_ms(g.default.ms)} | "
            f"{pct(g, g.default.ms)} | {cfg_str(best.config) + ' ' + best.note if best else '-'} | "
            f"{fmt_ms(best.ms if best else None)} | {pct(g, best.ms if best else None)} | {g.sol_ms:.4f} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


NORM_PLAN = [  # (op, hidden, dtype) in priority order: the headline shapes first
    ("rms_norm", 4096, BF16),
    ("add_rms_norm", 4096, BF16),
    ("layer_norm", 2048, BF16),
    ("rms_norm", 2048, BF16),
    ("layer_norm", 4096, BF16),
    ("add_rms_norm", 2048, BF16),
    ("rms_norm", 8192, BF16),
    ("add_rms_norm", 8192, BF16),
    ("layer_norm", 8192, BF16),
    ("rms_norm", 4096, torch.float32),
]
ROPE_SHAPE = (8, 2048, 32, 8, 128)
PROFILE_PLAN = [  # (kernel, shape)
    ("rms_norm", (16384, 4096)),
    ("rms_norm", (16384, 2048)),
    ("add_rms_norm", (16384, 4096)),
    ("layer_norm", (16384, 2048)),
    ("rope", ROPE_SHAPE),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for tune.json and tune.md")
    parser.add_argument("--budget", type=float, default=180.0, help="seconds of sweeping (default 180)")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions per variant (default 25)")
    parser.add_argument(
        "--only", default="", help="comma list: profile,rms_norm,add_rms_norm,layer_norm,rope"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few variants: checks the script")
    opts = parser.parse_args(argv)
    only = set(filter(None, opts.only.split(",")))

    def wanted(part: str) -> bool:
        return not only or part in only

    t_start = time.monotonic()

    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name()
    elif opts.smoke:
        device, name = torch.device("cpu"), "cpu (Triton interpreter)"
    else:
        log("tune_kernels needs a CUDA GPU (or --smoke to check the script on the CPU interpreter)")
        return 2
    import triton

    rows = 64 if opts.smoke else 16384
    rope_shape = (2, 8, 4, 2, 16) if opts.smoke else ROPE_SHAPE
    norm_plan = [(op, 256 if opts.smoke else h, dt) for op, h, dt in NORM_PLAN]
    if opts.smoke:
        norm_plan = norm_plan[:3]
    n_variants = 2 * len(rope_variants(opts.smoke)) + sum(
        len(norm_variants(triton_next_pow2(h), False, opts.smoke))
        + len(norm_variants(triton_next_pow2(h), True, opts.smoke))
        + 3
        for _, h, _ in norm_plan
    )
    log(f"# tune_kernels on {name}: torch {torch.__version__}, triton {triton.__version__}")
    log(
        f"# plan: profile {len(PROFILE_PLAN)} ops; sweep {n_variants} variants (~0.4 s each to compile and "
        f"time: ~{0.4 * n_variants:.0f} s, capped at {opts.budget:.0f} s); expect {60 + min(0.4 * n_variants, opts.budget):.0f} s"
    )

    timer = GpuTimer(device, reps=5 if opts.smoke else opts.reps)
    bw = copy_bandwidth(timer, device, opts.smoke)
    log(f"# copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")

    profiles: list[dict] = []
    if wanted("profile"):
        log("\n## Part 1: profile (one call as `ligertune bench` runs it)")
        for kernel, shape in PROFILE_PLAN:
            if opts.smoke:
                shape = SPECS[kernel].cpu_shapes[0]
            for provider in ("ligertune", "liger"):
                try:
                    r = profile_op(kernel, shape, provider, device, opts.smoke)
                except ProviderUnavailable as e:
                    log(f"{kernel} {provider}: unavailable ({e})")
                    continue
                except Exception as e:  # one failing probe must not cost the whole GPU run
                    log(f"{kernel} {provider}: profile failed: {type(e).__name__}: {e}")
                    continue
                profiles.append(r)
                print_profile(r)

    log(f"\n## Part 2: sweep (GPU time, host excluded; budget {opts.budget:.0f} s)")
    budget = Budget(opts.budget)
    groups: list[Group] = []
    sweeps = [(op, lambda op=op, h=h, dt=dt: sweep_norm(op, rows, h, dt, device, timer, bw, budget, opts.smoke))
              for op, h, dt in norm_plan]  # fmt: skip
    # RoPE right after the headline RMSNorm.
    sweeps.insert(1, ("rope", lambda: sweep_rope(rope_shape, BF16, device, timer, bw, budget, opts.smoke)))
    for part, sweep in sweeps:
        if not wanted(part):
            continue
        try:
            groups += sweep()
        except Exception as e:  # report and go on: the run is one-shot
            log(f"{part}: sweep failed: {type(e).__name__}: {e}")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    meta = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": bw / 1e9,
        "wall_s": time.monotonic() - t_start,
        "smoke": opts.smoke,
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "tune.json").write_text(
        json.dumps({"meta": meta, "profile": profiles, "sweep": [asdict(g) for g in groups]}, indent=1)
    )
    md = markdown(meta, profiles, groups)
    (opts.out / "tune.md").write_text(md)

    log(
        f"\n## Summary ({meta['wall_s']:.0f} s; SOL at {bw / 1e9:.0f} GB/s). Default vs best variant, GPU time:"
    )
    for g in groups:
        log(group_line(g))
    log(f"\nwrote {opts.out / 'tune.json'} and {opts.out / 'tune.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
