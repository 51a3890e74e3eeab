"""The CLI shell: exit codes, no tracebacks for user errors, help with examples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BROKEN = Path(__file__).resolve().parent / "recipes"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ligertune", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=120,
    )


def test_validate_shipped_recipe_prints_resolved_yaml():
    proc = cli("validate", "recipes/llama3-8b-alpaca.yaml", "training.lr=1e-5", "-f", "yaml")
    assert proc.returncode == 0, proc.stderr
    assert "lr: 1.0e-05" in proc.stdout
    assert "strategy: fsdp" in proc.stdout


@pytest.mark.parametrize(
    "name", ["unknown_key.yaml", "missing_file.yaml", "not_yaml.yaml", "loss_kernel_conflict.yaml"]
)
def test_validate_broken_recipe_exits_2_without_traceback(name):
    proc = cli("validate", str(BROKEN / name))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert name in proc.stderr


def test_validate_missing_recipe_file():
    proc = cli("validate", "no/such/recipe.yaml")
    assert proc.returncode == 2
    assert "recipe file not found: no/such/recipe.yaml" in proc.stderr


def test_recipes_lists_and_copies(tmp_path):
    listing = cli("recipes")
    assert listing.returncode == 0
    assert "llama3-8b-alpaca" in listing.stdout and "FSDP2" in listing.stdout
    dest = tmp_path / "mine.yaml"
    copied = cli("recipes", "cp", "llama3.2-1b-alpaca", str(dest))
    assert copied.returncode == 0, copied.stderr
    # The copy runs under its own name (runs/mine), not the original's; every other line as shipped.
    original = (ROOT / "recipes" / "llama3.2-1b-alpaca.yaml").read_text()
    assert dest.read_text() == original.replace("name: llama3.2-1b-alpaca\n", "name: mine\n")
    assert "name: mine" in copied.stdout and "runs/mine" in copied.stdout
    resolved = cli("validate", str(dest), "-f", "yaml")
    assert resolved.returncode == 0 and "name: mine" in resolved.stdout
    again = cli("recipes", "cp", "llama3.2-1b-alpaca", str(dest))
    assert again.returncode == 2 and "not overwriting" in again.stderr
    typo = cli("recipes", "cp", "llama3-8b-alpca", str(tmp_path))
    assert typo.returncode == 2 and "did you mean llama3-8b-alpaca?" in typo.stderr


def test_env_reports_versions_and_kernel_mode():
    proc = cli("env")
    assert proc.returncode == 0
    for name in ("torch", "triton", "transformers", "datasets", "deepspeed", "kernels"):
        assert name in proc.stdout


@pytest.mark.parametrize("command", ["validate", "recipes", "env"])
def test_help_shows_examples(command):
    proc = cli(command, "--help")
    assert proc.returncode == 0
    assert "Example" in proc.stdout


def test_version_and_completion_options():
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == "ligertune 0.1.0"
    helped = cli("--help")
    assert helped.returncode == 0
    for option in ("--install-completion", "--show-completion", "--quiet", "--verbose", "--version"):
        assert option in helped.stdout
    both = cli("--quiet", "--verbose", "env")
    assert both.returncode == 2 and "contradict" in both.stderr


def test_a_shipped_recipe_name_stands_for_its_file(tmp_path):
    proc = cli("validate", "quickstart", "llama3-8b-alpaca.yaml", "-f", "none", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "✓ quickstart" in proc.stdout and "✓ llama3-8b-alpaca.yaml" in proc.stdout
    # A local file of that name wins over the shipped recipe.
    (tmp_path / "quickstart").write_text("not: [valid\n")
    local = cli("validate", "quickstart", cwd=tmp_path)
    assert local.returncode == 2 and "not valid YAML" in local.stderr
    unknown = cli("validate", "quickstrat", cwd=tmp_path)
    assert unknown.returncode == 2 and "recipe file not found: quickstrat" in unknown.stderr


def test_errors_are_not_wrapped_at_80_columns_when_piped(tmp_path):
    long = tmp_path / ("a-rather-long-folder-name-" * 4) / "recipe.yaml"
    proc = cli("validate", str(long))
    assert proc.returncode == 2
    assert f"recipe file not found: {long}" in proc.stderr  # one line, whole


def test_recipes_says_which_extra_a_recipe_needs(monkeypatch):
    """A deepspeed recipe on a machine without deepspeed is not 'invalid', and the extra's
    brackets are printed, not read as rich markup."""
    import importlib.util

    from typer.testing import CliRunner

    from ligertune.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    result = CliRunner().invoke(app, ["recipes"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "qwen2.5-7b-alpaca-deepspeed " in line)
    assert "DeepSpeed ZeRO-3" in line  # the description, read from the file
    assert "needs the deepspeed extra: pip install 'ligertune[deepspeed]'" in line
    assert "invalid" not in result.output


@pytest.mark.slow
def test_train_prints_no_third_party_noise_and_verbose_says_what_it_hid(tmp_path):
    """transformers imports torchao and accelerate imports deepspeed whenever they are installed
    (the dev extra installs both), and their import-time warnings reached every command even with
    -q. Our logging set-up filters them; -v shows each as a debug line marked hidden."""
    import importlib.util

    from tests.helpers import PLAIN_RUN, TINY_MODEL

    args = [
        "train",
        "quickstart",
        *TINY_MODEL,
        *PLAIN_RUN,
        "training.max_steps=2",
        "checkpoint.export_hf=true",
    ]
    quiet = cli("-q", *args, f"output_dir={tmp_path / 'quiet'}", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    for noise in ("Failed to load", "register_constant", "Setting accelerator to CPU", "Traceback"):
        assert noise not in quiet.stdout + quiet.stderr
    verbose = cli("-v", *args, f"output_dir={tmp_path / 'verbose'}", cwd=tmp_path)
    assert verbose.returncode == 0, verbose.stderr
    assert "hiding known third-party warnings" in verbose.stdout
    if importlib.util.find_spec("deepspeed") is not None:
        assert "(hidden warning of DeepSpeed) Setting accelerator to CPU" in verbose.stdout


def test_help_wraps_at_the_terminal_not_at_the_docstring_lines():
    """A help paragraph is one line that rich wraps to the terminal; it used to keep the
    docstring's source line breaks and cut sentences at any width. Examples keep their lines."""
    import os

    wide = subprocess.run(
        [sys.executable, "-m", "ligertune", "train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
        timeout=120,
    )
    assert wide.returncode == 0, wide.stderr
    assert "nodes) the run is launched through torchrun, one process per GPU; the recipe's" in wide.stdout
    lines = [line.rstrip() for line in wide.stdout.splitlines()]
    assert "   ligertune train recipes/quickstart.yaml" in lines


def test_recipes_names_the_qlora_extra_for_qlora_recipes_when_peft_is_missing():
    """On a machine without peft (simulated: the import system finds no peft), `ligertune recipes`
    says what to install for each recipe: the qlora extra (peft and bitsandbytes) for a QLoRA
    recipe, the lora extra for a LoRA one."""
    without_peft = "import sys; sys.modules['peft'] = None; from ligertune.cli import main; main()"
    import os

    listing = subprocess.run(
        [sys.executable, "-c", without_peft, "recipes"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},  # one table row per recipe
    )
    assert listing.returncode == 0, listing.stderr
    rows = {line.split("│")[1].strip(): line for line in listing.stdout.splitlines() if line.count("│") >= 3}
    assert "pip install 'ligertune[qlora]'" in rows["llama3-8b-alpaca-qlora"]
    assert "pip install 'ligertune[lora]'" in rows["quickstart-lora"]


def test_validate_reads_the_first_rows_of_the_data_as_train_would(tmp_path):
    """validate used to pass data that train rejects: it now reads the head of every local source
    and checks the format's columns and fields (with the data.columns mapping), cheaply."""
    import json

    wrong = cli("validate", "quickstart", f"data.path={ROOT / 'tests' / 'data' / 'wrong_columns.jsonl'}")
    assert wrong.returncode == 2
    assert "wrong_columns.jsonl: data.format alpaca expects columns instruction, output" in wrong.stderr
    assert "data.columns: {instruction: ..., output: ...}" in wrong.stderr

    csv_file = tmp_path / "qa.csv"
    csv_file.write_text("question,answer\nName a colour.,Blue.\n")
    mapped = cli(
        "validate",
        "quickstart",
        f"data.path={csv_file}",
        "data.columns={instruction: question, output: answer}",
    )
    assert mapped.returncode == 0, mapped.stderr
    misnamed = cli(
        "validate", "quickstart", f"data.path={csv_file}", "data.columns={instruction: query, output: answer}"
    )
    assert misnamed.returncode == 2
    assert "data.columns maps instruction: query, but the dataset has no column 'query'" in misnamed.stderr

    chat = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello."}]}]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    roles = cli("validate", "quickstart", f"data.path={chat}", "data.format=chat")
    assert roles.returncode == 2 and "row 0: message 1 of messages is from 'bot'" in roles.stderr
    checked = cli(
        "validate",
        "quickstart",
        f"data.path={chat}",
        "data.format=chat",
        "data.roles={bot: assistant}",
        "--check",
    )
    assert checked.returncode == 0, checked.stderr
    assert "data.path (" in checked.stdout and "the first 1 rows tokenise to" in checked.stdout
    broken = cli("validate", "quickstart", f"data.path={ROOT / 'tests' / 'data' / 'malformed.jsonl'}")
    assert broken.returncode == 2 and "malformed.jsonl: line 2 is not valid JSON" in broken.stderr
    hub = cli("validate", "recipes/llama3-8b-alpaca.yaml", "-f", "none")
    assert hub.returncode == 0 and "tatsu-lab/alpaca is a hub dataset" in hub.stdout
