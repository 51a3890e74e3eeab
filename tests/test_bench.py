"""`ligertune bench`: the byte/FLOP table, the measurement rules, failure handling, and the whole
command path (JSON, CSV, Markdown, PNGs) on CPU; real sizes and memory accounting on a GPU."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ligertune.cli import app
from ligertune.tools.bench.cases import (
    PASSES,
    SPECS,
    Inputs,
    KernelSpec,
    ProviderUnavailable,
    minimal_bytes,
    minimal_flops,
)
from ligertune.tools.bench.report import write_outputs
from ligertune.tools.bench.results import FILES, MISMATCH_TOL, BenchError, Row
from ligertune.tools.bench.run import (
    BenchOptions,
    RunContext,
    derive_metrics,
    parse_list,
    parse_shapes,
    plan_cases,
    run,
    run_cases,
)
from ligertune.tools.bench.timing import Timer, new_storage_bytes

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KERNEL_MODULES = {
    "rms_norm": "rms_norm",
    "add_rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "rope": "rope",
    "swiglu": "swiglu",
    "geglu": "swiglu",
    "cross_entropy": "cross_entropy",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy",
    "moe_experts": "moe",
    "vision_attention": None,  # ours is FlexAttention (ligertune.models.attention), no kernels/ module
}


# ---------------------------------------------------------------------------------------------
# Minimal bytes and FLOPs, recounted from the tensors an eager call actually reads and writes
# ---------------------------------------------------------------------------------------------

# For each kernel: the tensors the backward reads besides the upstream gradients ("out1" is the
# forward's second output), and the inputs whose gradients it writes. add_rms_norm writes one
# gradient for x and residual (they are equal: checked below).
BWD_READS_WRITES = {
    "rms_norm": (("x", "weight"), ("x", "weight")),
    "add_rms_norm": (("out1", "weight"), ("x", "weight")),
    "layer_norm": (("x", "weight"), ("x", "weight", "bias")),
    "rope": (("cos", "sin"), ("q", "k")),
    "swiglu": (("gate", "up"), ("gate", "up")),
    "geglu": (("gate", "up"), ("gate", "up")),
    "cross_entropy": (("logits", "target"), ("logits",)),
    "fused_linear_cross_entropy": (("hidden", "weight", "target"), ("hidden", "weight")),
    "vision_attention": (("q", "k", "v", "out0", "cu_seqlens"), ("q", "k", "v")),
    "moe_experts": (
        ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj"),
        ("hidden", "top_k_weights", "gate_up_proj", "down_proj"),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", sorted(SPECS))
def test_minimal_bytes_match_the_tensors_an_eager_call_touches(kernel, dtype):
    spec = SPECS[kernel]
    shape = spec.cpu_shapes[-1]
    inputs = spec.make_inputs(shape, dtype, torch.device("cpu"))
    outs = spec.eager(inputs)(*inputs.args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    wrt = {k: t for k, t in inputs.tensors.items() if t.requires_grad}
    grads = dict(zip(wrt, torch.autograd.grad(outs, tuple(wrt.values()), inputs.grad_outputs), strict=True))
    named = {**inputs.tensors, **{f"out{i}": o for i, o in enumerate(outs)}}
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731

    fwd = nbytes(inputs.tensors.values()) + nbytes(outs)
    upstream = nbytes(inputs.grad_outputs) if inputs.grad_outputs else 4  # a loss's dloss: fp32 scalar
    reads, writes = BWD_READS_WRITES[kernel]
    bwd = upstream + nbytes(named[n] for n in reads) + nbytes(grads[n] for n in writes)
    if spec.loss:
        full = nbytes(inputs.tensors.values()) + nbytes(outs) + nbytes(grads[n] for n in writes)
    else:
        full = fwd + bwd
    if kernel == "add_rms_norm":
        assert torch.equal(grads["x"], grads["residual"]), "dr must equal dx for one write to serve both"
    assert minimal_bytes(kernel, shape, dtype) == {"fwd": fwd, "bwd": bwd, "full": full}


@pytest.mark.parametrize(
    "kernel, shape",
    [
        ("fused_linear_cross_entropy", (24, 40, 136)),
        ("moe_experts", (24, 40, 5, 2, 24)),
        ("vision_attention", (3, 40, 16, 2, 8)),
    ],
)
def test_flops_match_torch_flop_counter(kernel, shape):
    """The FLOP floors against torch's count of HF's eager computation (the MoE experts' per-expert
    loop: its matmuls over the routed rows only)."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = SPECS[kernel]
    inputs = spec.make_inputs(shape, torch.float32, torch.device("cpu"))
    fn = spec.eager(inputs)
    with FlopCounterMode(display=False) as fwd_counter:
        out = fn(*inputs.args)
    with FlopCounterMode(display=False) as bwd_counter:
        torch.autograd.grad(out, inputs.differentiable, inputs.grad_outputs)
    expected = minimal_flops(kernel, shape)
    assert fwd_counter.get_total_flops() == expected["fwd"]
    assert bwd_counter.get_total_flops() == expected["bwd"]
    assert expected["full"] == expected["fwd"] + expected["bwd"]
    assert minimal_flops("rms_norm", (16, 96)) == dict.fromkeys(PASSES, 0)


