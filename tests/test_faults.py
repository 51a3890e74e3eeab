"""Real faults against real runs: a kill -9 in the middle of a save, a damaged checkpoint that
still carries its marker, two runs on one output_dir, a full disk, a torn metrics line.

Each run is a `ligertune train` subprocess (or `train` in this process where a fault has to be
injected), on the quickstart shrunk to a 2-layer, hidden-64 Llama: a few seconds each. Faults
inside a subprocess come in through the public plugin extension point (``plugins:``), like
tests/compare_faults.py: `stall_in_save_of_step_4` below is such a plugin.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ligertune.config import RecipeError, load_recipe
from ligertune.paths import ASSETS_DIR
from ligertune.run.checkpoint import MODEL_FILE, load_checkpoint
from ligertune.run.lock import LOCK_FILE
from ligertune.run.manifest import MANIFEST, verify_checkpoint
from ligertune.training import TrainingError, train
from tests.helpers import QUICKSTART, ROOT, pythonpath_with_root
from tests.test_train import TINY as TRAIN_TINY

TINY = [*TRAIN_TINY, "checkpoint.every_steps=2", "checkpoint.keep_last=3"]
STALL_PLUGIN = "plugins=[tests.test_faults:stall_in_save_of_step_4]"


def stall_in_save_of_step_4(model, recipe) -> None:
    """A plugin: the save of step 4 writes its model file, says so, and hangs (to be killed)."""
    real_save = torch.save

    def stalling_save(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        if isinstance(path, Path) and path.parent.name == ".tmp-step-4":
            print(f"STALLED after writing {path}", flush=True)
            time.sleep(600)

    torch.save = stalling_save


def _cli(output_dir: Path, *overrides: str) -> subprocess.Popen:
    # Without TRITON_INTERPRET, as in test_train: kernels are off anyway, and a CLI run stays fast.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = pythonpath_with_root()  # the plugin lives in tests/
    env["COLUMNS"] = "10000"  # rich wraps error messages at the terminal width; the tests match whole lines
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ligertune",
            "train",
            str(QUICKSTART),
            *TINY,
            f"output_dir={output_dir}",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _run(output_dir: Path, *overrides: str) -> tuple[int, str]:
    proc = _cli(output_dir, *overrides)
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl, every line a JSON object (json.loads fails the test on a torn one)."""
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def _train_steps(run_dir: Path, superseded: bool = False) -> list[int]:
    """The steps of the train records, as the model lived them (`superseded`: those a resume
    replayed instead, marked so in the file)."""
    return [
        r["step"]
        for r in _records(run_dir)
        if r["event"] == "train" and bool(r.get("superseded")) == superseded
    ]


# --------------------------------------------------------------------------------------------
# kill -9 during a save
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_during_a_save_then_resume_auto_finishes_the_run(tmp_path):
    """A real `ligertune train` killed with SIGKILL while step 4 is being saved: step 2 stays
    the newest checkpoint, the lock dies with the process, and the next run resumes from
    step 2 and finishes (test_checkpoint kills a bare CheckpointManager; this is the CLI)."""
    proc = _cli(tmp_path, "training.max_steps=6", STALL_PLUGIN)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "STALLED" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the run ended before its step-4 save"
        assert "STALLED" in line and ".tmp-step-4" in line, line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / ".tmp-step-4" / MODEL_FILE).is_file()  # really killed half way
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-2"]
    assert (tmp_path / LOCK_FILE).is_file()  # left behind by the dead run, and no obstacle:

    code, output = _run(tmp_path, "training.max_steps=6")
    assert code == 0, output
    assert f"resumed from {checkpoints / 'step-2'} (step 2" in output
    # Killed after logging step 4: the resume replays steps 3 and 4, whose first records are marked.
    assert _train_steps(tmp_path) == [1, 2, 3, 4, 5, 6] and _train_steps(tmp_path, superseded=True) == [3, 4]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4", "step-6"]
    verify_checkpoint(checkpoints / "step-6")


