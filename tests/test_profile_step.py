"""scripts/profile_step.py: GPU kernel time per step by category, per provider.

CPU: the kernel-name categories on names the H200 profiles recorded; the busy time (union of
kernel intervals) against a brute-force count on a grid; a report built from hand-made kernels,
with every number worked out by hand; real runs of the quickstart shrunk to a tiny model (one
process per provider, and a 2-process gloo DDP run) that record no CUDA kernel and say so; the
option checks. GPU: eager and ligertune on one GPU record matmuls, and only ligertune fused
Triton kernels; a 2-GPU FSDP run reports NCCL communication from rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import subprocess

import numpy as np
import pytest
import torch

from scripts import profile_step
from scripts.profile_step import NCCL, TRITON, Kernel, category, covered_us
from tests.helpers import QUICKSTART, TINY_MODEL, assert_refused_before_writing, run_repo_script

MATMUL = "matmul (cuBLAS/CUTLASS)"
ATTENTION = "attention (SDPA, flash, flex)"
OPTIMIZER = "optimizer (AdamW foreach)"
COPIES = "copies and fills"
ELEMENTWISE = "PyTorch elementwise / reductions"
# Two recorded steps: the shortest schedule (no wait, the warm-up step, one active step).
SHORT = ["--wait", "0", "--active", "1"]
TINY_RUN = [*TINY_MODEL, "data.validation_fraction=0"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    return run_repo_script("scripts/profile_step.py", *args)


def records(run_dir, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


# --------------------------------------------------------------------------------------------
# Categories, busy time and the report, on names and intervals made here
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        # Names as the H200 profiles of docs/data/h200-profile-1b recorded them (truncated there).
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", MATMUL),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_splitK_NNT", MATMUL),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1",
            ATTENTION,
        ),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1",
            ATTENTION,
        ),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymou...",
            OPTIMIZER,
        ),
        (
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Te...",
            COPIES,
        ),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::BFloat...",
            ELEMENTWISE,
        ),
        (
            "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at...",
            ELEMENTWISE,
        ),
        # Triton kernels: ours (every @triton.jit kernel of kernels/) and Liger's, by function name.
        ("_gated_bwd_kernel", TRITON),
        ("_gated_fwd_kernel", TRITON),
        ("_row_norm_fwd_kernel", TRITON),
        ("_row_norm_bwd_kernel", TRITON),
        ("_rope_kernel", TRITON),
        ("_cross_entropy_kernel", TRITON),
        ("_scale_rows_kernel", TRITON),
        ("_swiglu_backward_kernel", TRITON),
        ("_rms_norm_backward_kernel", TRITON),
        # NCCL, including collectives whose names hold other categories' fragments ("reduce", "cat").
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", NCCL),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", NCCL),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", NCCL),
        # A C++ signature of no known family is not taken for a Triton kernel.
        ("void at::cuda::detail::philox_offsets_kernel<float>(float*, long)", "other"),
    ],
)
def test_category_of_recorded_kernel_names(name, expected):
    assert category(name) == expected


def test_busy_time_is_the_union_of_the_kernel_intervals():
    """Against a brute-force count of the covered microseconds, on random integer intervals
    (overlapping, nested, touching, empty)."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        starts = rng.integers(0, 200, n)
        ends = starts + rng.integers(0, 50, n)
        spans = list(zip(starts.tolist(), ends.tolist(), strict=True))
        grid = np.zeros(250, dtype=bool)
        for s, e in spans:
            grid[s:e] = True
        kernels = [Kernel("k", float(s), float(e)) for s, e in spans]
        assert covered_us(kernels) == grid.sum(), f"seed {seed}"


def test_report_of_overlapping_compute_and_communication():
    """Two recorded steps; a matmul (two launches back to back, 0-4 ms), an all-gather that
    overlaps its last millisecond (3-6 ms) and a Triton kernel after a gap (7-8 ms).
    Per step: kernel time (4 + 3 + 1) / 2 = 4.0 ms; busy (6 + 1) / 2 = 3.5 ms, 32% of the
    11 ms median step; NCCL 1.5 ms, of which (5-6 ms alone) 2 / 2 = 1.0 ms exposed."""
    gather = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    kernels = [
        Kernel("nvjet_sm90_a", 0, 2000),
        Kernel("nvjet_sm90_a", 2000, 4000),
        Kernel(gather, 3000, 6000),
        Kernel("_gated_fwd_kernel", 7000, 8000),
    ]
    text = profile_step.report("eager (rank 0 of 4)", "x.yaml a=1", kernels, [0.012, 0.010, 0.011], 3, 2)
    assert text.splitlines()[:4] == [
        "## eager (rank 0 of 4): x.yaml a=1",
        "",
        "median step 11.0 ms wall; GPU busy 3.5 ms per step (32% busy), kernel time 4.0 ms; "
        "2 recorded steps after 4",
        "communication (NCCL) 1.5 ms per step, 1.0 ms of it exposed (no other kernel running)",
    ]
    assert f"| {MATMUL} | 2.0 | 50.0% |\n| {NCCL} | 1.5 | 37.5% |\n| {TRITON} | 0.5 | 12.5% |" in text
    assert f"| `nvjet_sm90_a` | {MATMUL} | 2.00 |" in text
    assert f"| `{gather}` | {NCCL} | 1.50 |" in text


def test_report_without_communication_has_no_communication_line():
    text = profile_step.report("ligertune", "x.yaml", [Kernel("_rope_kernel", 0, 500)], [0.001], 0, 1)
    assert "median step 1.0 ms wall; GPU busy 0.5 ms per step (50% busy), kernel time 0.5 ms;" in text
    assert "NCCL" not in text


