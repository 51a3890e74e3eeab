"""The `eval` command: lm-evaluation-harness tasks on a trained model."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ligertune.cli.common import command, console, print_line, usage


@command("eval")
def evaluate(
    recipe_or_run: str = typer.Argument(
        ..., help="A recipe (its run is scored), a run directory, a model or adapter folder, or a hub id."
    ),
    tasks: str | None = typer.Option(
        None,
        "--tasks",
        help="Comma list of lm-eval task names or local task YAML files (default: the recipe's eval.tasks).",
    ),
    limit: int | None = typer.Option(None, "--limit", help="Score at most this many examples per task."),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="Few-shot examples per prompt."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per forward."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Also write the scores to this JSON file."
    ),
) -> None:
    """Score a trained model on lm-evaluation-harness tasks (pip install 'ligertune[eval]').

    A recipe scores its run's model (runs/<name>: the export, else the newest checkpoint), with
    the recipe's eval.tasks unless --tasks names others. Task names lm-eval knows need their
    datasets from the hub; local task files (lm-eval's YAML) work offline, their data files
    relative to them; ligertune://eval/tiny_qa.yaml is a tiny bundled one. Runs on the GPU when
    there is one. Exit status 2 when the model or a task cannot be loaded.

    [bold]Examples[/]

      ligertune eval runs/quickstart --tasks ligertune://eval/tiny_qa.yaml

      ligertune eval recipes/llama3-8b-alpaca.yaml --tasks hellaswag,arc_easy --limit 200

      ligertune eval runs/my-run --tasks my_tasks/qa.yaml --num-fewshot 3 -o scores.json
    """
    from rich.table import Table

    from ligertune.cli import common
    from ligertune.tools.generate import Generator
    from ligertune.training.harness import run_tasks

    target, chosen, base = _target(recipe_or_run, tasks)
    if not chosen:
        raise usage(
            "name the tasks: --tasks hellaswag,arc_easy (or a task file), or eval.tasks in the recipe"
        )
    generator = Generator(target, format="raw")
    print_line(f"scoring {generator.source.describe()} on {generator.device}: {', '.join(chosen)}")
    scores = run_tasks(
        generator.model,
        generator.tokenizer,
        chosen,
        base=base,
        limit=limit,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        verbose=common.verbosity == "verbose",
    )
    table = Table(title="lm-evaluation-harness", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("score", justify="right")
    for key, value in scores.items():
        table.add_row(key.removeprefix("eval_"), f"{value:.4f}")
    console.print(table)
    if output is not None:
        output.write_text(
            json.dumps({"model": generator.source.describe(), "scores": scores}, indent=2) + "\n"
        )
        print_line(f"wrote {output}")


def _target(recipe_or_run: str, tasks: str | None) -> tuple[str, list[str], Path | None]:
    """(what to load, the tasks, where relative task files resolve): a recipe file means its
    run directory and its eval.tasks."""
    from ligertune.config import load_recipe
    from ligertune.config.loading import resolve_recipe_path

    chosen = [t.strip() for t in tasks.split(",") if t.strip()] if tasks else []
    path = resolve_recipe_path(recipe_or_run)
    if path.suffix in (".yaml", ".yml") and path.is_file() and not _is_task_file(path):
        recipe = load_recipe(path)
        return str(recipe.run_dir), chosen or list(recipe.eval.tasks), recipe._base_dir
    return recipe_or_run, chosen, None


def _is_task_file(path: Path) -> bool:
    """An lm-eval task file given by mistake where the model goes."""
    import yaml

    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(content, dict) and "task" in content and "model" not in content
