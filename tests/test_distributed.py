"""DDP, FSDP2 and DeepSpeed ZeRO under real torchrun launches (gloo on the CPU), against one
process at the same global batch; checkpoint save/resume across ranks; the torchrun wrapper
(one node, two "nodes" on localhost); the DeepSpeed config and the launch options.

Every launch runs ``python -m torch.distributed.run --nproc-per-node 2`` on this file, whose
``__main__`` trains the runs of a JSON spec one after the other in the same processes (each
torchrun start costs seconds, so one launch does several runs). Models are a 2-layer,
hidden-64 Llama on the bundled sample at 64 tokens per row, fp32: the strategies compute the
same sums in another order, so losses agree with one process to ~1e-7 relative, and resumes
are bit-exact.

The file is also the worker: ``python tests/test_distributed.py SPEC.json`` (under torchrun, with
the repository root on PYTHONPATH for ``tests.helpers``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ligertune.catalog.strategies.deepspeed import deepspeed_config
from ligertune.config import RecipeError, load_recipe
from ligertune.distributed import Runtime
from ligertune.distributed.deepspeed import DeepSpeedRuntime
from ligertune.distributed.launch import LaunchError, LaunchOptions, check_options, torchrun_command
from ligertune.run.checkpoint import Checkpoint
from ligertune.training import train
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL, pythonpath_with_root

TINY = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "data.validation_fraction=0.05",
    "training.warmup_steps=2",
    # AdamW divides by sqrt(v) + eps; with the default 1e-8, a weight whose gradient is ~1e-8
    # moves by a fraction of lr that its gradient's fp32 rounding decides, so the strategies'
    # reduction orders would show in the weights. 1e-6 keeps such updates small and smooth.
    "training.adam_eps=1e-6",
    "training.device=cpu",
]
# 2 ranks × 2 rows × 2 micro-batches = the single process's 4 rows × 2: the same global batch.
SHAPE_2 = ["training.micro_batch_size=2", "training.gradient_accumulation_steps=2"]
SHAPE_1 = ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]
# Four steps, evaluated and checkpointed every two, exported at the end.
RUN = [
    "training.max_steps=4",
    "training.eval_every=2",
    "checkpoint.every_steps=2",
    "checkpoint.export_hf=true",
]
# Every kernel on: the interpreter makes these slow, so two steps without extras.
KERNELS = [
    "kernels=all",
    "training.max_steps=2",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "data.validation_fraction=0.0",
]
FP32_RTOL = 1e-5  # measured: the launches agree with one process to 1e-7 (reduction order)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The worker is this file run as a script: it imports tests.helpers from the repository root.
    env["PYTHONPATH"] = pythonpath_with_root()
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return env


def launch_worker(runs: list, work: Path, nproc: int = 2, timeout: int = 300, worker: str = __file__) -> str:
    """Train `runs` (override lists, or whatever another `worker` script reads from its JSON
    spec) in one torchrun launch of `nproc` processes; returns the combined output, failing the
    test with it when the launch fails."""
    spec = work / f"spec-{time.monotonic_ns()}.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(runs))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        worker,
        str(spec),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path, event: str = "train", key: str | None = None) -> dict[int, float]:
    """Per step: the training loss (or another `key` of the train records), or with
    event="eval" the evaluation loss."""
    key = key or ("loss" if event == "train" else "eval_loss")
    return {r["step"]: r[key] for r in read_metrics(run_dir) if r["event"] == event}


def exported_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def assert_losses_close(
    got: dict[int, float], expected: dict[int, float], rtol: float, label: str = "", atol: float = 0.0
) -> None:
    """Per step, within `rtol` relative or (for values that are small differences of large
    ones, such as preference rewards) `atol` absolute."""
    assert sorted(got) == sorted(expected), (label, sorted(got), sorted(expected))
    for step, value in expected.items():
        close = pytest.approx(value, rel=rtol, abs=atol)
        assert got[step] == close, f"{label} step {step}: {got[step]} vs {value}"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, Path]:
    """The one-process references: the base run and the kernels-on run."""
    from ligertune.training import train

    root = tmp_path_factory.mktemp("single")
    runs = {"base": TINY + SHAPE_1 + RUN, "kernels": TINY + KERNELS + ["training.micro_batch_size=4"]}
    for name, overrides in runs.items():
        train(load_recipe(QUICKSTART, overrides + [f"output_dir={root / name}"]))
    return {name: root / name for name in runs}


# --------------------------------------------------------------------------------------------
# Each strategy: same losses, gradients (through the weights) and evaluation as one process;
# sharded checkpoints that resume exactly; metrics and progress from rank 0 only.
# --------------------------------------------------------------------------------------------

_LAYOUT = {"ddp": ("full", "model.pt"), "fsdp": ("dcp", "dcp"), "deepspeed": ("deepspeed", "deepspeed")}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_strategy_matches_one_process_and_resumes_exactly(strategy, single, tmp_path):
    straight, resumed, kernels = tmp_path / "straight", tmp_path / "resumed", tmp_path / "kernels"
    common = TINY + SHAPE_2 + RUN + [f"parallel.strategy={strategy}"]
    runs = [
        common + [f"output_dir={straight}"],
        # From step 2 of the run above, into a directory of its own: steps 3 and 4 again.
        common + [f"output_dir={resumed}", f"checkpoint.resume={straight / 'checkpoints' / 'step-2'}"],
    ]
    if strategy != "ddp":
        # The sharded strategies: the kernels must see gathered weights, also when activation
        # checkpointing recomputes a layer in backward (same math: the reference has none).
        sharded = [f"parallel.strategy={strategy}", "training.activation_checkpointing=true"]
        runs.append(TINY + KERNELS + sharded + [f"output_dir={kernels}"])
    zero_stages = {1: tmp_path / "zero-1", 2: tmp_path / "zero-2"} if strategy == "deepspeed" else {}
    for stage, directory in zero_stages.items():  # stage 3 is the default above
        runs.append(
            common
            + [f"parallel.deepspeed.zero_stage={stage}", "training.max_steps=2", f"output_dir={directory}"]
        )
    output = launch_worker(runs, tmp_path)

    reference = single["base"]
    assert_losses_close(losses(straight), losses(reference), FP32_RTOL)
    assert_losses_close(losses(straight, "eval"), losses(reference, "eval"), FP32_RTOL)
    # Gradients: their global norm before clipping, per step. AdamW is blind to a gradient's
    # scale, so this is what catches a wrong normalisation (a missing or extra world-size
    # factor); the losses of steps 2-4 catch a wrong direction (a rank's rows left out).
    assert_losses_close(losses(straight, key="grad_norm"), losses(reference, key="grad_norm"), FP32_RTOL)
    # The weights after four steps, as the export gathers them on rank 0 (adam_eps 1e-6, see
    # TINY): measured within 1e-6 of one process's; atol 5e-6 is 0.2% of one step's lr.
    ours, theirs = exported_weights(straight), exported_weights(reference)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=5e-6, msg=name)

    # The resume replays steps 3 and 4 bit for bit (weights, optimizer, schedule, data position).
    again, first = losses(resumed), losses(straight)
    assert sorted(again) == [3, 4] and all(again[s] == first[s] for s in (3, 4)), (again, first)
    assert "resumed from" in output

    checkpoint = straight / "checkpoints" / "step-2"
    state = json.loads((checkpoint / "state.json").read_text())
    file_format, marker = _LAYOUT[strategy]
    assert (state["format"], state["world_size"], state["batch_index"]) == (file_format, 2, 4)
    assert (checkpoint / marker).exists() and (checkpoint / "COMPLETE").is_file()
    assert (checkpoint / "rng-rank0.pt").is_file() and (checkpoint / "rng-rank1.pt").is_file()
    assert not list((straight / "checkpoints").glob(".tmp-*"))

    # Rank 0 alone writes metrics and prints: one start record, each step logged once.
    records = read_metrics(straight)
    starts = [r for r in records if r["event"] == "start"]
    assert len(starts) == 1 and starts[0]["world_size"] == 2 and starts[0]["strategy"] == strategy
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3, 4]
    assert output.count("step 1/4 |") == 1 and output.count("step 4/4 |") == 2  # straight + resumed

    if strategy != "ddp":
        assert "fused_linear_cross_entropy  1 module patched" in output
        assert_losses_close(losses(kernels), losses(single["kernels"]), FP32_RTOL)
        # One fused call per micro-batch on each rank, on the whole [vocab, hidden] weight.
        for rank in (0, 1):
            calls = json.loads((kernels / f"flce-rank{rank}.json").read_text())
            assert calls == [[2048, 64]] * 2, calls

    for directory in zero_stages.values():  # two steps: the warm-up lr does not depend on the run length
        assert_losses_close(losses(directory), {s: losses(reference)[s] for s in (1, 2)}, FP32_RTOL)

    if strategy != "deepspeed":
        # The full and DCP formats resume on another number of processes: here one, without a
        # launcher, at the same global batch (1 × 4 rows = 2 × 2 rows), so the same data order.
        from ligertune.training import train

        one = tmp_path / "one-process"
        step_2 = f"checkpoint.resume={straight / 'checkpoints' / 'step-2'}"
        train(
            load_recipe(
                QUICKSTART,
                TINY + SHAPE_1 + RUN + [f"parallel.strategy={strategy}", step_2, f"output_dir={one}"],
            )
        )
        assert_losses_close(losses(one), {s: first[s] for s in (3, 4)}, FP32_RTOL)


# --------------------------------------------------------------------------------------------
# The CLI's torchrun wrapper
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ligertune", "train", str(QUICKSTART), *args]


def _ddp_run(run_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    """`ligertune train --nproc-per-node 2` on the tiny DDP recipe with `overrides`; (the process,
    its stdout and stderr together)."""
    done = subprocess.run(
        _cli("--nproc-per-node", "2", *TINY, "parallel.strategy=ddp", *overrides, f"output_dir={run_dir}"),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
        cwd=ROOT,
    )
    return done, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes_on_localhost_match_one_process(rendezvous, single, tmp_path):
    """`ligertune train --nnodes 2 --nproc-per-node 1 --rdzv-endpoint` on two "nodes" (two
    launchers on this host): a DDP job of two ranks, whose first two steps are the single
    process's (the warm-up lr of steps 1-2 does not depend on the run length)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    overrides = TINY + SHAPE_2 + ["parallel.strategy=ddp", "training.max_steps=2", f"output_dir={tmp_path}"]
    nodes = []
    for node in range(2):
        launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
        if rendezvous == "static":
            launch += ["--node-rank", str(node)]
        nodes.append(
            subprocess.Popen(
                _cli(*launch, *overrides),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=_env(),
                cwd=ROOT,
            )
        )
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    reference = {s: v for s, v in losses(single["base"]).items() if s <= 2}
    assert_losses_close(losses(tmp_path), reference, FP32_RTOL)
    assert read_metrics(tmp_path)[0]["world_size"] == 2


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """SIGTERM to `ligertune train --nproc-per-node 2` (a preemption): forwarded once through
    torchrun, every rank finishes the same step, they save one checkpoint together, and the
    launcher exits 143 (128 + SIGTERM)."""
    process = subprocess.Popen(
        _cli(
            "--nproc-per-node",
            "2",
            *TINY,
            *SHAPE_2,
            "parallel.strategy=fsdp",
            "training.max_steps=500",
            f"output_dir={tmp_path}",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step 3/500"):
                process.send_signal(signal.SIGTERM)
                break
        lines += process.stdout.readlines()
        process.wait(timeout=120)
    finally:
        process.kill()
    output = "".join(lines)
    assert process.returncode == 143, output[-3000:]
    summary = [r for r in read_metrics(tmp_path) if r["event"] == "summary"][-1]
    assert summary["stopped_by"] == "SIGTERM" and 3 <= summary["steps"] < 500
    saved = tmp_path / "checkpoints" / f"step-{summary['steps']}"
    assert (
        json.loads((saved / "state.json").read_text())["format"] == "dcp" and (saved / "COMPLETE").is_file()
    )


@pytest.mark.slow
def test_every_rank_names_itself_in_its_error(tmp_path):
    """A problem each rank hits only once it runs (the recipe itself is valid): every rank
    prints its error with its rank, and the job fails."""
    done, output = _ddp_run(tmp_path, "model.config_overrides={hidden_sizee: 64}")
    assert done.returncode != 0, output[-3000:]
    for rank in (0, 1):
        assert f"error: rank {rank}/2: invalid recipe" in output, output[-3000:]
    assert "did you mean hidden_size?" in output


@pytest.mark.slow
def test_ddp_says_why_it_did_not_evaluate_a_validation_split_smaller_than_the_world(tmp_path):
    """One validation row for two processes: every rank must evaluate a batch, so there is no
    evaluation; the start log and the summary say why (it used to be skipped silently)."""
    done, output = _ddp_run(
        tmp_path, "data.validation_fraction=0.001", "training.eval_every=1", "training.max_steps=2"
    )
    assert done.returncode == 0, output[-3000:]
    why = "the validation split has 1 row(s), fewer than the 2 processes"
    assert f"warning: no evaluation: {why}" in output
    assert f"n/a (not evaluated: {why}" in output
    summary = [r for r in read_metrics(tmp_path) if r["event"] == "summary"][-1]
    assert summary["eval_skipped"].startswith(why) and summary["eval_loss"] is None


@pytest.mark.slow
def test_bad_launch_options_fail_before_any_process_starts(tmp_path):
    # Recipe problems are found once, in the launcher: status 2, no torchrun.
    done = subprocess.run(
        _cli("--nproc-per-node", "2", *TINY, "parallel.strategy=ddpp"),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "parallel.strategy: got 'ddpp'" in done.stderr, done.stderr
    done = subprocess.run(_cli("--nproc-per-node", "2", *TINY), capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "add parallel.strategy=ddp" in done.stderr, done.stderr


# --------------------------------------------------------------------------------------------
# Launch options and commands (no processes)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def ddp_recipe():
    return load_recipe(QUICKSTART, TINY + ["parallel.strategy=ddp"])


def test_torchrun_commands(ddp_recipe, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    tail = ["-m", "ligertune", "train", "r.yaml", "training.lr=1"]

    def command(**options):
        opts = LaunchOptions(**options)
        check_options(opts, ddp_recipe)
        return torchrun_command(Path("r.yaml"), ["training.lr=1"], opts)[3:]

    assert command(nproc_per_node=4) == ["--nproc-per-node=4", "--nnodes=1", "--standalone", *tail]
    assert command(nproc_per_node=2, nnodes=3, rdzv_endpoint="node0:29500") == [
        "--nproc-per-node=2",
        "--nnodes=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500",
        *tail,
    ]
    assert command(nproc_per_node=2, nnodes=3, node_rank=2, rdzv_endpoint="10.0.0.1:29500") == [
        "--nproc-per-node=2",
        "--nnodes=3",
        "--rdzv-backend=static",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--node-rank=2",
        *tail,
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(nnodes=2, rdzv_endpoint="h:1"), "need --nproc-per-node"),
        (dict(nproc_per_node=0), "at least 1"),
        (dict(nproc_per_node=2, nnodes=2), "needs --rdzv-endpoint"),
        (dict(nproc_per_node=2, nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "--node-rank must be in 0..1"),
        (dict(nproc_per_node=2, node_rank=0), "--node-rank needs --rdzv-endpoint"),
        (dict(nproc_per_node=2, nnodes=2, rdzv_endpoint="node0"), "is not HOST:PORT"),
        (dict(nproc_per_node=2, nnodes=2, rdzv_endpoint="node0:http"), "is not HOST:PORT"),
    ],
)
def test_launch_option_errors(options, message, ddp_recipe, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(LaunchError, match=message):
        check_options(LaunchOptions(**options), ddp_recipe)


def test_no_launch_from_inside_torchrun_and_none_needs_a_strategy(ddp_recipe, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(LaunchError, match="itself started by torchrun"):
        check_options(LaunchOptions(nproc_per_node=2), ddp_recipe)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(LaunchError, match="add parallel.strategy=ddp"):
        check_options(LaunchOptions(nproc_per_node=2), load_recipe(QUICKSTART, TINY))
    check_options(LaunchOptions(nproc_per_node=1), load_recipe(QUICKSTART, TINY))  # one process is fine


# --------------------------------------------------------------------------------------------
# DeepSpeed config, checkpoint formats
# --------------------------------------------------------------------------------------------


def _ds_recipe(tmp_path, *overrides: str, user: dict | str | None = None):
    extra = []
    if user is not None:
        path = tmp_path / "ds.json"
        path.write_text(user if isinstance(user, str) else json.dumps(user))
        extra = [f"parallel.deepspeed.config={path}"]
    return load_recipe(QUICKSTART, TINY + ["parallel.strategy=deepspeed", *overrides, *extra])


def test_deepspeed_config_follows_the_recipe(tmp_path):
    config = deepspeed_config(
        _ds_recipe(
            tmp_path,
            "training.micro_batch_size=3",
            "training.gradient_accumulation_steps=5",
            "training.max_grad_norm=0.5",
            "training.precision=bf16-mixed",
            "training.device=auto",
            "parallel.deepspeed.zero_stage=2",
            "parallel.deepspeed.offload_optimizer=true",
        )
    )
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 5
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    assert config["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert "optimizer" not in config and "scheduler" not in config and "train_batch_size" not in config
    stage3 = deepspeed_config(
        _ds_recipe(tmp_path, "training.max_grad_norm=null", "parallel.deepspeed.offload_params=true")
    )
    assert stage3["gradient_clipping"] == 0.0 and stage3["bf16"] == {"enabled": False}
    assert stage3["zero_optimization"]["stage"] == 3 and "offload_param" in stage3["zero_optimization"]


def test_deepspeed_user_json_merges_and_may_not_contradict_the_recipe(tmp_path):
    user = {
        "zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 1000},
        "gradient_accumulation_steps": 1,  # the recipe's value: allowed
        "communication_data_type": "fp32",
    }
    config = deepspeed_config(_ds_recipe(tmp_path, user=user))
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 1000}
    assert config["communication_data_type"] == "fp32" and config["train_micro_batch_size_per_gpu"] == 4

    bad = {
        "optimizer": {"type": "Adam"},
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 2},
    }
    with pytest.raises(RecipeError) as error:
        deepspeed_config(_ds_recipe(tmp_path, user=bad))
    text = str(error.value)
    for expected in (
        "sets 'optimizer'",
        "'train_batch_size'",
        "train_micro_batch_size_per_gpu=8 but the recipe gives 4; change training.micro_batch_size",
        "zero_optimization.stage=2 but the recipe gives 3; change parallel.deepspeed.zero_stage",
    ):
        assert expected in text, text
    with pytest.raises(RecipeError, match="cannot read .* as JSON"):
        deepspeed_config(_ds_recipe(tmp_path, user="{not json"))
    with pytest.raises(RecipeError, match="must hold a JSON object"):
        deepspeed_config(_ds_recipe(tmp_path, user="[1, 2]"))


def test_deepspeed_refuses_bf16_master_weights(tmp_path):
    # A recipe rule (training.deepspeed_precision): refused as the recipe is read.
    with pytest.raises(RecipeError, match="set training.precision=bf16-mixed"):
        _ds_recipe(tmp_path, "training.precision=bf16", "training.device=auto")


def test_deepspeed_from_a_bf16_mixed_random_init_says_its_first_steps_move_less(tmp_path):
    """The run log's notice: only for a random init in bf16-mixed, where DeepSpeed rounds the
    init to bf16 before taking its master weights (docs/distributed.md)."""
    (tmp_path / "weights").mkdir()
    cases = {
        ("training.precision=bf16-mixed",): True,
        ("training.precision=fp32",): False,
        (
            "training.precision=bf16-mixed",
            "model.config=null",
            f"model.name_or_path={tmp_path / 'weights'}",
        ): False,
    }
    for overrides, expected in cases.items():
        runtime = DeepSpeedRuntime(_ds_recipe(tmp_path, "training.device=auto", *overrides))
        try:
            assert (runtime.notice is not None) == expected, overrides
            if expected:
                assert "bf16-rounded random init" in runtime.notice
                assert "docs/distributed.md#deepspeed-and-a-random-init" in runtime.notice
        finally:
            runtime.shutdown()


def test_fsdp_cpu_offload_needs_a_gpu(tmp_path):
    # A machine rule (parallel.fsdp_cpu_offload_needs_gpu): train refuses before any work.
    recipe = load_recipe(
        QUICKSTART,
        TINY + ["parallel.strategy=fsdp", "parallel.fsdp.cpu_offload=true", f"output_dir={tmp_path / 'run'}"],
    )
    with pytest.raises(RecipeError, match="needs training.device cuda"):
        train(recipe)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_of_another_strategy_is_refused_with_the_fix(tmp_path):
    sharded = Checkpoint(tmp_path, scheduler={}, rng=None, state={"step": 3, "format": "dcp"}, recipe_yaml="")
    with pytest.raises(RecipeError, match="parallel.strategy fsdp.*Resume with parallel.strategy=fsdp"):
        Runtime(torch.device("cpu")).load_state(sharded, torch.nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="'dcp' format .* has no model.pt"):
        sharded.model  # noqa: B018


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------


def _work(spec: Path) -> None:
    """Train each run of the spec in turn, in one process group: the runtime joins a group
    that exists and leaves it for the next run (a group destroyed and made again by ranks at
    different moments can mix up the two groups' rendezvous keys).

    Every call of the fused linear cross entropy is recorded with the shape of the lm_head
    weight it got, into ``flce-rank<R>.json`` of the run's directory: proof that the fused
    path ran (an HF fallback would compute nearly the same loss) on the gathered weight."""
    import torch.distributed as dist

    from ligertune.distributed.runtime import leave_process_groups
    from ligertune.kernels import fused_linear_cross_entropy as flce
    from ligertune.training import train

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    kernel, weight_shapes = flce.fused_linear_cross_entropy, []

    def recording(hidden, weight, *args, **kwargs):
        weight_shapes.append(list(weight.shape))
        return kernel(hidden, weight, *args, **kwargs)

    flce.fused_linear_cross_entropy = recording
    for run in json.loads(spec.read_text()):
        weight_shapes.clear()
        # A run is the quickstart's overrides, or {"recipe": path, "overrides": [...]}.
        base, overrides = (Path(run["recipe"]), run["overrides"]) if isinstance(run, dict) else (QUICKSTART, run)
        recipe = load_recipe(base, overrides)
        train(recipe)
        (recipe.run_dir / f"flce-rank{dist.get_rank()}.json").write_text(json.dumps(weight_shapes))
    leave_process_groups(synchronised=True)


if __name__ == "__main__":
    _work(Path(sys.argv[1]))