# --------------------------------------------------------------------------------------------
# Real runs on the CPU: nothing recorded, and the report says so
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cpu_run_of_two_providers_writes_a_report_each(tmp_path):
    proc = run_script(
        str(QUICKSTART), *TINY_RUN, "--providers", "eager,ligertune", *SHORT, "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.glob("*.md")) == ["eager.md", "ligertune.md"]
    for provider in ("eager", "ligertune"):
        text = (tmp_path / f"{provider}.md").read_text()
        assert text == f"## {provider}: no CUDA kernel was recorded (a CPU run profiles nothing here)\n"
        # The provider's own run: wait + warm-up + active = 2 steps.
        assert records(tmp_path / provider, "summary")[0]["steps"] == 2
    # eager patches nothing; ligertune patches the model with its kernels.
    assert records(tmp_path / "eager", "start")[0]["kernels_patched"] == {}
    assert records(tmp_path / "ligertune", "start")[0]["kernels_patched"]
    assert re.search(r"\[eager\] exit 0 in \d+ s", proc.stdout)
    assert re.search(r"\[ligertune\] exit 0 in \d+ s", proc.stdout)


@pytest.mark.slow
def test_two_process_gloo_run_writes_one_report_from_rank_0(tmp_path):
    proc = run_script(
        str(QUICKSTART), *TINY_RUN, "parallel.strategy=ddp", "training.device=cpu", "--providers", "eager",
        *SHORT, "--nproc-per-node", "2", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in tmp_path.glob("*.md")] == ["eager.md"]
    expected = "## eager (rank 0 of 2): no CUDA kernel was recorded (a CPU run profiles nothing here)"
    assert (tmp_path / "eager.md").read_text() == expected + "\n"
    assert proc.stdout.count("no CUDA kernel was recorded") == 1  # rank 1 neither writes nor prints
    start = records(tmp_path / "eager", "start")[0]
    assert (start["world_size"], start["strategy"]) == (2, "ddp")


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--providers", "eager,ligertun"],
            "unknown providers ['ligertun']; choose from ligertune, liger, eager",
        ),
        (["--providers", ","], "--providers names none"),
        (["--active", "0"], "--active ≥ 1, got --wait 3 --active 0"),
        (["--wait", "-1"], "--wait must be ≥ 0"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1, got 0"),
        (
            ["--nproc-per-node", "2"],
            "--nproc-per-node 2 needs a multi-process strategy, but the recipe's parallel.strategy is none: "
            "add parallel.strategy=fsdp",
        ),
        (["kernels.rope=false"], "kernels.rope=false: the script sets kernels for each provider"),
        (["training.max_steps=5"], "the script sets training.max_steps"),
        (["training.lr=fast"], "training.lr"),  # the recipe's own check
    ],
)
def test_bad_options_exit_with_an_argparse_error(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert_refused_before_writing(
        profile_step.main, [str(QUICKSTART), *args, "--out", str(out)], out, message, capsys
    )


def test_liger_provider_needs_liger_kernel(tmp_path, capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main([str(QUICKSTART), "--providers", "eager,liger", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "the liger provider needs liger-kernel" in capsys.readouterr().err


def test_refuses_to_run_inside_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        profile_step.main([str(QUICKSTART), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert (
        "launches torchrun itself: run it as one process with --nproc-per-node G" in capsys.readouterr().err
    )


# --------------------------------------------------------------------------------------------
# GPU (H200)
# --------------------------------------------------------------------------------------------

# A model big enough that the GPU is busy for a measurable part of a step.
GPU_RUN = [
    "model.config_overrides={hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: 4, "
    "num_attention_heads: 8, num_key_value_heads: 4}",
    "training.device=cuda", "training.precision=bf16-mixed", "training.micro_batch_size=8",
    "data.validation_fraction=0",
]  # fmt: skip


def categories(text: str) -> dict[str, float]:
    """The category table of a report: label → ms per step."""
    rows = re.findall(r"^\| ([^|`]+) \| ([\d.]+) \| [\d.]+% \|$", text, flags=re.M)
    return {label: float(ms) for label, ms in rows}


@pytest.mark.gpu
def test_gpu_profiles_matmuls_and_only_ligertune_runs_triton_kernels(tmp_path):
    proc = run_script(str(QUICKSTART), *GPU_RUN, "--providers", "eager,ligertune", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {}
    for provider in ("eager", "ligertune"):
        text = (tmp_path / f"{provider}.md").read_text()
        busy = re.search(r"GPU busy ([\d.]+) ms per step \((\d+)% busy\)", text)
        assert busy and float(busy[1]) > 0 and int(busy[2]) > 0, text
        found[provider] = categories(text)
        assert found[provider].get(MATMUL, 0) > 0, text
    assert TRITON in found["ligertune"] and TRITON not in found["eager"], found


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (kind nvidia-h200-x2 or larger)")
def test_gpu_fsdp_on_two_gpus_reports_nccl_from_rank_0(tmp_path):
    proc = run_script(
        str(QUICKSTART), *GPU_RUN, "parallel.strategy=fsdp", "--providers", "ligertune",
        "--nproc-per-node", "2", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in tmp_path.glob("*.md")] == ["ligertune.md"]
    text = (tmp_path / "ligertune.md").read_text()
    assert text.startswith("## ligertune (rank 0 of 2): quickstart.yaml ")
    assert categories(text).get(NCCL, 0) > 0, text
    comm = re.search(r"communication \(NCCL\) ([\d.]+) ms per step, ([\d.]+) ms of it exposed", text)
    assert comm and 0 <= float(comm[2]) <= float(comm[1]), text
