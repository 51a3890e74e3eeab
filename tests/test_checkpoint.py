"""Checkpoints: round trip, atomic save under a real kill, pruning, RNG states, the manifest
and verification, a full disk."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ligertune.errors import TrainingError
from ligertune.run.checkpoint import CheckpointManager, atomic_directory, load_checkpoint, restore_rng_state
from ligertune.run.manifest import COMPLETE, MANIFEST, DamagedCheckpoint, verify_checkpoint


def _save(manager: CheckpointManager, step: int, value: float) -> Path:
    return manager.save(
        step,
        model={"w": torch.full((3, 2), value), "b": torch.arange(4)},
        optimizer={
            "state": {0: {"exp_avg": torch.full((3,), value)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        scheduler={"last_epoch": step},
        state={"epoch": 1, "batch_index": step * 2},
        recipe_yaml=f"name: step{step}\n",
    )


def test_round_trip(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3)
    path = _save(manager, 7, 1.5)
    assert path == tmp_path / "checkpoints" / "step-7" and (path / COMPLETE).is_file()
    ckpt = load_checkpoint(path)
    assert ckpt.step == 7 and ckpt.state["batch_index"] == 14 and ckpt.state["epoch"] == 1
    assert torch.equal(ckpt.model["w"], torch.full((3, 2), 1.5)) and torch.equal(
        ckpt.model["b"], torch.arange(4)
    )
    assert torch.equal(ckpt.optimizer["state"][0]["exp_avg"], torch.full((3,), 1.5))
    assert ckpt.scheduler == {"last_epoch": 7} and ckpt.recipe_yaml == "name: step7\n"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keep_last_prunes_oldest_and_latest_is_newest_complete(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (5, 10, 15, 20):
        _save(manager, step, float(step))
    assert [p.name for p in manager.complete()] == ["step-15", "step-20"]
    # Steps sort numerically, not as text ("step-100" after "step-20").
    _save(manager, 100, 1.0)
    assert manager.latest().name == "step-100"
    # A directory without the marker, or a half-written temporary one, is never picked.
    (tmp_path / "step-500").mkdir()
    (tmp_path / ".tmp-step-600").mkdir()
    assert manager.latest().name == "step-100"
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(tmp_path / "step-500")
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "step-7")


def test_saving_the_same_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    _save(manager, 3, 1.0)
    _save(manager, 3, 2.0)
    assert torch.equal(load_checkpoint(tmp_path / "step-3").model["w"], torch.full((3, 2), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def test_a_failing_save_leaves_the_previous_directory(tmp_path):
    final = tmp_path / "final"
    with atomic_directory(final) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(final) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("disk full")
    assert (final / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


_SLOW_SAVER = """
import sys, time, torch
from pathlib import Path
from ligertune.run.checkpoint import CheckpointManager

root = Path(sys.argv[1])
manager = CheckpointManager(root, keep_last=2)
def save(step):
    manager.save(step, model={"w": torch.full((64, 64), float(step))}, optimizer={}, scheduler={},
                 state={"epoch": 0, "batch_index": step}, recipe_yaml="name: x\\n")
save(1)
real_save = torch.save
def slow_save(obj, path, *args, **kwargs):
    real_save(obj, path, *args, **kwargs)
    print("WROTE", path, flush=True)
    time.sleep(60)  # the parent kills us here, half way through checkpoint 2
