"""`ligertune merge` and `ligertune export` through the CLI, on models short real runs produced:
the merge against the merged model training itself wrote (ligertune's own merge arithmetic,
`ligertune.lora.merged_state_dict`, against peft's), the export's dtype and what loads it, and an
upload that cannot happen (offline) failing in one line with the folder kept."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ligertune.cli import app
from ligertune.config import load_recipe
from ligertune.training import train
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL

RUN = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "checkpoint.export_hf=true",
    "training.max_steps=3",
    "data.validation_fraction=0.0",
]
runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoRA run whose training wrote final-merged/ too (moved aside as the oracle), and a full
    fine-tune."""
    root = tmp_path_factory.mktemp("publish")
    lora = [*RUN, "lora.r=4", "training.lr=1e-2", "export.merge_lora=true", f"output_dir={root / 'lora'}"]
    train(load_recipe(ROOT / "recipes" / "quickstart-lora.yaml", lora))
    shutil.move(root / "lora" / "final-merged", root / "merged-at-train-time")
    train(load_recipe(QUICKSTART, [*RUN, f"output_dir={root / 'full'}"]))
    return root


def test_merge_writes_the_model_training_would_have_merged(runs):
    done = runner.invoke(app, ["merge", str(runs / "lora")])
    assert done.exit_code == 0, done.output
    assert f"into its base: {runs / 'lora' / 'final-merged'}" in done.output
    ours = load_file(runs / "merged-at-train-time" / "model.safetensors")
    peft = load_file(runs / "lora" / "final-merged" / "model.safetensors")
    assert ours.keys() == peft.keys()
    for key, value in ours.items():
        torch.testing.assert_close(peft[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # The adapter moved the weights: the check compares trained models, not two copies of the base.
    base = load_file(runs / "full" / "final" / "model.safetensors")
    assert not torch.equal(
        ours["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert (runs / "lora" / "final-merged" / "recipe.yaml").is_file()


def test_merge_refuses_what_it_cannot_merge_and_what_it_would_overwrite(runs, tmp_path):
    full = runner.invoke(app, ["merge", str(runs / "full")])
    assert full.exit_code == 2 and "a full fine-tune's export is already a plain model" in full.output
    out = tmp_path / "merged"
    out.mkdir()
    taken = runner.invoke(app, ["merge", str(runs / "lora" / "final"), "--out", str(out)])
    assert taken.exit_code == 2 and "exists; choose another --out, or --force" in taken.output
    forced = runner.invoke(app, ["merge", str(runs / "lora" / "final"), "--out", str(out), "--force"])
    assert forced.exit_code == 0 and (out / "model.safetensors").is_file()


def test_export_writes_safetensors_in_the_dtype_asked_and_they_load(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    done = runner.invoke(app, ["export", str(runs / "full"), "--out", str(out), "--dtype", "bf16"])
    assert done.exit_code == 0, done.output
    weights = load_file(out / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    original = AutoModelForCausalLM.from_pretrained(runs / "full" / "final", dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(5, 2000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = original(ids).logits, exported(ids).logits
    assert (a - b).abs().max() < 0.1 and not torch.equal(a, b)  # bf16 rounding, nothing else
    assert (out / "recipe.yaml").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_export_push_to_hub_offline_fails_in_one_line_and_keeps_the_folder(runs, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "up"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ligertune",
            "export",
            str(runs / "lora"),
            "--out",
            str(out),
            "--push-to-hub",
            "me/tiny",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --push-to-hub: cannot upload to me/tiny: offline mode is on (HF_HUB_OFFLINE=1); the export is saved in {out}"
    ]
    assert (out / "model.safetensors").is_file()
    bad = runner.invoke(
        app, ["export", str(runs / "lora"), "--out", str(tmp_path / "x"), "--push-to-hub", "tiny"]
    )
    assert bad.exit_code == 2 and "owner/name" in bad.output and not (tmp_path / "x").exists()
