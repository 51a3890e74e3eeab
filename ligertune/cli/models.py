"""Commands about trained models: `generate` and `download`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ligertune.cli.common import command, console, err_console, print_line
from ligertune.config import load_recipe


@command()
def generate(
    run_or_model: str = typer.Argument(..., help="Run directory, Hugging Face model directory, or hub id."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt to complete."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(
        0.0, "--temperature", "-t", help="0: greedy (reproducible); > 0: sampling."
    ),
    chat: bool = typer.Option(
        True,
        "--chat/--no-chat",
        help="Send the prompt through the tokenizer's chat template (when it has one).",
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let the model's own modeling code (auto_map) run; a recipe in a run directory cannot.",
    ),
) -> None:
    """Complete a prompt with a trained model: a quick sanity check of a run.

    A run directory uses its final/ export, or without one its newest intact checkpoint (the model
    rebuilt from the checkpoint's recipe). Runs on the GPU when there is one, else on the CPU.
    Prints the completion only. Exit status 2 when the model cannot be found or loaded. Nothing
    loaded runs code unless --trust-remote-code is given (README: "What is safe to load").

    [bold]Examples[/]

      ligertune generate runs/quickstart --prompt "Give three tips for staying healthy."

      ligertune generate runs/quickstart/final --prompt "Once upon a time" --no-chat -n 40

      ligertune generate meta-llama/Llama-3.2-1B-Instruct --prompt "Hi" --temperature 0.7
    """
    from ligertune.tools.generate import generate as run_generate

    result = run_generate(
        run_or_model,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        chat=chat,
        trust_remote_code=trust_remote_code,
    )
    for line in result.source.passed_over:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    how = "chat template" if result.chat else "plain prompt"
    err_console.print(
        f"[dim]{escape(result.source.describe())} on {result.device}, {how}[/]",
        highlight=False,
        soft_wrap=True,
    )
    console.print(result.completion, markup=False, highlight=False, soft_wrap=True)


@command()
def download(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides, e.g. model.revision=main."),
) -> None:
    """Download what a recipe takes from the Hugging Face Hub into the HF cache: the model (weights,
    config, tokenizer), a separate tokenizer, hub datasets. Then `train` runs without network
    (HF_HUB_OFFLINE=1). Prints where each went.

    Exit status: 0 done (or nothing to download), 1 a download failed (offline, no access, no such
    repository), 2 bad recipe.

    [bold]Example[/]

      ligertune download recipes/llama3-8b-alpaca.yaml
    """
    from ligertune.tools.hub import download as run_download

    done = run_download(load_recipe(recipe, overrides or []), report=print_line)
    if not done:
        console.print(
            "nothing to download: the recipe's model, tokenizer and data are local", highlight=False
        )
