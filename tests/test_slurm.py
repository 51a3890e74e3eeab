"""scripts/slurm/ligertune.sbatch on one host, without SLURM: two "nodes" of one CPU process
each, as SLURM would run the script inside a job step (one task per node, SLURM_STEP_ID set),
where it runs torchrun itself. What this covers: the script's torchrun command (c10d rendezvous
of SLURM_NNODES nodes, the recipe and overrides passed through), a real DDP run over gloo, and a
stop by SIGTERM (what a preemption sends) followed by the same command again, which resumes.
What it cannot cover: srun, scontrol's expansion of the nodelist, and several hosts.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL, pythonpath_with_root

SCRIPT = ROOT / "scripts" / "slurm" / "ligertune.sbatch"
MAX_STEPS = 12
OVERRIDES = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "training.device=cpu",
    "parallel.strategy=ddp",
    f"training.max_steps={MAX_STEPS}",
    "training.micro_batch_size=2",
    "data.validation_fraction=0.0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(run_dir: Path, logs: Path) -> list[subprocess.Popen]:
    """The script twice, as the two tasks of a 2-node job step: the environment SLURM gives a
    task (job id, node count, node and task ids, step id), the rendezvous on this host, one
    process per "node"; `torchrun` from this interpreter's environment, as an activated
    virtualenv would provide it."""
    port = str(_free_port())
    nodes = []
    for node in range(2):
        env = {
            **os.environ,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            "PYTHONPATH": pythonpath_with_root(),
            "SLURM_JOB_ID": "4242",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_ID": "0",
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "GPUS_PER_NODE": "1",
            "RDZV_HOST": "127.0.0.1",
            "RDZV_PORT": port,
        }
        log = (logs / f"node{node}-{time.monotonic_ns()}.log").open("w")
        nodes.append(
            subprocess.Popen(
                ["bash", str(SCRIPT), str(QUICKSTART), *OVERRIDES, f"output_dir={run_dir}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        )
        log.close()
    return nodes


def _wait(nodes: list[subprocess.Popen]) -> list[int]:
    try:
        return [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


def _outputs(logs: Path, tail: int = 3000) -> str:
    """The nodes' logs, each cut to its last `tail` characters (0: whole)."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(logs.iterdir()))


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_and_resumes_after_sigterm(tmp_path):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()

    # First attempt: stopped by SIGTERM once it trains, as a preemption would stop it. The
    # script exec'd torchrun, so the process is torchrun, which forwards the signal to its rank.
    nodes = _launch_two_nodes(run_dir, logs)
    deadline = time.monotonic() + 180
    while not any(r["event"] == "train" for r in _records(run_dir)):
        assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), _outputs(logs)
        time.sleep(0.1)
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    statuses = _wait(nodes)
    assert all(status != 0 for status in statuses), (statuses, _outputs(logs))
    first = _records(run_dir)
    assert first[0]["event"] == "start" and first[0]["world_size"] == 2, _outputs(logs)
    summary = [r for r in first if r["event"] == "summary"][-1]
    stopped_at = summary["steps"]
    assert summary["stopped_by"] == "SIGTERM" and 1 <= stopped_at < MAX_STEPS, (summary, _outputs(logs))
    assert (run_dir / "checkpoints" / f"step-{stopped_at}" / "COMPLETE").is_file()

    # The same command again (a requeue reruns the script with the same arguments): it resumes
    # from that checkpoint (checkpoint.resume: auto) and trains the remaining steps.
    statuses = _wait(_launch_two_nodes(run_dir, logs))
    assert statuses == [0, 0], _outputs(logs)
    second = _records(run_dir)[len(first) :]
    assert second[0]["event"] == "start" and second[0]["world_size"] == 2
    trained = {r["step"]: r["loss"] for r in second if r["event"] == "train"}
    assert sorted(trained) == list(range(stopped_at + 1, MAX_STEPS + 1)), (sorted(trained), _outputs(logs))
    assert all(math.isfinite(loss) for loss in trained.values())
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stopped_at}'}" in _outputs(logs, 0)
    assert "ligertune job 4242 (restart 0): 2 node(s) x 1, rendezvous 127.0.0.1:" in _outputs(logs, 0)
