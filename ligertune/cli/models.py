"""Commands about trained models: `generate` and `download`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ligertune.cli.common import command, console, err_console, print_line, usage
from ligertune.config import load_recipe


@command()
def generate(
    run_or_model: str = typer.Argument(
        ..., help="Run directory, Hugging Face model or LoRA adapter directory, or hub id."
    ),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="The prompt to complete."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(
        0.0, "--temperature", "-t", help="0: greedy (reproducible); > 0: sampling."
    ),
    format: str = typer.Option(
        "auto",
        "--format",
        "-f",
        help="How the prompt is put: auto (as the run was trained: its data format), alpaca, chat (the "
        "tokenizer's template) or raw.",
    ),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="--no-chat is --format raw."),
    interactive: bool = typer.Option(
        False, "--interactive", "-i", help="A conversation: one line in, one answer out, until EOF or /exit."
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let the model's own modeling code (auto_map) run; a recipe in a run directory cannot.",
    ),
    image: list[Path] = typer.Option(
        [], "--image", help="An image the prompt is about (vision-language models; repeat for several)."
    ),
) -> None:
    """Complete a prompt with a trained model: a quick sanity check of a run.

    A run directory uses its final-merged/ or final/ export (a LoRA run's adapter is merged into
    the base its recipe builds), or without one its newest intact checkpoint (the model rebuilt
    from the checkpoint's recipe). The prompt goes in the way the run was trained: the Alpaca prompt for
    an alpaca run, the chat template for a conversation format, the raw text otherwise (--format
    to choose). Runs on the GPU when there is one, else on the CPU. Prints the completion only
    (and says so when it is empty). Exit status 2 when the model cannot be found or loaded.
    Nothing loaded runs code unless --trust-remote-code is given (README: "What is safe to load").

    With --interactive, each line read is a user turn: a chat-format model sees the conversation
    so far (/reset starts a new one), the others each line on its own; /exit or end of input
    stops.

    [bold]Examples[/]

      ligertune generate runs/quickstart --prompt "Give three tips for staying healthy."

      ligertune generate runs/quickstart-lora --prompt "Name a colour." --format chat

      ligertune generate runs/quickstart/final --prompt "Once upon a time" --no-chat -n 40

      ligertune generate runs/my-chat-run --interactive

      ligertune generate runs/quickstart-vl --image photo.png --prompt "What is in the image?"
    """
    from ligertune.tools.generate import Generator

    if prompt is None and not interactive:
        raise usage("give --prompt, or --interactive for a conversation")
    if image and interactive:
        raise usage("--image goes with --prompt; --interactive takes text only")
    generator = Generator(run_or_model, format=format, chat=chat, trust_remote_code=trust_remote_code)
    for line in generator.source.passed_over:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    how = {"chat": "chat template", "alpaca": "Alpaca prompt", "raw": "plain prompt"}[generator.format]
    err_console.print(
        f"[dim]{escape(generator.source.describe())} on {generator.device}, {how}[/]",
        highlight=False,
        soft_wrap=True,
    )
    if interactive:
        _converse(generator, prompt, max_new_tokens, temperature)
        return
    images = [str(path) for path in image]
    result = generator.complete([{"role": "user", "content": prompt}], max_new_tokens, temperature, images)
    _print_completion(result.completion)


def _print_completion(completion: str) -> None:
    if not completion.strip():
        err_console.print(
            "[yellow]the completion is empty:[/] the model's first token was its end of turn or EOS (a model "
            "trained briefly, or a prompt format it was not trained on: see --format)",
            highlight=False,
            soft_wrap=True,
        )
    console.print(completion, markup=False, highlight=False, soft_wrap=True)


def _converse(generator, first: str | None, max_new_tokens: int, temperature: float) -> None:
    """--interactive: a user turn per line of input; chat models see the whole conversation."""
    import itertools
    import sys

    messages: list[dict] = []
    lines = iter(sys.stdin.readline, "")  # line by line: a terminal's input as it comes
    if first is not None:
        lines = itertools.chain([first], lines)
    while True:
        if sys.stdin.isatty():
            err_console.print("[bold]you>[/] ", end="")
        line = next(lines, None)
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        result = generator.complete(
            messages if generator.format == "chat" else messages[-1:], max_new_tokens, temperature
        )
        messages.append({"role": "assistant", "content": result.completion})
        _print_completion(result.completion)


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