# ---------------------------------------------------------------------------------------------
# Measurement rules
# ---------------------------------------------------------------------------------------------


def test_cpu_timer_times_only_the_timed_part():
    timer = Timer(torch.device("cpu"), warmup_ms=0, rep_ms=1)
    assert 9.5 <= timer(lambda: time.sleep(0.010)) < 30
    # setup sleeps 30 ms before every repetition; only fn's 10 ms may be counted
    assert 9.5 <= timer.after(lambda: time.sleep(0.030), lambda _: time.sleep(0.010)) < 30


def test_new_storage_bytes_counts_each_new_storage_once():
    x = torch.randn(64)
    grad_in_place = x.view(8, 8)  # a gradient written into the input's own storage
    fresh = torch.randn(32)
    assert (
        new_storage_bytes([grad_in_place, fresh, fresh[:4], None], {x.untyped_storage().data_ptr()}) == 32 * 4
    )


def _row(
    provider,
    ms,
    pass_="full",
    kernel="fused_linear_cross_entropy",
    status="ok",
    bytes_=4_000_000_000,
    flops=0,
):
    return Row(kernel, "1x2x3", "bf16", pass_, provider, status, ms=ms, bytes=bytes_, flops=flops)


def test_derived_metrics_by_hand():
    rows = [
        _row("eager", 8.0),
        _row("ligertune", 2.0),
        _row("liger", 4.0, flops=3_600_000_000_000),  # compute-bound: 3.6e12 / 600e12 = 6 ms of SOL
        _row("compile", None, status="oom"),
        _row("ligertune", 1.0, pass_="fwd"),  # no eager row for fwd: no speed-up
    ]
    derive_metrics(rows, copy_gbps=4000.0, matmul_tflops=600.0)
    eager, ours, liger, failed, fwd = rows
    assert ours.gbps == pytest.approx(2000.0)  # 4 GB in 2 ms
    assert ours.pct_sol == pytest.approx(50.0)  # 1 ms at 4 TB/s, took 2 ms
    assert ours.speedup_vs_eager == pytest.approx(4.0)
    assert ours.tflops is None
    assert liger.tflops == pytest.approx(900.0)
    assert liger.pct_sol == pytest.approx(150.0)  # the FLOP bound (6 ms) wins over the byte bound
    assert eager.speedup_vs_eager == pytest.approx(1.0)
    assert failed.gbps is None and failed.pct_sol is None and failed.speedup_vs_eager is None
    assert fwd.speedup_vs_eager is None and fwd.pct_sol == pytest.approx(100.0)


