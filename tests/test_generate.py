"""`ligertune generate` on models a real short training run produced: the run directory (its
final/ export), the export folder itself, and a run without an export (its newest checkpoint,
rebuilt from the checkpoint's recipe; "full" and fsdp "dcp" formats), chat template and plain
prompt. The completions are checked against transformers' own greedy generation from the export.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from ligertune.config import load_recipe
from ligertune.tools.generate import GenerateError, generate, resolve_source
from ligertune.training import train
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL, pythonpath_with_root

PROMPT = "Give three tips for staying healthy."
RUN = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "checkpoint.export_hf=true",
    "training.max_steps=3",
    "training.device=cpu",
    "data.validation_fraction=0.0",
]


DEEPSPEED = ["parallel.strategy=deepspeed", "training.precision=fp32"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A quickstart run (exported, checkpointed at its end), the same run without its export,
    and fsdp and ZeRO-3 runs of one process ("dcp" and "deepspeed" checkpoints), their exports
    moved aside."""
    root = tmp_path_factory.mktemp("generate")
    train(load_recipe(QUICKSTART, RUN + [f"output_dir={root / 'run'}"]))
    shutil.copytree(root / "run", root / "no-export", ignore=shutil.ignore_patterns("final", "run.lock"))
    train(load_recipe(QUICKSTART, RUN + ["parallel.strategy=fsdp", f"output_dir={root / 'fsdp'}"]))
    shutil.move(root / "fsdp" / "final", root / "fsdp-final")
    # ZeRO-3 in a job of one process, built inside zero.Init (sharded init): a "deepspeed" checkpoint.
    train(load_recipe(QUICKSTART, RUN + DEEPSPEED + [f"output_dir={root / 'deepspeed'}"]))
    shutil.move(root / "deepspeed" / "final", root / "deepspeed-final")
    return root


def _reference(model_dir, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy generation from the export, the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, prompt_ids.shape[1] :]


def test_a_run_directory_generates_with_its_export_and_the_chat_template(runs):
    from transformers import AutoTokenizer

    final = runs / "run" / "final"
    assert resolve_source(str(runs / "run")).model == str(final)
    result = generate(str(runs / "run"), PROMPT, max_new_tokens=12, device=torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template and result.chat
    expected_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert result.prompt_text == expected_text != PROMPT
    ids = tokenizer(expected_text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert result.completion == tokenizer.decode(_reference(final, ids, 12), skip_special_tokens=True)
    assert result.completion.strip()


def test_a_model_directory_generates_from_the_plain_prompt_with_no_chat(runs):
    from transformers import AutoTokenizer

    final = runs / "run" / "final"
    result = generate(
        str(final), "Once upon a time", max_new_tokens=8, chat=False, device=torch.device("cpu")
    )
    assert not result.chat and result.prompt_text == "Once upon a time"
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    assert result.completion == tokenizer.decode(_reference(final, ids, 8), skip_special_tokens=True)


@pytest.mark.parametrize(
    ("run", "export"), [("no-export", "run/final"), ("fsdp", "fsdp-final"), ("deepspeed", "deepspeed-final")]
)
def test_a_run_without_an_export_generates_from_its_newest_checkpoint(runs, run, export):
    source = resolve_source(str(runs / run))
    assert source.checkpoint == runs / run / "checkpoints" / "step-3"
    from_checkpoint = generate(str(runs / run), PROMPT, max_new_tokens=12, device=torch.device("cpu"))
    # The checkpoint holds the weights the export holds: the same greedy completion.
    from_export = generate(str(runs / export), PROMPT, max_new_tokens=12, device=torch.device("cpu"))
    assert from_checkpoint.completion == from_export.completion
    assert from_checkpoint.prompt_text == from_export.prompt_text


def test_sampling_follows_the_temperature(runs):
    torch.manual_seed(0)
    first = generate(
        str(runs / "run"), PROMPT, max_new_tokens=12, temperature=1.5, device=torch.device("cpu")
    )
    torch.manual_seed(0)
    again = generate(
        str(runs / "run"), PROMPT, max_new_tokens=12, temperature=1.5, device=torch.device("cpu")
    )
    greedy = generate(str(runs / "run"), PROMPT, max_new_tokens=12, device=torch.device("cpu"))
    assert first.completion == again.completion != greedy.completion


def test_what_cannot_be_generated_from_is_one_clear_error(tmp_path):
    with pytest.raises(GenerateError, match="no such run or model directory"):
        resolve_source(str(tmp_path / "missing"))
    with pytest.raises(GenerateError, match="neither a run directory nor a Hugging Face model"):
        resolve_source(str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(GenerateError, match="neither a final/ export nor a complete checkpoint"):
        resolve_source(str(tmp_path))
    with pytest.raises(GenerateError, match="--max-new-tokens must be positive"):
        generate(str(tmp_path), "hi", max_new_tokens=0)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ligertune", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath_with_root(), **env},
        timeout=300,
    )


def test_the_zero3_build_leaves_transformers_zero3_mode_off(runs):
    """The HfDeepSpeedConfig that makes transformers build inside zero.Init lives for the build
    only: a later from_pretrained in the process (the generation above) must load normally."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()


def test_the_command_prints_the_completion(runs):
    expected = generate(str(runs / "run"), PROMPT, max_new_tokens=12, device=torch.device("cpu")).completion
    done = _cli("generate", str(runs / "run"), "--prompt", PROMPT, "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip("\n") == expected
    assert "chat template" in done.stderr and "Loading weights" not in done.stderr


def test_the_command_fails_with_one_line_for_a_hub_id_offline():
    done = _cli("generate", "someone/not-in-the-cache", "--prompt", "hi", HF_HUB_OFFLINE="1")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot load 'someone/not-in-the-cache'" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
