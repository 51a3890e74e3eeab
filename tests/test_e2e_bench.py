"""scripts/e2e_bench.py (HF eager vs ligertune vs Liger, each provider a `ligertune.tools.compare`
arm) and the per-arm timeout of `ligertune.tools.compare.runner.run_arm_process`.

CPU: a real ``--seq-lens`` sweep of the eager and ligertune providers on random-token rows (the
quickstart shrunk to a tiny model, fp32, so the two must agree to the compare's fp32 rule); the
longest-length summary and the tables on hand-built results; the option checks; Liger's hook on a
stand-in module (Liger is only installed on the GPU machine); and arms that run past their
timeout, in one process and under torchrun (gloo), which must be stopped with every process.
GPU: all three providers, Liger included, in bf16.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from ligertune.config import load_recipe
from ligertune.tools.compare import make_plan
from ligertune.tools.compare.plan import ARM_LOG, ARM_SPEC, RTOL, ArmSpec
from ligertune.tools.compare.runner import run_arm_process
from ligertune.training.transforms import apply_transforms
from scripts import e2e_bench
from tests.helpers import QUICKSTART, ROOT, TINY_MODEL, assert_refused_before_writing, run_repo_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The tiny model without TINY_MODEL's data.max_seq_len: --seq-lens sets the length.
TINY = [o for o in TINY_MODEL if not o.startswith("data.max_seq_len")]
SMALL = [*TINY, "data.validation_fraction=0", "training.micro_batch_size=1"]
FP32_RTOL = RTOL["fp32"]


def run_script(*args: str) -> subprocess.CompletedProcess:
    return run_repo_script("scripts/e2e_bench.py", *args)


def relative_differences(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]


# --------------------------------------------------------------------------------------------
# A real sweep: eager and ligertune at two lengths on random-token rows
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_seq_len_sweep_on_random_rows_trains_both_providers_at_parity(tmp_path):
    lengths = (32, 64)
    # 3 steps, 2 of them warm-up: the rates cover exactly one step, so tokens/s × step time is
    # the number of tokens of that step.
    proc = run_script(
        str(QUICKSTART), *SMALL, "--seq-lens", "64,32", "--random-rows", "1",
        "--providers", "eager,ligertune", "--steps", "3", "--warmup", "2", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").read_bytes()[:8] == PNG_MAGIC
    assert report["providers"] == ["eager", "ligertune"]
    results = report["results"]
    # Shortest length first, every provider at each length.
    assert [(r["provider"], r["seq_len"]) for r in results] == [
        ("eager", 32), ("ligertune", 32), ("eager", 64), ("ligertune", 64),
    ]  # fmt: skip
    assert report["longest"] == {
        "eager": {"seq_len": 64, "first_failure": None},
        "ligertune": {"seq_len": 64, "first_failure": None},
    }

    # The random-token file: one row as long as the longest length, ids inside the vocabulary.
    data = tmp_path / "random-tokens.jsonl"
    rows = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    assert len(rows) == 1 and len(rows[0]) == max(lengths)
    assert all(isinstance(t, int) and 0 <= t < 2048 for t in rows[0])

    by = {(r["provider"], r["seq_len"]): r for r in results}
    for r in results:
        length = r["seq_len"]
        assert r["status"] == "ok" and r["error"] is None, r
        assert r["steps_completed"] == 3 and len(r["losses"]) == 3
        assert all(loss is not None and math.isfinite(loss) for loss in r["losses"])
        # Every row holds exactly `length` tokens (the 64-token row cut to 32 at the shorter
        # length) and, trained unpacked, every position but the first is a label.
        assert r["tokens_per_s"] * r["step_time_median_s"] == pytest.approx(length, rel=1e-6)
        assert r["label_tokens_per_s"] / r["tokens_per_s"] == pytest.approx((length - 1) / length)
        arm_dir = tmp_path / f"{r['provider']}-{length}"
        overrides = json.loads((arm_dir / ARM_SPEC).read_text())["overrides"]
        assert f"data.path={json.dumps(str(data.resolve()))}" in overrides
        assert {"data.format=pretokenized", "data.packing=false", f"data.max_seq_len={length}"} <= set(
            overrides
        )
        log = (arm_dir / ARM_LOG).read_text()
        assert f"1 samples → 1 sequences of ≤ {length} tokens" in log, log
        start = json.loads((arm_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert start["event"] == "start"
        patched = start["kernels_patched"]
        if r["provider"] == "eager":
            assert patched == {}
        else:  # the ligertune arm really ran our kernels
            assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"} <= set(patched)

    for length in lengths:
        eager, ours = by["eager", length]["losses"], by["ligertune", length]["losses"]
        assert max(relative_differences(ours, eager)) <= FP32_RTOL, (eager, ours)
        assert eager[0] != eager[-1]  # it trained
    # The two lengths trained on different data (the first step's loss of the same weights differs).
    assert by["eager", 32]["losses"][0] != by["eager", 64]["losses"][0]

    text = (tmp_path / "e2e.md").read_text()
    assert text.startswith("command: `python scripts/e2e_bench.py ")
    assert "### max_seq_len 32" in text and "### max_seq_len 64" in text
    for provider in ("eager", "ligertune"):
        assert f"| {provider} | 64 | none up to the longest tried |" in text
    assert proc.stdout.rstrip().endswith(text.rstrip())  # the tables are printed last


@pytest.mark.slow
def test_random_pairs_fill_both_sequences_of_every_pair_to_the_recipe_length(tmp_path):
    """DPO on --random-pairs without --seq-lens: the recipe's max_seq_len (48) sets the rows,
    every sequence of every pair is exactly that long, and both providers agree."""
    dpo = ROOT / "recipes" / "quickstart-dpo.yaml"
    proc = run_script(
        str(dpo), *TINY, "data.max_seq_len=48", "data.validation_fraction=0", "training.micro_batch_size=2",
        "--random-pairs", "3", "--providers", "eager,ligertune", "--steps", "2", "--warmup", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "random-pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["chosen"] != r["rejected"] for r in rows)
    results = json.loads((tmp_path / "e2e.json").read_text())["results"]
    for r in results:
        assert r["status"] == "ok", r
        # 2 pairs × 2 sequences × 48 tokens in the one timed step.
        assert r["tokens_per_s"] * r["step_time_median_s"] == pytest.approx(2 * 2 * 48, rel=1e-6)
        assert (
            "data.format=preference"
            in json.loads((tmp_path / r["provider"] / ARM_SPEC).read_text())["overrides"]
        )
    eager, ours = (next(r for r in results if r["provider"] == p)["losses"] for p in ("eager", "ligertune"))
    assert max(relative_differences(ours, eager)) <= FP32_RTOL, (eager, ours)


# --------------------------------------------------------------------------------------------
# The longest-length summary and the tables, on hand-built results
# --------------------------------------------------------------------------------------------

NUMBERS = ("tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_time_median_s",
           "peak_mem_allocated_gib", "peak_mem_reserved_gib")  # fmt: skip


def result(
    provider: str, seq_len: int | None, status: str = "ok", error: str | None = None, **numbers
) -> dict:
    """A result as `main` records it: every number None unless given."""
    return {"provider": provider, "seq_len": seq_len, "status": status, "error": error,
            "losses": numbers.pop("losses", []), **dict.fromkeys(NUMBERS), **numbers}  # fmt: skip


def sweep_results() -> list[dict]:
    """eager runs every length; ligertune runs out of memory at the second (and is not tried
    after); liger is skipped by the time budget from the second on; a fourth fails at once.
    Listed out of length order, as nothing promises an order."""
    return [
        result("eager", 128, tokens_per_s=900.0, tokens_per_s_per_gpu=900.0, losses=[3.0, 2.0]),
        result(
            "ligertune",
            64,
            "oom",
            "CUDA out of memory. Tried to allocate 2.00 GiB",
            peak_mem_allocated_gib=9.5,
            losses=[3.0],
        ),
        result("liger", 64, "skipped", "time budget"),
        result(
            "eager",
            32,
            tokens_per_s=1000.0,
            tokens_per_s_per_gpu=500.0,
            mfu=0.3,
            step_time_median_s=0.25,
            peak_mem_allocated_gib=4.0,
            peak_mem_reserved_gib=5.0,
            losses=[3.0, 2.75],
        ),
        result(
            "ligertune",
            32,
            tokens_per_s=1500.0,
            tokens_per_s_per_gpu=750.0,
            mfu=0.45,
            step_time_median_s=0.5,
            peak_mem_allocated_gib=3.0,
            peak_mem_reserved_gib=3.5,
            losses=[3.0, 2.5],
        ),
        result("liger", 128, "skipped", "time budget"),
        result("eager", 64, tokens_per_s=950.0, tokens_per_s_per_gpu=950.0, losses=[3.0, 2.0]),
        result(
            "liger",
            32,
            tokens_per_s=1200.0,
            tokens_per_s_per_gpu=600.0,
            peak_mem_allocated_gib=4.0,
            losses=[3.0, 2.5],
        ),
        result("broken", 32, "error", "RuntimeError: no kernel image"),
    ]


def test_longest_length_and_first_failure_per_provider():
    providers = ["eager", "ligertune", "liger", "broken"]
    longest = e2e_bench.longest_per_provider(sweep_results(), providers)
    assert longest == {
        "eager": {"seq_len": 128, "first_failure": None},
        "ligertune": {"seq_len": 32, "first_failure": {"seq_len": 64, "status": "oom"}},
        "liger": {"seq_len": 32, "first_failure": None},  # skipped is not a failure
        "broken": {"seq_len": None, "first_failure": {"seq_len": 32, "status": "error"}},
    }
    # The first failure is the shortest failed length, whatever fails after it.
    later = [result("x", 64, "error", "boom"), result("x", 16), result("x", 32, "oom")]
    assert e2e_bench.longest_per_provider(later, ["x"])["x"] == {
        "seq_len": 16,
        "first_failure": {"seq_len": 32, "status": "oom"},
    }


def test_markdown_tables_ratios_failures_and_missing_numbers():
    results = sweep_results()
    providers = ["eager", "ligertune", "liger", "broken"]
    report = {"command": "python scripts/e2e_bench.py r.yaml --seq-lens 32,64,128", "results": results,
              "longest": e2e_bench.longest_per_provider(results, providers)}  # fmt: skip
    text = e2e_bench.markdown(report)
    lines = text.splitlines()
    assert lines[0] == "command: `python scripts/e2e_bench.py r.yaml --seq-lens 32,64,128`"
    headings = [line for line in lines if line.startswith("### ")]
    assert headings == [
        "### max_seq_len 32", "### max_seq_len 64", "### max_seq_len 128", "### Longest sequence that ran",
    ]  # fmt: skip
    # Ratios by hand: 1500/1000 tok/s against eager, 1500/1200 against Liger, 3.0/4.0 GiB; the
    # loss drift |2.5 - 2.75| / 2.75 at the second step.
    assert (
        "| ligertune | ok | 1,500 | 750 | 45.0% | 0.500 | 3.0 | 3.5 | 1.50 | 1.25 | 0.75 | 2.5000 | 9.09% |"
        in lines
    )
    assert (
        "| eager | ok | 1,000 | 500 | 30.0% | 0.250 | 4.0 | 5.0 | 1.00 | 0.83 | 1.00 | 2.7500 | 0.00% |"
        in lines
    )
    # Failed and skipped arms: a dash for every missing number, the error under the table.
    assert "| ligertune | OOM | — | — | — | — | 9.5 | — | — | — | — | 3.0000 | — |" in lines
    assert "| liger | skipped | — | — | — | — | — | — | — | — | — | — | — |" in lines
    assert "| broken | error | — | — | — | — | — | — | — | — | — | — | — |" in lines
    assert "ligertune: CUDA out of memory. Tried to allocate 2.00 GiB" in lines
    assert "broken: RuntimeError: no kernel image" in lines
    # At 64 only eager ran: no ratio against a Liger that did not run.
    assert "| eager | ok | 950 | 950 | — | — | — | — | 1.00 | — | — | 2.0000 | 0.00% |" in lines
    assert lines[-4:] == [
        "| eager | 128 | none up to the longest tried |",
        "| ligertune | 32 | 64 (oom) |",
        "| liger | 32 | none up to the longest tried |",
        "| broken | — | 32 (error) |",
    ]
    # Without --seq-lens: one table, no length sections, no summary.
    single = e2e_bench.markdown({"command": "c", "results": [result("eager", None), result("liger", None)]})
    assert "###" not in single and single.count("| eager | ok |") == 1


# --------------------------------------------------------------------------------------------
# Options and Liger's hook
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--providers", "eager,ligertun"],
            "unknown providers ['ligertun']; choose from eager, ligertune, liger",
        ),
        (["kernels=none"], "the providers set kernels"),
        (["kernels.rope=false"], "the providers set kernels"),
        (["data.max_seq_len=64", "--seq-lens", "32,64"], "--seq-lens sets data.max_seq_len"),
    ],
)
def test_bad_options_exit_with_an_argparse_error(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert_refused_before_writing(
        e2e_bench.main, [str(QUICKSTART), *args, "--out", str(out)], out, message, capsys
    )


@pytest.mark.slow
def test_liger_provider_patches_the_model_through_the_plugin(monkeypatch):
    """The liger provider's `plugins: [liger]` hands the built model to Liger's instance patch;
    Liger itself is a stand-in here, recording the models it is given."""
    from tests.helpers import tiny_llama

    patched = []
    liger = types.ModuleType("liger_kernel")
    liger.transformers = types.ModuleType("liger_kernel.transformers")
    liger.transformers._apply_liger_kernel_to_instance = lambda *, model: patched.append(model)
    monkeypatch.setitem(sys.modules, "liger_kernel", liger)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger.transformers)
    recipe = load_recipe(QUICKSTART, [*SMALL, *e2e_bench.PROVIDERS["liger"].recipe_overrides()])
    model = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=48)
    transformed, reports = apply_transforms(model, recipe)
    assert transformed is model and patched == [model]
    assert "kernels" not in reports and reports["plugins"] == "plugins applied: liger"


# --------------------------------------------------------------------------------------------
# Arm timeout: the arm is stopped with every process it started, and reported as timed out
# --------------------------------------------------------------------------------------------

# Far more steps than any timeout here allows (a tiny-model step takes ~10-20 ms on this CPU).
ENDLESS = 100_000


def processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line contains `text` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited while we looked
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def run_past_timeout(tmp_path: Path, nproc: int, timeout: float) -> tuple[dict, ArmSpec]:
    """Run the kernels-off arm of an endless tiny quickstart with `timeout`; check it returned
    within the timeout plus the parent's 60 s grace, as an error, with none of its processes left."""
    strategy = ["parallel.strategy=ddp", "training.device=cpu"] if nproc > 1 else []
    plan = make_plan(
        QUICKSTART, [*SMALL, *strategy], steps=ENDLESS, kernels="rms_norm", out=tmp_path, nproc_per_node=nproc
    )
    arm = plan.arms[0]
    started = time.monotonic()
    outcome = run_arm_process(arm, plan, timeout=timeout)
    elapsed = time.monotonic() - started
    assert timeout <= elapsed < timeout + 60, elapsed
    assert processes_mentioning(str(arm.directory / ARM_SPEC)) == []
    assert outcome["status"] == "error" and outcome["steps_completed"] < ENDLESS, outcome
    return outcome, arm