# --------------------------------------------------------------------------------------------
# A damaged checkpoint that still carries its COMPLETE marker
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_truncated_checkpoint_is_passed_over_by_auto_and_refused_by_name(tmp_path):
    code, output = _run(tmp_path, "training.max_steps=4")
    assert code == 0, output
    checkpoints = tmp_path / "checkpoints"
    damaged = checkpoints / "step-4"
    size = (damaged / MODEL_FILE).stat().st_size
    os.truncate(damaged / MODEL_FILE, size // 2)

    # Named explicitly: a recipe error (status 2) naming the key, the checkpoint and the file.
    code, output = _run(tmp_path, "training.max_steps=6", f"checkpoint.resume={damaged}")
    assert code == 2, output
    assert "checkpoint.resume:" in output and str(damaged) in output
    assert f"{MODEL_FILE} has {size // 2} bytes, {size} were saved" in output
    assert "Traceback" not in output and not (checkpoints / "step-6").exists()

    # auto: warns in the run log naming the bad one and why, resumes from the newest intact one.
    code, output = _run(tmp_path, "training.max_steps=6")
    assert code == 0, output
    warning = output.index(f"warning: checkpoint {damaged} is damaged: {MODEL_FILE} has {size // 2} bytes")
    assert warning < output.index(f"resumed from {checkpoints / 'step-2'} (step 2")
    assert _train_steps(tmp_path)[-4:] == [3, 4, 5, 6]
    verify_checkpoint(damaged)  # the resumed run saved step 4 again, whole this time


def test_every_checkpoint_damaged_is_refused_not_started_over(tmp_path):
    first = train(load_recipe(QUICKSTART, TINY + [f"output_dir={tmp_path}", "training.max_steps=2"]))
    model = first.checkpoint / MODEL_FILE
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the digest sees it
    model.write_bytes(bytes(data))
    with pytest.raises(RecipeError, match=r"auto found no intact checkpoint(.|\n)*does not match the sha256"):
        train(load_recipe(QUICKSTART, TINY + [f"output_dir={tmp_path}", "training.max_steps=4"]))
    assert model.read_bytes() == bytes(data)  # nothing pruned, nothing overwritten


def test_a_damaged_checkpoint_without_a_manifest_is_refused_by_name(tmp_path):
    """Saved before manifests existed: still resumable when whole; a truncated file is named."""
    recipe = lambda *o: load_recipe(QUICKSTART, TINY + [f"output_dir={tmp_path}", *o])  # noqa: E731
    path = train(recipe("training.max_steps=2")).checkpoint
    (path / MANIFEST).unlink()
    assert train(recipe("training.max_steps=3", f"checkpoint.resume={path}")).steps == 3
    optimizer = path / "optimizer.pt"
    os.truncate(optimizer, optimizer.stat().st_size - 100)
    with pytest.raises(
        RecipeError, match=rf"checkpoint.resume: checkpoint {path} is damaged: optimizer.pt is not a whole"
    ):
        train(recipe("training.max_steps=4", f"checkpoint.resume={path}"))


# --------------------------------------------------------------------------------------------
# Two runs on one output_dir
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_on_a_busy_output_dir_is_refused_and_the_first_is_untouched(tmp_path):
    first = _cli(tmp_path, "training.max_steps=100000", "checkpoint.every_steps=5")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None:
            metrics = tmp_path / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count('"event": "train"') >= 2:
                break
            time.sleep(0.2)
        assert first.poll() is None, first.stdout.read()
        started = time.monotonic()
        code, output = _run(tmp_path, "training.max_steps=100000", "checkpoint.every_steps=1")
        refused_in = time.monotonic() - started
        assert first.poll() is None, "the first run must still be running"
        first.send_signal(signal.SIGTERM)
        first_output, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert code == 1, output
    assert f"{tmp_path} is in use by another run (pid {first.pid} on " in output, output
    assert "Traceback" not in output and refused_in < 60
    assert first.returncode == 128 + signal.SIGTERM, first_output
    records = _records(tmp_path)
    assert [r["event"] for r in records].count("start") == 1  # the second run wrote nothing
    steps = _train_steps(tmp_path)
    assert steps == list(range(1, len(steps) + 1))
    saved = sorted((tmp_path / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    assert load_checkpoint(saved[-1]).step == steps[-1]  # the first run's own stop save
    assert all(int(p.name[5:]) % 5 == 0 for p in saved[:-1])  # no save of the second run's every_steps=1


def test_a_run_directory_is_locked_in_one_process_too(tmp_path):
    from ligertune.run.lock import RunLock

    lock = RunLock.acquire(tmp_path)
    with pytest.raises(TrainingError, match=rf"{tmp_path} is in use by another run \(pid {os.getpid()} on "):
        train(load_recipe(QUICKSTART, TINY + [f"output_dir={tmp_path}", "training.max_steps=1"]))
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    lock.release()
    assert (
        train(load_recipe(QUICKSTART, TINY + [f"output_dir={tmp_path}", "training.max_steps=1"])).steps == 1
    )


# --------------------------------------------------------------------------------------------
# Disk full
# --------------------------------------------------------------------------------------------


def _assert_full_disk_kept_step_2(error: str, checkpoints: Path) -> None:
    assert (
        f"no space left on {checkpoints} while saving step 4; the last good checkpoint "
        f"{checkpoints / 'step-2'} is intact; free space and resume"
    ) in error
    assert not list(checkpoints.glob(".tmp-*")), "the partial save is removed"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    verify_checkpoint(checkpoints / "step-2")


@pytest.mark.slow
def test_enospc_during_a_save_is_a_training_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """The injected version (always runs): the save of step 4 writes half a file and meets
    ENOSPC, as a write to a full disk does."""
    real_save = torch.save

    def save_onto_a_full_disk(obj, path, *args, **kwargs):
        if Path(path).parent.name == ".tmp-step-4":
            Path(path).write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_save(obj, path, *args, **kwargs)

    recipe = lambda: load_recipe(QUICKSTART, TINY + [f"output_dir={tmp_path}", "training.max_steps=4"])  # noqa: E731
    monkeypatch.setattr(torch, "save", save_onto_a_full_disk)
    with pytest.raises(TrainingError) as error:
        train(recipe())
    _assert_full_disk_kept_step_2(str(error.value), tmp_path / "checkpoints")
    monkeypatch.setattr(torch, "save", real_save)
    assert train(recipe()).steps == 4
    assert _train_steps(tmp_path) == [1, 2, 3, 4] and _train_steps(tmp_path, superseded=True) == [3, 4]


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MiB tmpfs (needs root and a mount namespace that allows it; skipped otherwise)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small filesystem (the injected ENOSPC test still runs)")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({proc.stderr.strip() or proc.returncode}; needs root): "
            "the injected ENOSPC test still covers the path"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return filler


@pytest.mark.slow
def test_a_really_full_disk_during_a_save_says_so_and_resume_finishes(small_disk):
    """torch.save on a full tmpfs raises a bare RuntimeError ("unexpected pos"): reported as a
    full disk, exit 1, no traceback; step 2 stays; once space is freed the run resumes."""
    run_dir = small_disk / "run"
    code, output = _run(run_dir, "training.max_steps=2")
    assert code == 0, output
    filler = _fill(small_disk, leave=256 * 1024)  # room for the log lines, not for a checkpoint
    code, output = _run(run_dir, "training.max_steps=4")
    assert code == 1, output
    assert "Traceback" not in output
    _assert_full_disk_kept_step_2(output, run_dir / "checkpoints")
    filler.unlink()
    code, output = _run(run_dir, "training.max_steps=4")
    assert code == 0, output
    assert _train_steps(run_dir) == [1, 2, 3, 4] and _train_steps(run_dir, superseded=True) == [3, 4]


@pytest.mark.slow
def test_a_disk_full_mid_metrics_line_is_repaired_on_resume(small_disk):
    """Filled to the last byte: the metrics writer fails (possibly half way through a line, a
    short write), the run stops with exit 1 saying why; after freeing space the resumed run's
    metrics.jsonl is valid JSON lines again."""
    run_dir = small_disk / "run"
    code, output = _run(run_dir, "training.max_steps=2")
    assert code == 0, output
    filler = small_disk / "filler"
    with filler.open("wb", buffering=0) as f:  # every last byte: unbuffered writes until ENOSPC
        with pytest.raises(OSError) as full:
            while True:
                f.write(b"\0" * 65536)
        assert full.value.errno == errno.ENOSPC
    # No checkpoint before the end: the metrics lines fill the last page of the file, then fail.
    code, output = _run(run_dir, "training.max_steps=200", "checkpoint.every_steps=null")
    assert code == 1, output
    assert f"no space left on {run_dir} while writing metrics.jsonl" in output and "Traceback" not in output
    torn = not (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")
    filler.unlink()
    code, output = _run(run_dir, "training.max_steps=4")
    assert code == 0, output
    assert ("has no newline" in output) == torn
    _records(run_dir)  # every line parses
    assert _train_steps(run_dir)[-2:] == [3, 4]


# --------------------------------------------------------------------------------------------
# A torn metrics.jsonl line
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_torn_metrics_line_is_removed_on_resume_with_a_warning(tmp_path):
    code, output = _run(tmp_path, "training.max_steps=2")
    assert code == 0, output
    metrics = tmp_path / "metrics.jsonl"
    whole = metrics.read_bytes()
    torn = b'{"event": "train", "step": 3, "loss": 7.'
    metrics.write_bytes(whole + torn)  # what a kill mid-write leaves
    code, output = _run(tmp_path, "training.max_steps=4")
    assert code == 0, output
    assert f"warning: the last line of {metrics} has no newline" in output
    assert metrics.read_bytes().startswith(whole) and torn not in metrics.read_bytes()
    assert _train_steps(tmp_path) == [1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# What a received run directory can hold: planted pickles, custom code, links (README: "What is
# safe to load"). Each pickle here is live: `_Planted` creates its marker file when unpickled,
# which `test_the_planted_pickles_are_live` shows; the tests then check that it never does.
# --------------------------------------------------------------------------------------------


class _Planted:
    """Unpickled, it writes `marker` (what a planted ``__reduce__`` calling os.system would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _invoke(*args: str) -> tuple[int, str]:
    """The CLI in this process (Typer's runner): exit status and everything it printed."""
    from typer.testing import CliRunner

    from ligertune.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "10000"})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.output


def _train_cli(output_dir: Path, *overrides: str) -> tuple[int, str]:
    return _invoke("train", QUICKSTART, *TINY, f"output_dir={output_dir}", *overrides)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A run of 4 steps checkpointed at steps 2 and 4 ("full" format), without an export:
    the tests copy it and plant things in the copy."""
    run_dir = tmp_path_factory.mktemp("four-steps") / "run"
    train(load_recipe(QUICKSTART, TINY + [f"output_dir={run_dir}", "training.max_steps=4"]))
    return run_dir


def _copy_run(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(LOCK_FILE))
    return target


def _plant(checkpoint: Path, fmt: str, payload: bytes | object, name: str) -> None:
    """Turn a copied checkpoint into one of format `fmt` whose file `name` holds `payload`, with
    a manifest that matches (whoever planted it can write one too)."""
    from ligertune.run.manifest import write_manifest

    state = json.loads((checkpoint / "state.json").read_text())
    (checkpoint / "state.json").write_text(json.dumps({**state, "format": fmt}))
    for old in ("model.pt", "optimizer.pt", MANIFEST):
        (checkpoint / old).unlink()
    (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(payload, bytes):
        (checkpoint / name).write_bytes(payload)
    else:
        torch.save(payload, checkpoint / name)
    write_manifest(checkpoint)


def test_the_planted_pickles_are_live(tmp_path):
    """The control: the payloads below do run code when unpickled the usual way."""
    import pickle

    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Planted(marker)))
    assert marker.read_text() == "ran"
    marker.unlink()
    torch.save({"module": _Planted(marker)}, tmp_path / "x.pt")
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(
    ("fmt", "name"),
    [("dcp", "dcp/.metadata"), ("deepspeed", "deepspeed/zero_pp_rank_0_mp_rank_00_model_states.pt")],
)
def test_generate_never_unpickles_a_planted_sharded_checkpoint(four_steps, tmp_path, fmt, name):
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    run_dir, marker = _copy_run(four_steps, tmp_path), tmp_path / "ran"
    shutil.rmtree(run_dir / "checkpoints" / "step-2")
    planted = _Planted(marker)
    payload = (
        pickle.dumps(Metadata({}, planner_data=planted, storage_data={})) if fmt == "dcp" else {"x": planted}
    )
    _plant(run_dir / "checkpoints" / "step-4", fmt, payload, name)
    code, output = _invoke("generate", run_dir, "--prompt", "hi", "-n", "2")
    assert code == 2 and "Traceback" not in output, output
    assert f"{name} is refused" in output and "exec" in output, output
    assert not marker.exists()


def test_resume_never_unpickles_a_planted_dcp_checkpoint(four_steps, tmp_path):
    """FSDP's resume reads DCP metadata without pickle: a checkpoint whose metadata names code
    is refused (exit 2), the code never runs, and nothing is trained or saved."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    run_dir, marker = _copy_run(four_steps, tmp_path), tmp_path / "ran"
    shutil.rmtree(run_dir / "checkpoints" / "step-2")
    _plant(
        run_dir / "checkpoints" / "step-4",
        "dcp",
        pickle.dumps(Metadata({}, planner_data=_Planted(marker), storage_data={})),
        "dcp/.metadata",
    )
    code, output = _train_cli(run_dir, "training.max_steps=6", "parallel.strategy=fsdp")
    assert code == 2 and "Traceback" not in output, output
    assert "checkpoint.resume:" in output and "dcp/.metadata is refused: it names builtins.exec" in output
    assert not marker.exists() and not (run_dir / "checkpoints" / "step-6").exists()


def test_a_dcp_value_that_names_code_is_refused(tmp_path):
    """The other pickle DCP reads: a non-tensor value (the optimizer's param-group settings) is
    read with weights_only=True, so one that names code is refused."""
    import torch.distributed.checkpoint as dcp

    from ligertune.run.manifest import DamagedCheckpoint
    from ligertune.run.safe_load import dcp_load

    marker = tmp_path / "ran"
    directory = tmp_path / "step-1" / "dcp"
    dcp.save({"weight": torch.ones(2), "settings": {"lr": _Planted(marker)}}, checkpoint_id=directory)
    state = {"weight": torch.zeros(2), "settings": {"lr": 0.0}}
    with pytest.raises(DamagedCheckpoint, match=r"the saved value of settings\.lr is refused"):
        dcp_load(state, directory)
    assert not marker.exists()
    dcp.save({"weight": torch.ones(2), "settings": {"lr": 0.5}}, checkpoint_id=tmp_path / "ok" / "dcp")
    dcp_load(state, tmp_path / "ok" / "dcp")  # plain values load
    assert state["settings"]["lr"] == 0.5 and torch.equal(state["weight"], torch.ones(2))


def _custom_code_model(folder: Path, marker: Path) -> Path:
    """A model folder (with the bundled tokenizer) whose config names its own code (auto_map),
    code that writes `marker`."""
    shutil.copytree(ASSETS_DIR / "tokenizer", folder)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "planted", "auto_map": {"AutoConfig": "planted.PlantedConfig"}})
    )
    (folder / "planted.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return folder


def test_custom_code_runs_only_with_trust_remote_code_on_the_command_line(four_steps, tmp_path):
    """A checkpoint's recipe.yaml that says model.trust_remote_code: true cannot grant it; nor can
    a model folder's config. Only --trust-remote-code, given here, lets the code run."""
    run_dir, marker = _copy_run(four_steps, tmp_path), tmp_path / "ran"
    model = _custom_code_model(tmp_path / "model", marker)
    checkpoint = run_dir / "checkpoints" / "step-4"
    recipe = yaml.safe_load((checkpoint / "recipe.yaml").read_text())
    recipe["model"] = {
        **recipe["model"],
        "config": None,
        "name_or_path": str(model),
        "trust_remote_code": True,
    }
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (checkpoint / MANIFEST).unlink()  # verified as far as it can be without one
    for source in (run_dir, model):
        code, output = _invoke("generate", source, "--prompt", "hi", "-n", "2")
        assert code == 2 and "Traceback" not in output, output
        assert "pass --trust-remote-code if you trust that code" in output, output
        assert not marker.exists()
    code, output = _invoke("generate", model, "--prompt", "hi", "-n", "2", "--trust-remote-code")
    assert marker.read_text() == "ran", output  # the flag, and only the flag, lets it run


# -- links in the run directory ----------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "run.lock",
        "metrics.jsonl",
        "train.log",
        "checkpoints",
        "checkpoints/step-2",
        "final",
        "tensorboard",
        "wandb-run-id",
        ".tmp-final",
    ],
)
def test_a_link_where_a_run_writes_is_refused_before_any_work(tmp_path, entry):
    run_dir = tmp_path / "run"
    (run_dir / entry).parent.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    (run_dir / entry).symlink_to(target)
    code, output = _train_cli(run_dir, "training.max_steps=2")
    assert code == 2 and "Traceback" not in output, output
    assert f"output_dir: {run_dir / entry} is a symbolic link (to {target})" in output
    assert target.read_text() == "precious\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [Path(entry).parts[0]]  # nothing written


