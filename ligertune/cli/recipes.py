"""Commands about recipes and the machine: `validate`, `recipes` (list, cp) and `env`."""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path

import typer
from rich.markup import escape

from ligertune.cli.common import command, console, print_problems, recipes_app, usage
from ligertune.config import load_recipe, recipe_to_yaml, shipped_recipes
from ligertune.config.rules import model_problems
from ligertune.errors import DataError, RecipeError
from ligertune.files import write_new


class Format(str, Enum):
    """How `validate` prints a resolved recipe (a choice, so a typo is an error, not silence)."""

    table = "table"
    yaml = "yaml"
    none = "none"


@command()
def validate(
    recipes: list[str] = typer.Argument(
        ..., help="Recipe files, optionally followed by key=value overrides."
    ),
    fmt: Format = typer.Option(
        Format.table, "--format", "-f", help="How to print the resolved recipe: table, yaml or none."
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Also tokenise the first rows of each local data source as train will, and build the model "
        "and compare it patched vs unpatched on one random batch (loss, logits, every gradient). "
        "Shrink big models with model.config_overrides.",
    ),
) -> None:
    """Validate recipes and print each one fully resolved (defaults filled in).

    Reads the first rows of every local data source and checks them against the data format
    (columns, data.columns mapping, field types, roles); hub datasets are checked when train
    loads them. With --check, also tokenise those rows as train will and run the kernel parity
    self-check on the recipe's model; exit status 1 when the parity check fails, 2 for any
    problem with the recipe or its data.

    [bold]Examples[/]

      ligertune validate recipes/quickstart.yaml

      ligertune validate recipes/llama3-8b-alpaca.yaml training.lr=1e-5 kernels.rope=false -f yaml

      ligertune validate recipes/llama3-8b-alpaca.yaml --check -f none model.config_overrides.num_hidden_layers=2
    """
    files = [p for p in recipes if "=" not in p]
    overrides = [p for p in recipes if "=" in p]
    if not files:
        raise usage(
            "name a recipe file before the key=value overrides, "
            "e.g. ligertune validate recipes/quickstart.yaml training.lr=1e-4"
        )
    failed = parity_failed = False
    for file in files:
        try:
            recipe = load_recipe(file, overrides)
        except RecipeError as e:
            failed = True
            print_problems(file, e.problems)
            continue
        # Everything train refuses before building the model, validate refuses too, and the
        # first rows of each data source (the columns and fields its format reads).
        problems = model_problems(recipe)
        data_notes: list[str] = []
        if not problems:
            problems, data_notes = _data_problems(recipe)
        if problems:
            failed = True
            print_problems(file, problems)
            continue
        if fmt is Format.yaml:
            console.print(recipe_to_yaml(recipe), markup=False, highlight=False)
        elif fmt is Format.table:
            _print_recipe_table(file, recipe)
        for note in data_notes:
            console.print(f"[dim]{escape(note)}[/]", highlight=False, soft_wrap=True)
        console.print(f"[green]✓[/] {escape(file)}", highlight=False, soft_wrap=True)
        if check:
            from ligertune.models.build import vision_tower
            from ligertune.tools.check import check_recipe

            try:
                if vision_tower(recipe) is not None:
                    raise RecipeError(
                        [
                            "--check does not cover vision-language models yet (docs/vision.md): train a few "
                            "steps instead (training.max_steps=2), whose start log has the patch report"
                        ]
                    )
                for line in _tokenised_sample(recipe):
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
                result = check_recipe(recipe)
            except RecipeError as e:
                failed = True
                print_problems(f"{file} (--check)", e.problems)
                continue
            except DataError as e:
                failed = True
                print_problems(f"{file} (--check)", [str(e)])
                continue
            console.print(str(result.report), markup=False, highlight=False, soft_wrap=True)
            console.print(str(result), markup=False, highlight=False, soft_wrap=True)
            parity_failed |= not result.ok
    if failed:
        raise typer.Exit(2)
    if parity_failed:
        raise typer.Exit(1)


def _data_problems(recipe) -> tuple[list[str], list[str]]:
    """(problems, notes) of the recipe's data: the first rows of every local source checked
    against its format (ligertune.data.peek; no torch, no datasets load)."""
    from ligertune.data.peek import data_problems

    try:
        return data_problems(recipe)
    except DataError as e:  # a source the specs themselves refuse (no data.path)
        return [str(e)], []


def _tokenised_sample(recipe) -> list[str]:
    """--check: the first rows tokenised as train will (the tokenizer, the template's mask)."""
    from ligertune.data import load_tokenizer
    from ligertune.tools.data_sample import tokenised_sample

    return tokenised_sample(recipe, load_tokenizer(recipe))