def _toy_spec(eager, liger, ligertune) -> KernelSpec:
    def make_inputs(shape, dtype, device):
        x = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
        return Inputs({"x": x}, (torch.randn(*shape, dtype=dtype, device=device),))

    return KernelSpec(
        "toy", ("rows", "cols"), ((8, 16),), ((8, 16),), ((8, 16),), make_inputs, eager, liger, ligertune
    )


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward exploded")


def _oom(x):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")


def _unavailable(inputs):
    raise ProviderUnavailable("not on this machine")


def _ctx(deadline=None) -> RunContext:
    return RunContext(
        torch.device("cpu"),
        torch.float32,
        PASSES,
        Timer(torch.device("cpu"), 0, 1),
        deadline,
        log=lambda _: None,
    )


def test_failing_providers_become_rows_and_the_run_goes_on():
    spec = _toy_spec(
        eager=lambda inp: lambda x: x * 2,
        liger=lambda inp: _FailsInBackward.apply,
        ligertune=lambda inp: _oom,
    )
    spec_unavailable = _toy_spec(lambda inp: lambda x: x * 2, _unavailable, lambda inp: lambda x: x * 2)
    rows = run_cases([(spec, (8, 16)), (spec_unavailable, (8, 16))], ("eager", "liger", "ligertune"), _ctx())
    status = {(r.provider, r.pass_, r.shape, id(r)): r for r in rows}
    assert len(rows) == 2 * 3 * 3
    first, second = rows[:9], rows[9:]
    by = {(r.provider, r.pass_): r for r in first}
    assert all(by["eager", p].status == "ok" and by["eager", p].ms > 0 for p in PASSES)
    # the liger stand-in fails in its warm-up backward: every pass of it is an error
    assert {by["liger", p].status for p in PASSES} == {"error"}
    assert "backward exploded" in by["liger", "fwd"].note
    assert {by["ligertune", p].status for p in PASSES} == {"oom"}
    assert "out of memory" in by["ligertune", "bwd"].note
    by2 = {(r.provider, r.pass_): r for r in second}
    assert {by2["liger", p].status for p in PASSES} == {"unavailable"}
    assert by2["liger", "full"].note == "not on this machine"
    assert all(by2["ligertune", p].status == "ok" for p in PASSES)
    assert status  # rows are hashable records, not shared objects