def plant_links_mid_run(model, recipe) -> None:
    """A plugin: after the run's up-front check, links appear in its directory: final/ (the
    export's place) and checkpoints/step-1 (an old checkpoint to prune), each to a folder
    outside, and metrics.jsonl when the recipe's name asks for it."""
    outside = recipe.run_dir.parent / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "COMPLETE").write_text("1\n")
    (recipe.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (recipe.run_dir / "checkpoints" / "step-1").symlink_to(outside)
    (recipe.run_dir / "final").symlink_to(outside)
    if recipe.name == "metrics-link":
        (outside / "metrics.jsonl").write_text("precious\n")
        (recipe.run_dir / "metrics.jsonl").symlink_to(outside / "metrics.jsonl")


def test_links_planted_mid_run_are_never_followed(tmp_path):
    """Export replaces a link at final/ (the link goes, not what it points at), pruning passes a
    linked checkpoint by, and a linked metrics.jsonl stops the run in one line."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    plugin = "plugins=[tests.test_faults:plant_links_mid_run]"
    code, output = _train_cli(
        run_dir, plugin, "training.max_steps=4", "checkpoint.keep_last=1", "checkpoint.export_hf=true"
    )
    assert code == 0, output
    assert (run_dir / "final").is_dir() and not (run_dir / "final").is_symlink()
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "checkpoints" / "step-1").is_symlink()  # not ours: neither loaded nor pruned
    assert sorted(p.name for p in outside.iterdir()) == ["COMPLETE"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-4"]

    shutil.rmtree(run_dir)
    shutil.rmtree(outside)
    code, output = _train_cli(run_dir, plugin, "name=metrics-link", "training.max_steps=2")
    assert code == 1 and "Traceback" not in output, output
    assert (
        f"cannot write the run's logs in {run_dir}: {run_dir / 'metrics.jsonl'} is a symbolic link" in output
    )
    assert (outside / "metrics.jsonl").read_text() == "precious\n"


# -- read-only output_dir mid-run ---------------------------------------------------------------


def _read_only_now(folder: Path, read_only: bool = True) -> None:
    """Make `folder` refuse new files (or accept them again): a read-only bind mount over itself
    as root (chmod does not stop root), a chmod of its folders otherwise. Files already open stay
    writable, as on a real remount."""
    if os.geteuid() == 0 and read_only:
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
    elif os.geteuid() == 0:
        subprocess.run(["umount", str(folder)], capture_output=True)
    else:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o555 if read_only else 0o755)


def read_only_after_step_3(model, recipe) -> None:
    """A plugin: the run directory becomes read-only during step 3 (its 3rd forward)."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            _read_only_now(recipe.run_dir)

    model.register_forward_hook(hook)


@pytest.fixture
def writable_again(tmp_path):
    """Undo `_read_only_now` on the run directory whatever the test's outcome."""
    run_dir = tmp_path / "run"
    if os.geteuid() == 0:
        probe = tmp_path / "probe"
        probe.mkdir()
        if subprocess.run(["mount", "--bind", str(probe), str(probe)], capture_output=True).returncode:
            pytest.skip("no bind mounts here (root without CAP_SYS_ADMIN): cannot make a folder read-only")
        subprocess.run(["umount", str(probe)], check=True)
    yield run_dir
    _read_only_now(run_dir, read_only=False)  # a no-op when the test did it already


def test_an_output_dir_made_read_only_mid_run_is_one_line_and_resumes(writable_again):
    run_dir = writable_again
    code, output = _train_cli(
        run_dir, "plugins=[tests.test_faults:read_only_after_step_3]", "training.max_steps=6"
    )
    assert code == 1 and "Traceback" not in output, output
    checkpoints = run_dir / "checkpoints"
    assert f"cannot save step 4 in {checkpoints}: " in output
    assert f"the last good checkpoint {checkpoints / 'step-2'} is intact; fix that and resume" in output
    _read_only_now(run_dir, read_only=False)
    code, output = _train_cli(run_dir, "training.max_steps=6")
    assert code == 0, output
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5, 6] and _train_steps(run_dir, superseded=True) == [3, 4]


