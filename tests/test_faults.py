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

from ligertune.config import RecipeError, load_recipe
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


def _train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _records(run_dir) if r["event"] == "train"]


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
    assert _train_steps(tmp_path) == [1, 2, 3, 4, 3, 4, 5, 6]  # killed after logging step 4
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
    assert _train_steps(tmp_path) == [1, 2, 3, 4, 3, 4]


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
    assert _train_steps(run_dir) == [1, 2, 3, 4, 3, 4]


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
