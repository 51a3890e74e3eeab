"""The hub at both ends of a run, without network: ``export.push_to_hub`` and ``ligertune download``
fail with one line naming the recipe key (offline mode, no token, no route to the hub), the
trained model staying saved; and ``download`` finds what a local Hugging Face cache holds, which
is huggingface_hub's own offline behaviour (HF_HUB_CACHE pointed at a folder laid out as the
cache is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ligertune.config import RecipeError, load_recipe
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL, pythonpath_with_root

TRAIN = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "checkpoint.export_hf=true",
    "training.max_steps=2",
    "training.device=cpu",
    "data.validation_fraction=0.0",
]


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """A command in a clean hub environment: its own HF_HOME (no stored token), no HF_TOKEN."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")
    }
    base |= {"PYTHONPATH": pythonpath_with_root(), "HF_HOME": str(tmp_path / "hf-home")}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=base | env, timeout=300)


def _cli(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "ligertune", *args], tmp_path, **env)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------------------------
# export.push_to_hub
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_push_to_hub_offline_fails_with_one_line_and_keeps_the_export(tmp_path):
    out = tmp_path / "run"
    done = _cli(
        "train",
        str(QUICKSTART),
        *TRAIN,
        "export.push_to_hub=someone/tiny-llama",
        f"output_dir={out}",
        tmp_path=tmp_path,
        HF_HUB_OFFLINE="1",
    )
    assert done.returncode == 1, done.stderr[-3000:]
    errors = _error_lines(done.stderr)
    assert len(errors) == 1, done.stderr[-3000:]
    assert "export.push_to_hub: cannot upload to someone/tiny-llama: offline mode is on" in errors[0]
    assert f"the export is saved in {out / 'final'}" in errors[0]
    assert "Traceback" not in done.stderr
    # The trained model is there, complete.
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "config.json").is_file()
    assert (out / "checkpoints" / "step-2" / "COMPLETE").is_file()


def _push(directory: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    code = (
        "import sys; from ligertune.training.export import push_to_hub; from ligertune.errors import TrainingError\n"
        "try: push_to_hub(sys.argv[1], 'someone/tiny-llama')\n"
        "except TrainingError as e: print(e, file=sys.stderr); sys.exit(3)\n"
    )
    return _run([sys.executable, "-c", code, str(directory)], tmp_path, **env)


def test_push_to_hub_without_a_token_says_how_to_log_in(tmp_path):
    (tmp_path / "export").mkdir()
    done = _push(tmp_path / "export", tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "export.push_to_hub: cannot upload to someone/tiny-llama: no Hugging Face token (set HF_TOKEN or run "
        f"`hf auth login`); the export is saved in {tmp_path / 'export'}"
    )


def test_push_to_hub_with_no_route_to_the_hub_is_one_line(tmp_path):
    """A token, but the hub unreachable (this machine has no route; an endpoint on a closed local
    port makes it so everywhere): the library's connection error, in one line with the key."""
    (tmp_path / "export").mkdir()
    done = _push(
        tmp_path / "export", tmp_path, HF_TOKEN="hf_not_a_real_token", HF_ENDPOINT="http://127.0.0.1:9"
    )
    assert done.returncode == 3, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("export.push_to_hub: upload to someone/tiny-llama failed: ")
    assert line.endswith(f"; the export is saved in {tmp_path / 'export'}")


def test_push_to_hub_is_a_repository_id_and_needs_the_export():
    with pytest.raises(RecipeError, match="a hub repository id is owner/name"):
        load_recipe(QUICKSTART, ["export.push_to_hub=just-a-name"])
    with pytest.raises(RecipeError, match="export.push_to_hub is set but checkpoint.export_hf is false"):
        load_recipe(QUICKSTART, ["export.push_to_hub=me/model", "checkpoint.export_hf=false"])
    recipe = load_recipe(QUICKSTART, ["export.push_to_hub=me/model"])
    assert recipe.export.push_to_hub == "me/model" and recipe.export.private is True


# --------------------------------------------------------------------------------------------
# ligertune download
# --------------------------------------------------------------------------------------------


def test_download_offline_names_the_key_in_one_line(tmp_path):
    cases = {
        "model.name_or_path": ["model.config=null", "model.name_or_path=someone/not-cached"],
        "data.path": ["data.path=someone/not-cached-dataset"],
    }
    for key, overrides in cases.items():
        done = _cli("download", str(QUICKSTART), *overrides, tmp_path=tmp_path, HF_HUB_OFFLINE="1")
        assert done.returncode == 1, (key, done.stdout, done.stderr[-3000:])
        errors = _error_lines(done.stderr)
        assert len(errors) == 1 and errors[0].startswith(f"error: {key}: downloading "), done.stderr[-3000:]
        assert "offline mode is on (HF_HUB_OFFLINE=1)" in errors[0] and "Traceback" not in done.stderr


def test_download_finds_a_cached_snapshot_offline(tmp_path):
    """huggingface_hub's cache layout (models--owner--name/{refs,snapshots}) under HF_HUB_CACHE:
    offline, snapshot_download answers from it, and so does download."""
    cache = tmp_path / "hub-cache"
    repo = cache / "models--someone--cached-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    done = _cli(
        "download",
        str(QUICKSTART),
        "model.config=null",
        "model.name_or_path=someone/cached-model",
        tmp_path=tmp_path,
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(cache),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model.name_or_path someone/cached-model: {snapshot}" in done.stdout.replace("\n", "")


def test_download_of_a_local_recipe_has_nothing_to_do(tmp_path):
    done = _cli("download", str(QUICKSTART), tmp_path=tmp_path, HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nothing to download" in done.stdout