# -- checkpoints that are damaged or incomplete ------------------------------------------------


def test_generate_passes_over_a_damaged_newest_checkpoint(four_steps, tmp_path):
    run_dir = _copy_run(four_steps, tmp_path)
    damaged = run_dir / "checkpoints" / "step-4"
    size = (damaged / MODEL_FILE).stat().st_size
    os.truncate(damaged / MODEL_FILE, size // 2)
    code, output = _invoke("generate", run_dir, "--prompt", "hi", "-n", "3")
    assert code == 0, output
    assert f"warning: checkpoint {damaged} is damaged: {MODEL_FILE} has {size // 2} bytes" in output
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-2'} on cpu" in output
    os.truncate(run_dir / "checkpoints" / "step-2" / MODEL_FILE, 10)
    code, output = _invoke("generate", run_dir, "--prompt", "hi")
    assert code == 2 and f"{run_dir} has no intact checkpoint: checkpoint {damaged} is damaged" in output


def test_without_manifests_a_missing_optimizer_is_passed_over_and_a_missing_rng_file_warned(
    four_steps, tmp_path
):
    """Checkpoints saved before manifests existed: the newest lacks its optimizer file, so
    resume: auto takes the older one, whose RNG file is missing (a warning, not a refusal)."""
    run_dir = _copy_run(four_steps, tmp_path)
    checkpoints = run_dir / "checkpoints"
    for step in ("step-2", "step-4"):
        (checkpoints / step / MANIFEST).unlink()
    (checkpoints / "step-4" / "optimizer.pt").unlink()
    (checkpoints / "step-2" / "rng-rank0.pt").unlink()
    code, output = _train_cli(run_dir, "training.max_steps=5")
    assert code == 0 and "Traceback" not in output, output
    assert (
        f"warning: checkpoint {checkpoints / 'step-4'} is damaged: optimizer.pt is missing; passed over it, "
        f"resuming from {checkpoints / 'step-2'}"
    ) in output
    assert f"warning: {checkpoints / 'step-2'} has no rng-rank0.pt: the random state" in output
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5] and _train_steps(run_dir, superseded=True) == [3, 4]


