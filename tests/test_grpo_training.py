"""grpo end to end, through the CLI as a user runs it (subprocesses without TRITON_INTERPRET: the
kernels' PyTorch references on the CPU): the quickstart's reward rises, and a run killed (SIGKILL)
in the middle of a generation resumes from a checkpoint saved between two updates of one
generation batch to exactly the completions, losses and rewards of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_MODEL

pytestmark = pytest.mark.slow  # whole runs: the quickstart ~1 min on two cores, the resume ~30 s

RECORDER = '''
import json, os, signal

def record(prompt, completion, answer, metadata):
    """Appends each completion it scores to $GRPO_COMPLETIONS; kills its own process (SIGKILL,
    no cleanup) at line $GRPO_KILL_AT when that is set."""
    path = os.environ["GRPO_COMPLETIONS"]
    with open(path, "a") as f:
        f.write(json.dumps(completion) + "\\n")
    kill_at = os.environ.get("GRPO_KILL_AT")
    if kill_at and sum(1 for _ in open(path)) == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)
    return float(completion.strip()[:1].isdigit())
'''


def _cli(recipe: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "ligertune", "train", str(recipe), "logging.progress=plain", *overrides],
        cwd=ROOT,
        env=environment,
        text=True,
        capture_output=True,
        timeout=600,
    )


def _steps(run_dir: Path) -> dict[int, dict]:
    """The train record of each step, the last one written winning (a resume rewrites the steps
    after its checkpoint)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r.get("event") == "train"}


def test_quickstart_reward_rises(tmp_path):
    """The shipped quickstart, unchanged: a random-init model learns to start its answer with a
    number (the format reward), from about the 7% of tokens that are numbers to nearly always."""
    done = _cli(ROOT / "recipes" / "quickstart-grpo.yaml", f"output_dir={tmp_path}", "logging.log_every=1")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = _steps(tmp_path)
    reward = [steps[s]["reward_format_mean"] for s in sorted(steps)]
    assert len(reward) == 100
    first, last = sum(reward[:20]) / 20, sum(reward[-20:]) / 20
    assert first < 0.3 and last > 0.8, (first, last)
    assert "samples: prompt 'Question:" in (tmp_path / "train.log").read_text()


def test_a_killed_run_resumes_to_the_same_completions_and_losses(tmp_path):
    """μ = 2 updates per generation batch, a checkpoint every 3 steps: step 3 falls between the
    two updates of the second generation batch, so its checkpoint holds that batch's rows. The
    run is killed while generating the third batch (step 5), then resumed: it trains step 4 on
    the saved rows and generates step 5's completions from the same seeded generator. Every
    completion and every step's loss, gradient norm, reward and KL equal the uninterrupted run's."""
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text((ROOT / "recipes" / "quickstart-grpo.yaml").read_text())
    (tmp_path / "grpo_recorder.py").write_text(RECORDER)
    overrides = [
        *TINY_MODEL,
        "kernels=none",
        "training.max_steps=6",
        "training.micro_batch_size=2",
        "objective.num_generations=4",
        "objective.num_iterations=2",
        "objective.beta=0.04",
        "objective.rewards=[{fn: 'grpo_recorder:record'}]",
        "checkpoint.every_steps=3",
        "logging.log_every=1",
    ]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    runs = {}
    for name, kill_at in (("whole", None), ("killed", 20), ("resumed", None)):
        log = tmp_path / f"{name}.jsonl"
        env = {"GRPO_COMPLETIONS": str(log), **({"GRPO_KILL_AT": str(kill_at)} if kill_at else {})}
        out = whole if name == "whole" else killed
        runs[name] = (_cli(recipe, *overrides, f"output_dir={out}", env=env), log)
    (done, whole_log), (dead, killed_log), (resumed, resumed_log) = runs.values()
    assert done.returncode == 0 and resumed.returncode == 0, done.stderr + resumed.stderr
    assert dead.returncode == -9, dead.stdout + dead.stderr
    assert "resumed from" in resumed.stdout and "step-3" in resumed.stdout
    expected = whole_log.read_text().splitlines()
    killed_lines, resumed_lines = killed_log.read_text().splitlines(), resumed_log.read_text().splitlines()
    assert len(expected) == 24 and len(killed_lines) == 20 and len(resumed_lines) == 8
    assert killed_lines[:16] == expected[:16] and resumed_lines == expected[16:]
    got, want = _steps(killed), _steps(whole)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    # The rewards are logged with the step that generated them; the second update reuses the rows.
    assert [s for s in want if "reward_mean" in want[s]] == [1, 3, 5]
    for step in want:
        assert got[step].keys() == want[step].keys()
        for key in ("loss", "grad_norm", "kl", "clip_fraction", "reward_mean", "advantage_std"):
            if key in want[step]:
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-6, abs=1e-9), (step, key)