def _print_recipe_table(title: str, recipe) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("key")
    table.add_column("value", overflow="fold")

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            table.add_row(prefix, repr(value) if isinstance(value, str) else str(value))

    walk("", recipe.model_dump(mode="json"))
    console.print(table)


@recipes_app.callback()
def recipes_list(ctx: typer.Context) -> None:
    """List the shipped recipes with their one-line descriptions.

    [bold]Examples[/]

      ligertune recipes

      ligertune recipes cp llama3-8b-alpaca my-run.yaml
    """
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("recipe")
    table.add_column("description")
    for name, path in shipped_recipes().items():
        try:
            description = escape(load_recipe(path).description)
        except RecipeError as e:
            extras = _missing_extras(e.problems)
            if extras:
                needs = ", ".join(f"the {x} extra: pip install 'ligertune[{x}]'" for x in extras)
                description = f"{escape(_raw_description(path))} [yellow]{escape('(needs ' + needs + ')')}[/]"
            else:
                description = f"[red]invalid: {escape(e.problems[0])}[/]"
        table.add_row(escape(name), description)
    console.print(table)


# "install it with: pip install 'ligertune[deepspeed]'" in a packages.installed problem.
_EXTRA_HINT = re.compile(r"not installed; install it with: pip install 'ligertune\[([\w-]+)\]'")


def _missing_extras(problems: list[str]) -> list[str]:
    """The extras that would make a recipe valid, when a missing extra is its only problem (a
    deepspeed recipe on a machine without deepspeed is fine, not broken); else []."""
    extras = [m.group(1) if (m := _EXTRA_HINT.search(p)) else None for p in problems]
    return [] if None in extras else list(dict.fromkeys(extras))


def _raw_description(path: Path) -> str:
    """The description as written, for a recipe that does not validate here."""
    from ligertune.config.loading import load_yaml

    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except Exception:
        return ""
    return str(raw.get("description", "")) if isinstance(raw, dict) else ""


@command("cp", on=recipes_app)
def recipes_cp(
    name: str = typer.Argument(..., help="Shipped recipe name (see `ligertune recipes`)."),
    dest: Path = typer.Argument(..., help="Where to write the copy."),
) -> None:
    """Copy a shipped recipe to edit; the copy's name (its run directory, runs/<name>) is the new
    file's, so it never writes into the original's runs.

    [bold]Example[/]

      ligertune recipes cp quickstart my-recipe.yaml
    """
    available = shipped_recipes()
    source = available.get(name.removesuffix(".yaml"))
    if source is None:
        import difflib

        close = difflib.get_close_matches(name, list(available), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise usage(f"no shipped recipe named {name!r}{hint}")
    if dest.is_dir() and not dest.is_symlink():
        dest = dest / source.name
    if os.path.lexists(dest):  # a link too, even a dangling one: never written through
        what = f"is a symbolic link (to {os.readlink(dest)})" if dest.is_symlink() else "exists"
        raise usage(f"{dest} {what}; not overwriting it")
    if not dest.parent.is_dir():
        what = "is a file" if dest.parent.exists() else "does not exist"
        raise usage(f"cannot write {dest}: the folder {dest.parent} {what}; create the folder first")
    run_name = copy_name(dest)
    try:
        # O_EXCL | O_NOFOLLOW: nothing there, not even a link
        write_new(dest, renamed(source.read_text(encoding="utf-8"), run_name).encode("utf-8"))
    except OSError as e:
        raise usage(f"cannot write {dest}: {e.strerror}") from None
    console.print(
        f"wrote {dest} (name: {run_name}: it runs in runs/{run_name})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def copy_name(dest: Path) -> str:
    """The run name of a copy: its file's stem, with what a run name cannot hold made '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", dest.stem).strip("-.")
    return name or "run"


def renamed(text: str, name: str) -> str:
    """A recipe's text with its top-level ``name`` set to `name`, every other line (comments
    included) as written; a recipe without one gets it as its first key."""
    line = re.compile(r"^name:[^\n#]*", re.MULTILINE)
    if line.search(text):
        return line.sub(f"name: {name}", text, count=1)
    body = re.search(r"^(?!#|\s*$)", text, re.MULTILINE)  # the first line that is not a comment
    at = body.start() if body else len(text)
    return f"{text[:at]}name: {name}\n{text[at:]}"


@command()
def env() -> None:
    """Versions of the stack, the GPUs seen, and how the kernels will run.

    [bold]Example[/]

      ligertune env
    """
    from rich.table import Table

    from ligertune.tools.env import describe_environment

    table = Table(show_header=False)
    for key, value in describe_environment().items():
        table.add_row(key, str(value))
    console.print(table)