# -- the data changed between a stop and a resume ----------------------------------------------


def test_a_resume_on_changed_data_is_refused_or_restarts_the_epoch_when_asked(tmp_path):
    data = tmp_path / "data.jsonl"
    lines = (ASSETS_DIR / "alpaca_sample.jsonl").read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:200]))
    run_dir, cache = tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}"
    code, output = _train_cli(run_dir, f"data.path={data}", cache, "training.max_steps=2")
    assert code == 0, output
    data.write_text("".join(lines[:240]))  # 40 rows appended
    code, output = _train_cli(run_dir, f"data.path={data}", cache, "training.max_steps=4")
    assert code == 2 and "Traceback" not in output, output
    step_2 = run_dir / "checkpoints" / "step-2"
    assert (
        f"data: the data is not what {step_2} was trained on (200 train samples then, 240 train samples now)"
        in output
    )
    code, output = _train_cli(
        run_dir, f"data.path={data}", cache, "training.max_steps=4", "checkpoint.data_changed=restart_epoch"
    )
    assert code == 0, output
    assert "checkpoint.data_changed=restart_epoch: epoch 1 starts over on the new data at step 2" in output
    assert f"resumed from {step_2} (step 2, epoch 0, micro-batch 0)" in output


# -- a damaged data cache entry ----------------------------------------------------------------