torch.save = slow_save
save(2)
"""


def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SLOW_SAVER), str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "WROTE" in line and ".tmp-step-2" in line, line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert (root / ".tmp-step-2" / "model.pt").is_file()  # the half-written save is really there
    manager = CheckpointManager(root, keep_last=2)
    assert manager.latest() == root / "step-1"
    assert torch.equal(load_checkpoint(root / "step-1").model["w"], torch.full((64, 64), 1.0))
    # The next successful save clears the leftover.
    _save(manager, 3, 3.0)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-3"]


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    manager = CheckpointManager(tmp_path, keep_last=1)
    _save(manager, 1, 0.0)  # captures the RNG states at save time; loaded back with weights_only=True
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(load_checkpoint(tmp_path / "step-1").rng)
    again = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert expected[0] == again[0] and expected[1] == again[1] and torch.equal(expected[2], again[2])


def test_the_manifest_records_every_file_and_verification_finds_each_kind_of_damage(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    path = _save(manager, 4, 1.0)
    manifest = json.loads((path / MANIFEST).read_text())
    files = sorted(p.name for p in path.iterdir() if p.name not in (MANIFEST, COMPLETE))
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == files
    assert manifest["files"]["model.pt"]["size"] == (path / "model.pt").stat().st_size
    verify_checkpoint(path)

    model = path / "model.pt"
    whole = model.read_bytes()
    model.write_bytes(whole[:-10])
    with pytest.raises(
        DamagedCheckpoint,
        match=rf"checkpoint {path} is damaged: model.pt has {len(whole) - 10} bytes, {len(whole)} were saved",
    ):
        verify_checkpoint(path)
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 1
    model.write_bytes(bytes(flipped))
    with pytest.raises(DamagedCheckpoint, match="model.pt does not match the sha256"):
        verify_checkpoint(path)
    model.unlink()
    with pytest.raises(DamagedCheckpoint, match="model.pt is missing"):
        verify_checkpoint(path)
    model.write_bytes(whole)
    (path / MANIFEST).write_text("{")
    with pytest.raises(DamagedCheckpoint, match=f"{MANIFEST} cannot be read"):
        verify_checkpoint(path)


def test_a_checkpoint_without_a_manifest_loads_and_is_verified_as_far_as_it_can_be(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    path = _save(manager, 4, 2.0)
    (path / MANIFEST).unlink()  # as saved before manifests existed
    verify_checkpoint(path)
    assert torch.equal(load_checkpoint(path).model["w"], torch.full((3, 2), 2.0))

    optimizer = path / "optimizer.pt"
    whole = optimizer.read_bytes()
    optimizer.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DamagedCheckpoint, match="optimizer.pt is not a whole torch file"):
        verify_checkpoint(path)
    with pytest.raises(
        DamagedCheckpoint, match=rf"checkpoint {path} is damaged: optimizer.pt cannot be loaded"
    ):
        load_checkpoint(path).optimizer  # noqa: B018
    optimizer.write_bytes(whole)
    (path / "state.json").write_text('{"step": 4,')
    with pytest.raises(DamagedCheckpoint, match=rf"checkpoint {path} is damaged: state.json cannot be read"):
        verify_checkpoint(path)
    with pytest.raises(DamagedCheckpoint, match="state.json cannot be read"):
        load_checkpoint(path)


def test_a_record_that_fails_its_crc_is_found_without_a_manifest(tmp_path):
    """Same size, a flipped byte inside a tensor: torch.load would read it silently."""
    path = _save(CheckpointManager(tmp_path, keep_last=3), 1, 3.0)
    (path / MANIFEST).unlink()
    model = path / "model.pt"
    data = bytearray(model.read_bytes())
    data[data.index(torch.full((3, 2), 3.0).numpy().tobytes())] ^= 0x40
    model.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match="model.pt: its record .* fails its CRC check"):
        verify_checkpoint(path)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_during_a_save_removes_the_partial_one_and_names_the_last_good_one(
    tmp_path, monkeypatch, code
):
    manager = CheckpointManager(tmp_path, keep_last=1)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", lambda obj, path: _write_partially(path, code))
        with pytest.raises(
            TrainingError,
            match=rf"on {tmp_path} while saving step 1; no earlier checkpoint exists; free space",
        ):
            _save(manager, 1, 1.0)
    good = _save(manager, 2, 2.0)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", lambda obj, path: _write_partially(path, code))
        with pytest.raises(TrainingError) as error:
            _save(manager, 3, 3.0)
    what = "no space left" if code == errno.ENOSPC else "disk quota exceeded"
    assert str(error.value) == (
        f"{what} on {tmp_path} while saving step 3; the last good checkpoint {good} is intact; free space and resume"
    )
    assert isinstance(error.value.__cause__, OSError) and error.value.__cause__.errno == code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]  # no .tmp-step-3 left
    verify_checkpoint(good)


def _write_partially(path, code: int) -> None:
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 half a file")
    raise OSError(code, os.strerror(code), str(path))
