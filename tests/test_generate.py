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
from ligertune.data.chat import stop_tokens
from ligertune.data.formats import alpaca_prompt
from ligertune.tools.generate import GenerateError, Generator, generate, resolve_source
from ligertune.training import train
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL, pythonpath_with_root

# Real runs of every strategy (fsdp, ZeRO-3, LoRA) behind the fixtures: outside the quick subset.
pytestmark = pytest.mark.slow

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


def test_an_alpaca_run_is_prompted_as_it_was_trained(runs):
    """The quickstart trains on alpaca: generate puts the prompt in the Alpaca template (it used to
    send an alpaca-trained model the chat template), read from the recipe the export carries."""
    from transformers import AutoTokenizer

    final = runs / "run" / "final"
    assert (final / "recipe.yaml").is_file()
    result = generate(str(runs / "run"), PROMPT, max_new_tokens=12, device=torch.device("cpu"))
    assert result.format == "alpaca" and result.prompt_text == alpaca_prompt(PROMPT)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer(alpaca_prompt(PROMPT), return_tensors="pt")["input_ids"]
    assert result.completion == tokenizer.decode(_reference(final, ids, 12), skip_special_tokens=True)


def test_a_run_directory_generates_with_its_export_and_the_chat_template(runs):
    from transformers import AutoTokenizer

    final = runs / "run" / "final"
    assert resolve_source(str(runs / "run")).model == str(final)
    result = generate(str(runs / "run"), PROMPT, max_new_tokens=12, device=torch.device("cpu"), format="chat")
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template and result.chat
    expected_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    assert result.prompt_text == expected_text != PROMPT
    ids = tokenizer(expected_text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    reference = _reference(final, ids, 12)
    # A chat prompt also stops at the template's end of turn (<|im_end|>), as the model was trained.
    end = [i for i, t in enumerate(reference.tolist()) if t in stop_tokens(tokenizer)]
    reference = reference[: end[0] + 1] if end else reference
    assert result.completion == tokenizer.decode(reference, skip_special_tokens=True)


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
    with pytest.raises(GenerateError, match="neither a run directory nor a Hugging Face model or adapter"):
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
    assert "Alpaca prompt" in done.stderr and "Loading weights" not in done.stderr


def test_the_command_fails_with_one_line_for_a_hub_id_offline():
    done = _cli("generate", "someone/not-in-the-cache", "--prompt", "hi", HF_HUB_OFFLINE="1")
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot load 'someone/not-in-the-cache'" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------------------------
# LoRA runs, empty completions, conversations
# --------------------------------------------------------------------------------------------

LORA = [*RUN, "lora.r=4", "lora.alpha=8", "training.lr=1e-2", "export.merge_lora=true"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A LoRA run with its exports (final/: the adapter, final-merged/), and copies of it with the
    adapter only and with checkpoints only."""
    root = tmp_path_factory.mktemp("lora")
    train(load_recipe(ROOT / "recipes" / "quickstart-lora.yaml", LORA + [f"output_dir={root / 'run'}"]))
    shutil.copytree(root / "run", root / "adapter", ignore=shutil.ignore_patterns("final-merged", "run.lock"))
    shutil.copytree(root / "run", root / "checkpoint", ignore=shutil.ignore_patterns("final*", "run.lock"))
    return root


def test_a_lora_run_generates_from_its_merged_export_its_adapter_and_its_checkpoint(lora_runs):
    """`generate runs/x/final` on a LoRA run said "no config.json": the adapter is merged into the
    base its recipe builds. All three sources are the same trained model: the same completion."""
    cpu = torch.device("cpu")
    merged = generate(str(lora_runs / "run"), PROMPT, max_new_tokens=12, device=cpu)
    assert merged.source.model == str(lora_runs / "run" / "final-merged")
    adapter = generate(str(lora_runs / "adapter" / "final"), PROMPT, max_new_tokens=12, device=cpu)
    assert adapter.source.adapter == lora_runs / "adapter" / "final"
    checkpoint = generate(str(lora_runs / "checkpoint"), PROMPT, max_new_tokens=12, device=cpu)
    assert checkpoint.source.checkpoint is not None
    assert merged.completion == adapter.completion == checkpoint.completion
    assert merged.format == "alpaca"


def test_the_command_generates_from_a_lora_adapter_folder(lora_runs):
    done = _cli("generate", str(lora_runs / "adapter" / "final"), "--prompt", PROMPT, "-n", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "merged into its recipe's base" in done.stderr and "Alpaca prompt" in done.stderr


def test_an_empty_completion_says_so(tmp_path):
    """A model trained to answer nothing (empty outputs: the prompt and the EOS after it train;
    rows that teach nothing else need data.train_on_inputs) stops at once; the command says the
    completion is empty instead of printing a blank line alone."""
    data = tmp_path / "empty.jsonl"
    data.write_text("".join(f'{{"instruction": "Say nothing {i}.", "output": ""}}\n' for i in range(8)))
    overrides = [
        *RUN,
        f"data.path={data}",
        "data.train_on_inputs=true",
        "training.max_steps=30",
        "training.lr=3e-2",
        "data.packing=false",
    ]
    train(load_recipe(QUICKSTART, [*overrides, f"output_dir={tmp_path / 'run'}"]))
    done = _cli("generate", str(tmp_path / "run"), "--prompt", "Say nothing 1.", "-n", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the completion is empty" in done.stderr and not done.stdout.strip()


def test_interactive_keeps_the_conversation_for_chat_models(runs):
    """--interactive: a chat-format model sees the conversation so far; /reset starts over."""
    generator = Generator(str(runs / "run"), device=torch.device("cpu"), format="chat")
    first = generator.complete([{"role": "user", "content": "Hi"}], max_new_tokens=4)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.completion},
        {"role": "user", "content": "And then?"},
    ]
    assert generator.complete(history, max_new_tokens=4).prompt_text.count("<|im_start|>user") == 2
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ligertune",
            "generate",
            str(runs / "run"),
            "-i",
            "--format",
            "chat",
            "-n",
            "4",
        ],
        input="Hi\nAnd then?\n/reset\nHi\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath_with_root()},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = first.completion + "\n"
    assert done.stdout.startswith(expected) and done.stdout.count(expected) >= 2  # "Hi" after /reset