def test_a_damaged_data_cache_entry_is_verified_reported_and_rebuilt(tmp_path):
    """preprocess verifies an existing entry (sizes and digests in its meta) instead of saying
    "already cached" about a broken one; train reports and rebuilds it too; a link in an entry's
    place is replaced, never followed."""
    cache = tmp_path / "cache"
    args = ("preprocess", QUICKSTART, *TINY, f"data.cache_dir={cache}")
    code, output = _invoke(*args)
    assert code == 0 and "\ncached: " in f"\n{output}", output
    (entry,) = cache.iterdir()
    code, output = _invoke(*args)
    assert code == 0 and f"already cached: {entry}" in output, output

    arrow = next(entry.rglob("*.arrow"))
    size = arrow.stat().st_size
    os.truncate(arrow, size // 2)
    code, output = _invoke(*args)
    assert code == 0 and "Traceback" not in output, output
    damaged = f"{arrow.relative_to(entry)} has {size // 2} bytes, {size} were saved (truncated)"
    assert f"warning: the data cache entry {entry} is damaged: {damaged}; rebuilding it" in output
    assert f"cached: {entry}" in output and "already cached" not in output
    code, output = _invoke(*args)
    assert f"already cached: {entry}" in output

    (entry / "meta.json").write_text("{not json")
    code, output = _train_cli(tmp_path / "run", f"data.cache_dir={cache}", "training.max_steps=1")
    assert code == 0 and f"the data cache entry {entry} is damaged: meta.json cannot be read" in output

    outside = tmp_path / "outside"
    entry.rename(outside)
    entry.symlink_to(outside)
    code, output = _invoke(*args)
    assert code == 0 and "is damaged: it is a symbolic link" in output, output
    assert entry.is_dir() and not entry.is_symlink() and (outside / "meta.json").is_file()
