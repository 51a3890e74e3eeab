"""Commands that write a trained model out: `merge` (a LoRA run's adapter into its base) and
`export` (safetensors in a chosen dtype, optionally uploaded to the hub)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ligertune.cli.common import command, print_line, usage


@command()
def merge(
    run_or_adapter: str = typer.Argument(..., help="A LoRA run directory, or an adapter folder (final/)."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Where the merged model goes (default: final-merged/ beside the adapter)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace --out when it exists."),
) -> None:
    """Merge a LoRA run's adapter into the base its recipe builds: a plain Hugging Face model.

    What export.merge_lora does at the end of training, for a run that did not ask for it. The
    base is rebuilt from the run's recipe (the same pretrained weights, or the same seeded random
    init), in fp32 on the CPU; the merge is peft's. Exit status 2 when there is no adapter to
    merge or the output exists.

    [bold]Examples[/]

      ligertune merge runs/quickstart-lora

      ligertune merge runs/llama3-8b-alpaca-lora/final --out merged/llama3-8b-alpaca
    """
    from ligertune.tools.publish import merge as run_merge

    written = run_merge(run_or_adapter, out, force=force)
    what = written.source.adapter or written.source.checkpoint
    print_line(f"merged the adapter of {what} into its base: {written.directory} ({_dtype(written.dtype)})")


@command()
def export(
    run_or_model: str = typer.Argument(..., help="Run directory, model or adapter folder, checkpoint."),
    out: Path = typer.Option(..., "--out", "-o", help="The folder to write."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (as trained), bf16, fp16 or fp32."),
    push_to_hub: str | None = typer.Option(
        None, "--push-to-hub", help="Also upload the folder to this hub repository (owner/name)."
    ),
    private: bool = typer.Option(True, "--private/--public", help="A new hub repository's visibility."),
    force: bool = typer.Option(False, "--force", help="Replace --out when it exists."),
) -> None:
    """Write a trained model as a Hugging Face folder (safetensors, config, tokenizer, the run's
    recipe) in the dtype you choose, and upload it with --push-to-hub.

    Takes what generate takes: a run (its export, else its newest checkpoint), a LoRA adapter
    (merged into its base), a model folder. The upload uses HF_TOKEN or `hf auth login`; offline
    or without a token it fails at once and the folder stays. Exit status: 0 done, 1 the upload
    failed, 2 nothing to export or the output exists.

    [bold]Examples[/]

      ligertune export runs/quickstart --out exported/quickstart --dtype bf16

      ligertune export runs/quickstart-lora --out exported/lora --push-to-hub me/quickstart-lora
    """
    from ligertune.catalog.section import HUB_REPO_ID
    from ligertune.errors import ExternalError, TrainingError
    from ligertune.tools.publish import export as run_export
    from ligertune.training.export import push_to_hub as upload

    if push_to_hub is not None and not HUB_REPO_ID.fullmatch(push_to_hub):
        raise usage(f"--push-to-hub: got {push_to_hub!r}; a hub repository id is owner/name")
    written = run_export(run_or_model, out, dtype, force=force)
    print_line(f"exported {written.source.describe()} to {written.directory} ({_dtype(written.dtype)})")
    if push_to_hub is not None:
        try:
            url = upload(written.directory, push_to_hub, private=private)
        except TrainingError as e:
            raise ExternalError(str(e).replace("export.push_to_hub", "--push-to-hub")) from None
        print_line(f"uploaded to {escape(url)}")


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")