def test_a_single_process_arm_past_its_timeout_is_killed(tmp_path):
    outcome, _ = run_past_timeout(tmp_path, nproc=1, timeout=5)
    assert outcome["error"].startswith("timed out after 5 s"), outcome["error"]


def test_no_arm_runs_past_the_time_budget(tmp_path):
    """--time-budget caps the running arm's timeout: an arm that would train for minutes is
    stopped when the budget (4 s) is spent, though --timeout allows 600 s; the next is skipped."""
    started = time.monotonic()
    proc = run_script(
        str(QUICKSTART), *SMALL, "--providers", "eager,ligertune",
        "--steps", "100000", "--warmup", "1", "--timeout", "600", "--time-budget", "4", "--out", str(tmp_path),
    )  # fmt: skip
    assert time.monotonic() - started < 120
    results = {r["provider"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["results"]}
    assert results["eager"]["status"] == "error" and "timed out after 4" in results["eager"]["error"]
    assert results["ligertune"]["status"] == "skipped"
    assert proc.returncode == 1


def loop_started(arm: ArmSpec) -> bool:
    """Whether rank 0 had reached the training loop (it writes the start record just before)."""
    metrics = arm.directory / "metrics.jsonl"
    return metrics.exists() and '"event": "start"' in metrics.read_text()


def assert_reported_as_timed_out(outcome: dict, timeout: float, arm: ArmSpec) -> None:
    assert f"timed out after {timeout:g} s" in outcome["error"], outcome["error"]
    # Stopped, not asked to stop: `train` answers SIGTERM by saving a checkpoint, which an arm
    # must not spend minutes on.
    assert not (arm.directory / "checkpoints").exists() or not any((arm.directory / "checkpoints").iterdir())


def test_a_torchrun_arm_past_its_timeout_while_starting_is_stopped_with_its_workers(tmp_path):
    # 4 s: torchrun and both workers are still importing and building (~6 s here before the loop).
    outcome, arm = run_past_timeout(tmp_path, nproc=2, timeout=4)
    assert_reported_as_timed_out(outcome, 4, arm)


@pytest.mark.slow
def test_a_torchrun_arm_past_its_timeout_while_training_is_stopped_with_its_workers(tmp_path):
    # 30 s: about five times what the launch takes to reach the loop here, for a loaded CI machine.
    outcome, arm = run_past_timeout(tmp_path, nproc=2, timeout=30)
    assert loop_started(arm), "the workers had not reached the training loop in 30 s (machine overloaded?)"
    assert_reported_as_timed_out(outcome, 30, arm)


# --------------------------------------------------------------------------------------------
# GPU (H200): all three providers, Liger included
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_sweep_of_all_providers_in_bf16_agrees_and_measures_memory(tmp_path):
    pytest.importorskip("liger_kernel", reason="the GPU image gets liger-kernel from .whl/install.sh")
    proc = run_script(
        str(QUICKSTART), "training.device=cuda", "training.precision=bf16-mixed", "data.validation_fraction=0",
        "training.micro_batch_size=2", "--seq-lens", "256,1024", "--random-rows", "4",
        "--steps", "8", "--warmup", "3", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "e2e.json").read_text())
    by = {(r["provider"], r["seq_len"]): r for r in report["results"]}
    assert set(by) == {(p, n) for p in ("eager", "ligertune", "liger") for n in (256, 1024)}
    for r in by.values():
        assert r["status"] == "ok", r
        assert r["peak_mem_allocated_gib"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] > 0
    for length in (256, 1024):
        eager = by["eager", length]["losses"]
        for provider in ("ligertune", "liger"):
            losses = by[provider, length]["losses"]
            assert max(relative_differences(losses, eager)) <= RTOL["bf16-mixed"], (provider, length)
            # A patched model rounds differently from eager somewhere in 8 bf16 steps.
            assert losses != eager, f"{provider} at {length} trained bit-identically to eager: not patched?"
    assert report["longest"] == {p: {"seq_len": 1024, "first_failure": None} for p in report["providers"]}
    assert (tmp_path / "e2e.png").read_bytes()[:8] == PNG_MAGIC