def test_inputs_that_cannot_be_made_fail_every_provider_of_that_case_only():
    def too_big(shape, dtype, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 900 GiB")

    ok = _toy_spec(lambda inp: lambda x: x * 2, _unavailable, lambda inp: lambda x: x * 2)
    huge = dataclasses.replace(ok, make_inputs=too_big)
    rows = run_cases([(huge, (8, 16)), (ok, (8, 16))], ("eager", "ligertune"), _ctx())
    assert [r.status for r in rows[:6]] == ["oom"] * 6
    assert rows[0].note.startswith("making the inputs: OutOfMemoryError")
    assert [r.status for r in rows[6:]] == ["ok"] * 6


def test_a_wrong_provider_is_flagged_against_eager():
    spec = _toy_spec(lambda inp: lambda x: x * 2, _unavailable, lambda inp: lambda x: x * 2 + 0.5)
    rows = run_cases([(spec, (8, 16))], ("eager", "ligertune"), _ctx())
    ours = [r for r in rows if r.provider == "ligertune"]
    assert all(r.status == "ok" and r.note.startswith("MISMATCH vs eager") for r in ours)
    assert all(r.rel_err_vs_eager > MISMATCH_TOL[torch.float32] for r in ours)
    assert all(r.note == "" for r in rows if r.provider == "eager")


def test_time_budget_skips_the_remaining_providers():
    spec = _toy_spec(lambda inp: lambda x: x * 2, _unavailable, lambda inp: lambda x: x * 2)
    rows = run_cases([(spec, (8, 16))], ("eager", "ligertune"), _ctx(deadline=time.monotonic() - 1))
    assert [r.status for r in rows] == ["skipped"] * 6
    assert rows[0].note == "time budget spent"


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def test_option_parsing_errors_name_the_problem_and_the_choices():
    with pytest.raises(BenchError, match=r"unknown kernel 'rmsnorm'; choose from rms_norm, add_rms_norm"):
        parse_list("rms_norm,rmsnorm", SPECS, "kernel")
    with pytest.raises(BenchError, match="unknown pass 'forward'; choose from fwd, bwd, full"):
        parse_list("forward", PASSES, "pass")
    with pytest.raises(BenchError, match=r"a rope shape is BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM \(5 positive"):
        parse_shapes(["rope=8x2048"], ("rope",))
    with pytest.raises(BenchError, match="got '0x4096'"):
        parse_shapes(["rms_norm=16x96,0x4096"], ("rms_norm",))
    with pytest.raises(BenchError, match="expected KERNEL=SHAPE"):
        parse_shapes(["16384x4096"], ("rms_norm",))
    with pytest.raises(BenchError, match="kernel 'cross_entropy' is not among --kernels"):
        parse_shapes(["cross_entropy=8x32000"], ("rms_norm",))


def test_names_overrides_and_case_order():
    flce, ce = "fused_linear_cross_entropy", "cross_entropy"
    kernels = parse_list(f"{flce},rms_norm,{ce},{flce}", SPECS, "kernel")
    assert kernels == (flce, "rms_norm", ce)
    overrides = parse_shapes(["rms_norm=4x8,2x16", f"{flce}=2x4x8"], kernels)
    assert overrides == {"rms_norm": [(4, 8), (2, 16)], flce: [(2, 4, 8)]}
    cases = [(spec.name, shape) for spec, shape in plan_cases(kernels, overrides, "full")]
    # every kernel's headline shape (its --quick one, or the first given) comes first, so a time
    # budget drops sizes before kernels
    assert cases == [
        (flce, (2, 4, 8)),
        ("rms_norm", (4, 8)),
        (ce, (8192, 128256)),
        ("rms_norm", (2, 16)),
        (ce, (8192, 32000)),
        (ce, (8192, 256000)),
    ]
    quick = [(spec.name, shape) for spec, shape in plan_cases(("rope", "swiglu"), {}, "quick")]
    assert quick == [("rope", SPECS["rope"].quick_shapes[0]), ("swiglu", SPECS["swiglu"].quick_shapes[0])]


def test_cli_rejects_bad_options_with_exit_2():
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--kernels", "rms_norm", "--providers", "eager,triton"])
    assert result.exit_code == 2
    assert "unknown provider 'triton'; choose from eager, compile, liger, ligertune" in result.output
    result = runner.invoke(app, ["bench", "--kernels", "rms_norm", "--dtype", "int8"])
    assert result.exit_code == 2 and "unknown --dtype 'int8'; choose from bf16, fp16, fp32" in result.output


# ---------------------------------------------------------------------------------------------
# The whole command on CPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    t0 = time.process_time()  # CPU seconds: the 2 cores are shared, wall time depends on neighbours
    result = CliRunner().invoke(app, ["bench", "--out", str(out)])
    return out, result, time.process_time() - t0


@pytest.mark.slow
def test_cli_on_cpu_writes_every_file(cpu_run):
    out, result, cpu_seconds = cpu_run
    assert result.exit_code == 0, result.output
    assert cpu_seconds < 60
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    for name in FILES[3:]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    assert "CPU — not meaningful" in result.output


def test_cli_on_cpu_json_rows_cover_every_case(cpu_run):
    out, result, _ = cpu_run
    data = json.loads((out / "bench.json").read_text())
    assert data["schema"] == "ligertune-bench/1"
    assert data["timing"] == "CPU — not meaningful"
    assert data["providers"] == ["eager", "ligertune"] and data["dtype"] == "fp32"
    assert data["command"].startswith("ligertune bench --kernels rms_norm,add_rms_norm")
    rows = data["rows"]
    expected = {(k, "x".join(map(str, s)), p, prov) for k, spec in SPECS.items() for s in spec.cpu_shapes
                for p in PASSES for prov in ("eager", "ligertune")}  # fmt: skip
    assert {(r["kernel"], r["shape"], r["pass"], r["provider"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        shape = tuple(int(d) for d in r["shape"].split("x"))
        assert r["bytes"] == minimal_bytes(r["kernel"], shape, torch.float32)[r["pass"]]
        module = KERNEL_MODULES[r["kernel"]]
        ours_importable = (
            module is None or importlib.util.find_spec(f"ligertune.kernels.{module}") is not None
        )
        expected_status = "ok" if r["provider"] == "eager" or ours_importable else "unavailable"
        assert r["status"] == expected_status, r
        if r["status"] != "ok":
            continue
        assert r["ms"] > 0 and r["peak_extra_mib"] is None  # memory is measured on CUDA only
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        assert r["speedup_vs_eager"] is not None
        if r["provider"] == "ligertune":  # the bench wires our kernels to the same math as eager
            assert r["rel_err_vs_eager"] <= MISMATCH_TOL[torch.float32], r
            assert not r["note"], r


def test_cli_on_cpu_csv_and_markdown_agree_with_json(cpu_run):
    out, _, _ = cpu_run
    rows = json.loads((out / "bench.json").read_text())["rows"]
    with (out / "bench.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert [(t["kernel"], t["shape"], t["pass"], t["provider"], t["status"]) for t in table] == [
        (r["kernel"], r["shape"], r["pass"], r["provider"], r["status"]) for r in rows
    ]
    assert all(float(t["ms"]) == r["ms"] for t, r in zip(table, rows, strict=True) if r["ms"] is not None)
    md = (out / "bench.md").read_text()
    assert "| kernel | shape | pass | eager | ligertune | ours % SOL |" in md
    assert sum(line.startswith("| rms_norm | 16x96 |") for line in md.splitlines()) == len(PASSES)


def test_from_json_rerenders_without_measuring(cpu_run, tmp_path):
    out, _, _ = cpu_run
    result = CliRunner().invoke(
        app, ["bench", "--from-json", str(out / "bench.json"), "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads((out / "bench.json").read_text())
    assert all((tmp_path / name).read_bytes()[:8] == PNG_MAGIC for name in FILES[3:])


def test_from_json_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"rows": []}')
    result = CliRunner().invoke(app, ["bench", "--from-json", str(path), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "not a ligertune-bench/1 file" in result.output


def test_wrapper_script_and_gpu_check_script():
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_text.returncode == 0, help_text.stderr
    assert "Examples" in help_text.stdout and "--from-json" in help_text.stdout
    syntax = subprocess.run(
        ["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert syntax.returncode == 0, syntax.stderr


# ---------------------------------------------------------------------------------------------
# GPU (H200): every provider at small real sizes, memory accounting, timer and rates
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [
    "rms_norm=512x2048",
    "add_rms_norm=512x2048",
    "layer_norm=512x2048",
    "rope=2x256x8x2x128",
    "swiglu=512x4096",
    "geglu=512x4096",
    "cross_entropy=512x32000",
    "fused_linear_cross_entropy=512x1024x32000",
]


@pytest.mark.gpu
def test_gpu_every_provider_runs_and_matches_eager(tmp_path):
    # torch.compile is left to the benchmark run itself (its compile time would double this test's)
    opts = BenchOptions(
        providers="eager,liger,ligertune", shapes=GPU_SHAPES, warmup_ms=2, rep_ms=10, out=tmp_path
    )
    result = run(opts, log=lambda _: None)
    liger_importable = importlib.util.find_spec("liger_kernel") is not None
    for r in result.rows:
        expected = "ok" if r.provider != "liger" or liger_importable else "unavailable"
        assert r.status == expected, r
        if r.status != "ok":
            continue
        assert r.ms > 0 and r.peak_extra_mib is not None and r.peak_extra_mib > -1, r
        assert r.pct_sol is not None and r.pct_sol > 0, r
        if r.provider != "eager":
            assert r.rel_err_vs_eager <= MISMATCH_TOL[torch.bfloat16], r
    written = write_outputs(result, tmp_path)
    assert [p.name for p in written][:3] == list(FILES[:3])


@pytest.mark.gpu
def test_gpu_peak_extra_memory_accounting():
    mib = 2**20

    def with_scratch(x):
        scratch = torch.empty(64 * mib, dtype=torch.uint8, device=x.device)  # freed before returning
        out = x * 2  # saves nothing for the backward
        del scratch
        return out

    spec = _toy_spec(lambda inp: with_scratch, _unavailable, lambda inp: lambda x: x * 2)
    device = torch.device("cuda")
    ctx = RunContext(device, torch.float32, PASSES, Timer(device, 1, 5), log=lambda _: None)
    rows = {r.pass_: r for r in run_cases([(spec, (1024, 1024))], ("eager",), ctx)}  # x: 4 MiB fp32
    # fwd: scratch (64) and out (4) live together. bwd: only dx (4), the gradient's own storage,
    # which is subtracted. full: the forward's peak (68) minus dx's storage (4).
    assert rows["fwd"].peak_extra_mib == pytest.approx(68, abs=0.5)
    assert rows["bwd"].peak_extra_mib == pytest.approx(0, abs=0.5)
    assert rows["full"].peak_extra_mib == pytest.approx(64, abs=0.5)


class _GradInForward(torch.autograd.Function):
    """loss = sum(2x) with its gradient computed in the forward, as fused losses do."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.full_like(x, 2.0))
        return x.sum() * 2  # no x-sized temporary

    @staticmethod
    def backward(ctx, grad):
        (dx,) = ctx.saved_tensors
        return dx  # handed over, not allocated (grad is 1 here)


@pytest.mark.gpu
def test_gpu_gradients_made_in_the_forward_cost_the_backward_nothing():
    spec = dataclasses.replace(
        _toy_spec(lambda inp: _GradInForward.apply, _unavailable, _unavailable),
        make_inputs=lambda shape, dtype, device: Inputs(
            {"x": torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)}
        ),
        loss=True,
    )
    device = torch.device("cuda")
    ctx = RunContext(device, torch.float32, PASSES, Timer(device, 1, 5), log=lambda _: None)
    rows = {r.pass_: r for r in run_cases([(spec, (1024, 1024))], ("eager",), ctx)}
    # fwd keeps dx (4 MiB) for the backward; the backward allocates nothing new: 0, not -4
    assert rows["fwd"].peak_extra_mib == pytest.approx(4, abs=0.5)
    assert rows["bwd"].peak_extra_mib == pytest.approx(0, abs=0.5)
    assert rows["full"].peak_extra_mib == pytest.approx(0, abs=0.5)


@pytest.mark.gpu
def test_gpu_backward_timer_excludes_the_setup():
    timer = Timer(torch.device("cuda"), warmup_ms=5, rep_ms=50)
    cycles = 2_000_000
    alone = timer(lambda: torch.cuda._sleep(cycles))
    after = timer.after(lambda: torch.cuda._sleep(5 * cycles), lambda _: torch.cuda._sleep(cycles))
    assert after == pytest.approx(alone, rel=0.2)


@pytest.mark.gpu
def test_gpu_reference_rates_are_plausible():
    from ligertune.tools.bench.timing import measure_rates

    rates = measure_rates(torch.device("cuda"), Timer(torch.device("cuda"), 5, 50))
    assert 200 < rates["copy_gbps"] < 20_000
    assert 20 < rates["matmul_tflops"] < 5_000
