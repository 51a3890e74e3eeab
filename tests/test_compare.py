"""`ligertune compare`: arms, verdicts, reports.

The fast tests check the planning, the verdict rule and the rendering on hand-made arm results;
the end-to-end tests run real arms (each a subprocess training the quickstart for a few steps)
with faults from tests/compare_faults.py applied as recipe plugins.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from ligertune.config import RecipeError, load_recipe
from ligertune.distributed.env import child_environment
from ligertune.tools.compare import CompareError, compare_command, make_plan
from ligertune.tools.compare import report as render
from ligertune.tools.compare.runner import arm_command, merge_rank_results, run_arm_process
from ligertune.tools.compare.verdict import build_report, compare_arms, loss_verdict
from tests.compare_faults import plugin
from tests.helpers import QUICKSTART, ROOT, TINY_MODEL, pythonpath_with_root

# The quickstart, shrunk so that an arm trains in seconds under the Triton interpreter.
SMALL = [
    *TINY_MODEL,
    "data.validation_fraction=0.0",
    "training.micro_batch_size=2",
    "training.warmup_steps=1",
    "logging.throughput_warmup_steps=1",
    "logging.log_every=1",
]
# rope is left out of the end-to-end runs: under the interpreter it alone takes ~10 s a step.
FAST_KERNELS = "rms_norm,swiglu,fused_linear_cross_entropy"

TOP_KEYS = {
    "schema", "recipe", "overrides", "steps", "world_size", "precision", "kernels", "ablate", "device",
    "device_name", "kernel_mode", "speed_meaningful", "tolerance", "arms", "comparisons", "verdict", "notes",
    "out_dir", "files",
}  # fmt: skip
ARM_KEYS = {
    "name", "kernels", "status", "error", "steps_completed", "losses", "wall_s", "device", "device_name",
    "kernel_mode", "world_size", "step_time_median_s", "tokens_per_s", "tokens_per_s_per_gpu",
    "label_tokens_per_s", "mfu", "peak_mem_allocated_gib", "peak_mem_reserved_gib", "peak_host_rss_gib",
    "ranks_reported", "log",
}  # fmt: skip
COMPARISON_KEYS = {
    "arm", "baseline", "speedup", "memory_ratio_allocated", "memory_ratio_reserved", "steps_compared",
    "max_abs_loss_diff", "max_rel_loss_diff", "max_rel_loss_diff_step", "verdict", "summary",
}  # fmt: skip
VERDICT_KEYS = {"status", "parity", "step", "baseline_loss", "arm_loss", "message"}


def quiet_console() -> Console:
    return Console(file=io.StringIO(), width=160)


# --------------------------------------------------------------------------------------------
# The verdict rule, on hand-made losses
# --------------------------------------------------------------------------------------------


def arm(name: str, losses: list[float | None], status: str = "ok", **extra) -> dict:
    fields = dict.fromkeys(ARM_KEYS - {"name", "losses", "status", "kernels"})
    fields |= {"steps_completed": len(losses), "error": None}
    return {**fields, "name": name, "kernels": [], "losses": losses, "status": status, **extra}


def test_parity_within_tolerance_and_largest_difference_reported():
    base = arm("off", [3.0, 2.5, 2.0])
    other = arm("on", [3.0, 2.5 * (1 + 5e-5), 2.0 * (1 - 9e-5)])
    result = loss_verdict(base, other, steps=3, rtol=1e-4)
    assert result["verdict"]["status"] == "parity" and result["verdict"]["parity"] is True
    assert result["max_rel_loss_diff"] == pytest.approx(9e-5, rel=1e-6)
    assert result["max_rel_loss_diff_step"] == 3
    assert result["max_abs_loss_diff"] == pytest.approx(2.0 * 9e-5, rel=1e-6)


def test_first_step_beyond_tolerance_is_the_divergence_with_both_values():
    base = arm("off", [3.0, 2.5, 2.0, 1.5])
    other = arm("on", [3.0, 2.5 * (1 + 5e-5), 2.0 * (1 + 3e-4), 1.0])
    verdict = loss_verdict(base, other, steps=4, rtol=1e-4)["verdict"]
    assert (verdict["status"], verdict["step"]) == ("diverged", 3)
    assert (verdict["baseline_loss"], verdict["arm_loss"]) == (2.0, 2.0 * (1 + 3e-4))
    assert "diverged at step 3" in verdict["message"] and "off 2," in verdict["message"]
    # The same losses pass a looser (bf16-like) tolerance until the real break at step 4.
    assert loss_verdict(base, other, steps=4, rtol=2e-2)["verdict"]["step"] == 4


def test_non_finite_in_one_arm_diverges_and_in_both_agrees():
    base = arm("off", [3.0, None, 2.0], status="nonfinite")
    assert loss_verdict(base, arm("on", [3.0, None, 2.0], status="nonfinite"), 3, 1e-4)["verdict"]["parity"]
    verdict = loss_verdict(base, arm("on", [3.0, 2.9, 2.0]), 3, 1e-4)["verdict"]
    assert (verdict["status"], verdict["step"], verdict["baseline_loss"]) == ("diverged", 2, None)
    assert "non-finite" in verdict["message"]


def test_an_arm_that_stopped_early_gives_no_verdict_but_the_steps_both_ran_are_compared():
    base = arm("off", [3.0, 2.5], status="oom")
    result = loss_verdict(base, arm("on", [3.0, 2.5, 2.1, 1.9]), steps=4, rtol=1e-4)
    assert result["verdict"]["status"] == "incomplete" and result["verdict"]["parity"] is False
    assert result["steps_compared"] == 2
    assert "off ran out of memory at step 3" in result["verdict"]["message"]
    # A divergence seen before the failure is still a divergence.
    early = loss_verdict(base, arm("on", [3.3, 2.5, 2.1, 1.9]), steps=4, rtol=1e-4)["verdict"]
    assert (early["status"], early["step"]) == ("diverged", 1)


def test_memory_and_speed_ratios_and_the_oom_headline():
    base = arm("off", [3.0], status="oom", peak_mem_allocated_gib=130.0, peak_mem_reserved_gib=139.0)
    fits = arm("on", [3.0, 2.0], peak_mem_allocated_gib=65.0, peak_mem_reserved_gib=70.0, tokens_per_s=1000.0)
    result = compare_arms(base, fits, steps=2, rtol=1e-4)
    assert result["memory_ratio_allocated"] == pytest.approx(0.5)
    assert result["memory_ratio_reserved"] == pytest.approx(70 / 139)
    assert result["speedup"] is None  # the baseline never measured a rate
    assert result["summary"].startswith(
        "off runs out of memory (130.00 GiB allocated when it failed); on fits"
    )
    both = compare_arms(arm("off", [3.0], tokens_per_s=800.0), arm("on", [3.0], tokens_per_s=1000.0), 1, 1e-4)
    assert both["speedup"] == pytest.approx(1.25)


def test_rank_results_merge_to_the_worst_status_and_the_largest_memory():
    rank0 = {
        **arm("on", [3.0, 2.0]),
        "rank": 0,
        "peak_mem_allocated_gib": 10.0,
        "peak_mem_reserved_gib": 12.0,
    }
    rank1 = {
        **arm("on", [3.0], status="oom"),
        "rank": 1,
        "peak_mem_allocated_gib": 11.5,
        "peak_mem_reserved_gib": 11.9,
    }
    rank1["error"] = "CUDA out of memory"
    merged = merge_rank_results([rank1, rank0])
    assert (merged["status"], merged["error"]) == ("oom", "CUDA out of memory")
    assert merged["losses"] == [3.0, 2.0]  # rank 0's record
    assert (merged["peak_mem_allocated_gib"], merged["peak_mem_reserved_gib"]) == (11.5, 12.0)
    assert merged["ranks_reported"] == 2 and "rank" not in merged


# --------------------------------------------------------------------------------------------
# Planning: arms, overrides, tolerances, bad options
# --------------------------------------------------------------------------------------------


def test_plan_has_off_on_and_one_arm_per_kernel_when_ablating(tmp_path):
    plan = make_plan(QUICKSTART, SMALL, steps=3, kernels="swiglu,rms_norm", ablate=True, out=tmp_path)
    assert [a.name for a in plan.arms] == ["off", "on", "rms_norm", "swiglu"]
    assert [a.kernels for a in plan.arms] == [[], ["rms_norm", "swiglu"], ["rms_norm"], ["swiglu"]]
    on = load_recipe(QUICKSTART, plan.arms[1].overrides)
    assert on.kernels.enabled() == ["rms_norm", "swiglu"]
    assert on.training.max_steps == 3 and on.output_dir == str(tmp_path / "on")
    assert (
        on.checkpoint.every_steps is None and on.checkpoint.resume == "none" and not on.checkpoint.export_hf
    )
    assert load_recipe(QUICKSTART, plan.arms[0].overrides).kernels.enabled() == []
    # Every arm keeps the user's recipe otherwise: same seed, model and data.
    assert {load_recipe(QUICKSTART, a.overrides).data.max_seq_len for a in plan.arms} == {64}
    assert (plan.rtol, plan.nproc) == (1e-4, 1)


def test_default_kernels_and_tolerance_follow_the_recipe(tmp_path):
    # The quickstart says `kernels: all`: the 'on' arm gets that selection.
    plan = make_plan(QUICKSTART, SMALL, out=tmp_path / "a")
    assert plan.kernels == [
        "rms_norm", "layer_norm", "rope", "swiglu", "geglu", "moe_experts", "vision_attention",
        "fused_linear_cross_entropy",
    ]  # fmt: skip
    # A recipe that enables some kernels is compared on those.
    recipe = tmp_path / "some-kernels.yaml"
    some = ("kernels: {rms_norm: true, rope: false, layer_norm: false, swiglu: false, geglu: false, "
            "moe_experts: false, vision_attention: false, fused_linear_cross_entropy: true}")  # fmt: skip
    text, replaced = re.subn(r"(?m)^kernels:.*$", some, QUICKSTART.read_text())
    assert replaced == 1, "the quickstart must have one top-level kernels line to rewrite"
    recipe.write_text(text)
    plan = make_plan(recipe, SMALL, out=tmp_path / "b", ablate=True)
    assert plan.kernels == ["rms_norm", "fused_linear_cross_entropy"]
    assert [a.name for a in plan.arms] == ["off", "on", "rms_norm", "fused_linear_cross_entropy"]
    assert [a.name for a in make_plan(recipe, SMALL, kernels="rope", ablate=True, out=tmp_path / "c").arms] == [
        "off", "on",  # one kernel: its ablation arm would be the 'on' arm again
    ]  # fmt: skip
    bf16 = make_plan(
        QUICKSTART, [*SMALL, "training.precision=bf16-mixed", "training.device=cuda"], out=tmp_path / "d"
    )
    assert bf16.rtol == 2e-2 and "bf16-mixed" in bf16.rtol_rule
    chosen = make_plan(QUICKSTART, SMALL, out=tmp_path / "e", rtol=1e-3)
    assert chosen.rtol == 1e-3 and chosen.rtol_rule.startswith("--rtol")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kernels="rms_nrom"), "unknown kernel 'rms_nrom' (did you mean rms_norm?)"),
        (dict(kernels="cross_entropy,fused_linear_cross_entropy"), "replace the same loss"),
        (dict(steps=0), "--steps must be at least 1"),
        (dict(rtol=-1.0), "--rtol must be a positive number"),
        (dict(nproc_per_node=2), "add parallel.strategy=ddp"),
        (dict(overrides=["kernels.rope=false"]), "use --kernels instead"),
        (dict(overrides=["training.max_steps=5"]), "use --steps instead"),
        (dict(also=["training.compile"]), "--also training.compile: write one recipe override, key=value"),
        (dict(also=["kernels.rope=false"]), "use --kernels instead"),
    ],
)
def test_bad_options_are_named_with_the_fix(tmp_path, options, message):
    overrides = options.pop("overrides", [])
    with pytest.raises(CompareError, match=re.escape(message)):
        make_plan(QUICKSTART, [*SMALL, *overrides], out=tmp_path, **options)


def test_a_bad_recipe_or_a_foreign_directory_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(RecipeError, match="training.lr"):
        make_plan(QUICKSTART, [*SMALL, "training.lr=-1"], out=tmp_path)
    (tmp_path / "on").mkdir()
    (tmp_path / "on" / "precious.txt").write_text("not ours")
    with pytest.raises(CompareError, match="was not written by ligertune compare"):
        make_plan(QUICKSTART, SMALL, out=tmp_path)


def test_arms_launch_through_torchrun_with_the_same_world_size(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    plan = make_plan(QUICKSTART, [*SMALL, "parallel.strategy=ddp", "training.device=cpu"], out=tmp_path)
    assert plan.nproc == 4
    command = arm_command(tmp_path / "on" / "arm.json", plan.nproc)
    assert command[1:] == [
        "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1", "--standalone",
        "-m", "ligertune.tools.compare.arm", str(tmp_path / "on" / "arm.json"),
    ]  # fmt: skip
    env = child_environment()
    assert not {"WORLD_SIZE", "RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE"} & set(
        env
    )  # the nested launch sets its own
    with pytest.raises(CompareError, match="disagrees"):
        make_plan(QUICKSTART, [*SMALL, "parallel.strategy=ddp"], out=tmp_path, nproc_per_node=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(CompareError, match="several nodes"):
        make_plan(QUICKSTART, [*SMALL, "parallel.strategy=ddp"], out=tmp_path)
    monkeypatch.setenv("RANK", "1")  # the other ranks of a torchrun-launched compare do nothing
    assert compare_command(QUICKSTART, ["not-an-override"], quiet_console()) == 0
    assert arm_command(tmp_path / "arm.json", 1)[1:] == [
        "-m",
        "ligertune.tools.compare.arm",
        str(tmp_path / "arm.json"),
    ]


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def test_report_renders_an_oom_arm_to_markdown_and_png(tmp_path):
    plan = make_plan(QUICKSTART, SMALL, steps=3, kernels="rms_norm", out=tmp_path)
    off = arm("off", [3.0], status="oom", error="CUDA out of memory", peak_mem_allocated_gib=9.0,
              peak_mem_reserved_gib=9.5, device="cuda", device_name="NVIDIA H200", log="off/arm.log")  # fmt: skip
    on = arm("on", [3.0, 2.5, 2.25], peak_mem_allocated_gib=4.0, peak_mem_reserved_gib=4.5, tokens_per_s=1234.5,
             device="cuda", device_name="NVIDIA H200", log="on/arm.log", kernels=["rms_norm"])  # fmt: skip
    report = build_report(plan, [off, on])
    assert report["verdict"]["status"] == "incomplete" and report["speed_meaningful"]
    files = compare_render(report, tmp_path)
    text = Path(files["markdown"]).read_text()
    assert "| status | OOM at step 2 | ok |" in text
    assert "| peak allocated vs baseline | baseline | 0.44× |" in text
    assert "| 2 |  | 2.500000 |  |" in text  # the OOM arm has no loss at step 2
    assert "off runs out of memory (9.00 GiB allocated when it failed); on fits (4.00 GiB" in text
    assert Path(files["plot"]).read_bytes()[:4] == b"\x89PNG"


def compare_render(report: dict, out: Path) -> dict:
    return render.write_outputs(report, out, quiet_console())


# --------------------------------------------------------------------------------------------
# End to end: real arms in subprocesses
# --------------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # os.environ carries conftest's TRITON_INTERPRET=1 on a machine without a GPU.
    env = {**os.environ, "PYTHONPATH": pythonpath_with_root(), "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "ligertune", "compare", *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
    )


def run_in_process(monkeypatch, tmp_path, *options, **kwargs) -> tuple[int, dict]:
    """A compare of the small quickstart; `options` are more overrides (a fault's plugin, say)."""
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_root())
    status = compare_command(QUICKSTART, [*SMALL, *options], quiet_console(), out=tmp_path, **kwargs)
    return status, json.loads((tmp_path / "compare.json").read_text())


