"""CI runs what README tells a new user to run (the "Start here" block, unpinned), and the pinned
job's subset names tests that exist. README's test command failed on a fresh machine while CI
passed on pinned versions: these keep the two from drifting apart again."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import ROOT, run_repo_script

CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()


def test_ci_runs_readmes_start_here_commands_as_written_before_any_pin():
    done = run_repo_script("scripts/readme_commands.py")
    assert done.returncode == 0, done.stderr
    commands = done.stdout.splitlines()
    assert commands[-1] == "pip install -e '.[dev,deepspeed]' && python -m pytest -q"
    assert any("ligertune train recipes/quickstart.yaml" in c for c in commands)
    # Every command is in README's block verbatim, and CI's first job runs that list.
    assert all(command in README for command in commands)
    readme_job, pinned_job = CI.split("# --- 2. pinned", 1)
    assert "scripts/readme_commands.py" in readme_job and 'bash -euo pipefail -c "$command"' in readme_job
    assert "constraints" not in readme_job.replace("# ", "").split("mapfile", 1)[1].split("deactivate", 1)[0]
    assert "-c .ci/constraints.txt -e '.[dev,deepspeed]'" in pinned_job


def test_the_pinned_subset_names_tests_that_exist():
    subset = re.search(r"pinned_subset=\((.*?)\)", CI, re.DOTALL).group(1).split()
    assert "tests/test_attention.py" in subset  # every family × the pinned transformers
    for entry in subset:
        path, _, name = entry.partition("::")
        assert (ROOT / path).exists(), entry
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), entry


def test_readme_offers_the_quick_subset_and_the_marker_deselects_the_slow_tests():
    assert 'python -m pytest -q -m "not slow"' in README and "15–40 minutes" in README
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "not slow",
            "tests/test_distributed.py",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert collected.returncode in (0, 5), collected.stdout[-2000:]
    assert "test_strategy_matches_one_process_and_resumes_exactly" not in collected.stdout
    assert "test_torchrun_commands" in collected.stdout  # the quick ones stay