@pytest.mark.slow
def test_quickstart_compare_is_at_parity_in_fp32_with_a_stable_report(tmp_path):
    proc = run_cli(str(QUICKSTART), *SMALL, "--steps", "4", "--kernels", FAST_KERNELS, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert set(report) == TOP_KEYS and report["schema"] == "ligertune-compare/1"
    assert [a["name"] for a in report["arms"]] == ["off", "on"]
    for a in report["arms"]:
        assert set(a) == ARM_KEYS
        assert a["status"] == "ok" and a["steps_completed"] == 4 and len(a["losses"]) == 4
        assert a["tokens_per_s"] > 0 and a["step_time_median_s"] > 0 and a["peak_host_rss_gib"] > 0
        assert a["device"] == "cpu" and a["peak_mem_allocated_gib"] is None and a["mfu"] is None
    (comparison,) = report["comparisons"]
    assert set(comparison) == COMPARISON_KEYS and set(comparison["verdict"]) == VERDICT_KEYS
    assert report["verdict"]["status"] == "parity" and report["verdict"]["parity"] is True
    # The verdict agrees with the losses themselves (and the run trained: the loss moved).
    off, on = (a["losses"] for a in report["arms"])
    assert max(abs(a - b) / b for a, b in zip(on, off, strict=True)) <= 1e-4
    assert off[0] != off[-1]
    assert report["speed_meaningful"] is False and "Triton CPU interpreter" in report["kernel_mode"]
    assert any("not meaningful" in n or "only check the path" in n for n in report["notes"])
    assert (tmp_path / "compare.md").read_text().count("| verdict | baseline | parity |") == 1
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "parity" in proc.stdout and "wrote" in proc.stdout


@pytest.mark.slow
def test_a_broken_kernel_diverges_and_ablation_points_at_it(monkeypatch, tmp_path):
    status, report = run_in_process(
        monkeypatch, tmp_path, plugin("scale_rms_norm"), steps=3, kernels="rms_norm,swiglu", ablate=True
    )
    assert status == 1  # a divergence is a failure for scripts
    by_arm = {c["arm"]: c for c in report["comparisons"]}
    assert by_arm["swiglu"]["verdict"]["status"] == "parity"
    off = report["arms"][0]["losses"]
    for name in ("on", "rms_norm"):
        verdict = by_arm[name]["verdict"]
        assert verdict["status"] == "diverged", verdict
        losses = next(a for a in report["arms"] if a["name"] == name)["losses"]
        k = verdict["step"]
        assert (verdict["baseline_loss"], verdict["arm_loss"]) == (off[k - 1], losses[k - 1])
        assert abs(losses[k - 1] - off[k - 1]) / off[k - 1] > 1e-4
        assert all(abs(a - b) / b <= 1e-4 for a, b in zip(losses[: k - 1], off[: k - 1], strict=True))
    assert report["verdict"]["status"] == "diverged"


@pytest.mark.slow
def test_ablation_leaves_out_a_kernel_the_model_has_no_module_for(monkeypatch, tmp_path):
    # The quickstart is a Llama: RMSNorm modules, no LayerNorm. Its ablation arm would be `off` again.
    status, report = run_in_process(
        monkeypatch, tmp_path, steps=2, kernels="rms_norm,layer_norm", ablate=True
    )
    assert status == 0
    assert [a["name"] for a in report["arms"]] == ["off", "on", "rms_norm"]
    assert not (tmp_path / "layer_norm").exists()
    assert any(n.startswith("arm layer_norm not run") for n in report["notes"]), report["notes"]
    assert report["verdict"]["parity"]


@pytest.mark.slow
def test_also_adds_an_on_arm_with_one_more_setting_measured_against_off(monkeypatch, tmp_path):
    # With --ablate too: an --also arm carries every selected kernel, layer_norm (unpatched in a
    # Llama) included, and still runs; only the layer_norm ablation arm is left out.
    status, report = run_in_process(
        monkeypatch,
        tmp_path,
        steps=2,
        kernels="rms_norm,layer_norm",
        ablate=True,
        also=["model.attn_implementation=eager"],
    )
    assert status == 0
    names = [a["name"] for a in report["arms"]]
    assert names == ["off", "on", "rms_norm", "on+attn_implementation=eager"]
    extra = json.loads((tmp_path / "on+attn_implementation=eager" / "arm.json").read_text())
    assert "model.attn_implementation=eager" in extra["overrides"]
    assert extra["kernels"] == ["rms_norm", "layer_norm"]
    compared = {c["arm"]: c for c in report["comparisons"]}
    assert compared["on+attn_implementation=eager"]["verdict"]["parity"]  # eager and sdpa: same math


@pytest.mark.slow
def test_an_arm_out_of_memory_is_reported_and_the_other_arm_still_runs(monkeypatch, tmp_path):
    status, report = run_in_process(
        monkeypatch, tmp_path, plugin("oom_at_step_2_without_kernels"), steps=3, kernels="rms_norm"
    )
    assert status == 0  # an OOM is a finding, not a failure
    off, on = report["arms"]
    assert (off["status"], off["steps_completed"], len(off["losses"])) == ("oom", 1, 1)
    assert "out of memory at step 2" in off["error"]
    assert (on["status"], on["steps_completed"]) == ("ok", 3)
    verdict = report["verdict"]
    assert verdict["status"] == "incomplete" and "off ran out of memory at step 2" in verdict["message"]
    assert report["comparisons"][0]["steps_compared"] == 1
    assert "OOM at step 2" in (tmp_path / "compare.md").read_text()


@pytest.mark.slow
def test_a_torchrun_arm_runs_every_rank_and_merges_their_reports(tmp_path):
    # The nested torchrun launch, end to end on CPU: a ddp arm of 2 gloo ranks, one step. Each
    # rank runs our entry point under torchrun and writes its own report, which are merged.
    # (An arm that fails on every rank cannot show this: torchrun stops the other ranks as soon
    # as one fails, so whether the second report gets written is a race.)
    plan = make_plan(
        QUICKSTART,
        [*SMALL, "parallel.strategy=ddp"],
        steps=1,
        kernels="rms_norm",
        nproc_per_node=2,
        out=tmp_path,
    )
    result = run_arm_process(plan.arms[0], plan)
    assert result["status"] == "ok", result.get("error")
    assert result["ranks_reported"] == 2 and result["world_size"] == 2
    assert result["steps_completed"] == 1 and len(result["losses"]) == 1
    assert sorted(p.name for p in (tmp_path / "off").glob("result-rank*.json")) == [
        "result-rank0.json",
        "result-rank1.json",
    ]


# --------------------------------------------------------------------------------------------
# GPU (H200): real speed and memory, a real OOM, bf16 tolerance
# --------------------------------------------------------------------------------------------

GPU = ["training.device=cuda", "training.precision=bf16-mixed"]


@pytest.mark.gpu
def test_gpu_compare_bf16_is_at_parity_with_memory_and_mfu(monkeypatch, tmp_path):
    status, report = run_in_process(monkeypatch, tmp_path, *GPU, steps=20, kernels="all")
    assert status == 0, report["verdict"]
    assert report["verdict"]["parity"], report["comparisons"][0]["summary"]
    assert report["speed_meaningful"] and report["device"] == "cuda" and report["tolerance"]["rtol"] == 2e-2
    for a in report["arms"]:
        assert a["status"] == "ok" and a["mfu"] > 0 and a["peak_mem_allocated_gib"] > 0
        assert a["peak_mem_reserved_gib"] >= a["peak_mem_allocated_gib"]


@pytest.mark.gpu
def test_gpu_real_oom_keeps_the_peak_reached(monkeypatch, tmp_path):
    status, report = run_in_process(
        monkeypatch, tmp_path, plugin("cuda_oom_at_step_3_without_kernels"), *GPU, steps=4
    )
    off, on = report["arms"]
    assert off["status"] == "oom" and off["steps_completed"] == 2 and off["peak_mem_allocated_gib"] > 0
    assert "out of memory" in off["error"].lower() and "simulated" not in off["error"]
    assert on["status"] == "ok" and status == 0


@pytest.mark.gpu
def test_gpu_llama_1b_shape_fused_loss_saves_memory_at_parity(monkeypatch, tmp_path):
    recipe = ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml"
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_root())
    status = compare_command(
        recipe, ["model.config_overrides={num_hidden_layers: 4}", "training.micro_batch_size=4"],
        quiet_console(), steps=8, kernels="all", out=tmp_path,
    )  # fmt: skip
    report = json.loads((tmp_path / "compare.json").read_text())
    comparison = report["comparisons"][0]
    assert status == 0 and report["verdict"]["parity"], comparison["summary"]
    # 4 × 2048 tokens × 128256 vocab of fp32 logits (4 GiB, and as much again for their
    # gradient) never exist with the fused linear cross entropy.
    assert comparison["memory_ratio_allocated"] < 0.8, comparison["summary"]


@pytest.mark.gpu
def test_gpu_two_process_arms_are_at_parity(monkeypatch, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the nvidia-h200-x2 machine)")
    status, report = run_in_process(
        monkeypatch, tmp_path, *GPU, "parallel.strategy=ddp", steps=10, kernels="all", nproc_per_node=2
    )
    assert status == 0 and report["verdict"]["parity"], report["comparisons"][0]["summary"]
    assert report["world_size"] == 2
    for a in report["arms"]:
        assert a["ranks_reported"] == 2 and a["world_size"] == 2
        assert a["tokens_per_s_per_gpu"] == pytest.approx(a["tokens_per_s"] / 2)
