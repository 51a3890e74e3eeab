"""The Typer app every command registers on, its global options, and how errors are printed.

Every command that reads a recipe validates it first; recipe problems print one line each
(no traceback) and exit with status 2.
"""

from __future__ import annotations

import os

import typer
from rich.markup import escape

from ligertune import __version__
from ligertune.errors import RecipeError
from ligertune.run.loggers import configure_logging, make_console

app = typer.Typer(
    name="ligertune",
    help="Fine-tune LLMs from YAML recipes with fused Triton kernels.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
recipes_app = typer.Typer(invoke_without_command=True)
app.add_typer(recipes_app, name="recipes")

# Wide when the output is not a terminal (a pipe, a log): rich would wrap and cut at 80 columns.
console = make_console()
err_console = make_console(stderr=True)
# --quiet / --verbose, as the global options set it; `train` reapplies it on ranks other than 0.
verbosity = "normal"


def _print_version(value: bool) -> None:
    if value:
        console.print(f"ligertune {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def global_options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
    quiet: bool = typer.Option(
        False,
        "--quiet",
        "-q",
        envvar="LIGERTUNE_QUIET",
        help="Warnings, errors and the final summary only (train.log still gets everything).",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", envvar="LIGERTUNE_VERBOSE", help="Also the debug lines."
    ),
) -> None:
    global verbosity
    if quiet and verbose:
        _print_error("--quiet and --verbose contradict each other; give one")
        raise typer.Exit(2)
    verbosity = "quiet" if quiet else "verbose" if verbose else "normal"
    configure_logging(verbosity, console)
    # Processes started from here (torchrun's ranks run `ligertune train`) inherit the choice.
    if quiet:
        os.environ["LIGERTUNE_QUIET"] = "1"
    if verbose:
        os.environ["LIGERTUNE_VERBOSE"] = "1"


def fail(error: RecipeError, who: str = "") -> None:
    """Print a recipe error (`who`: the rank that hit it, in a multi-process run) and exit 2."""
    source = escape(error.source + ": ") if error.source else ""
    err_console.print(f"[bold red]error:[/] {escape(who)}{source}invalid recipe", soft_wrap=True)
    for problem in error.problems:
        err_console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _print_error(message: str) -> None:
    """One error line, never wrapped (a path stays whole) and never read as markup."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _print_problems(header: str, problems: list[str]) -> None:
    err_console.print(f"[bold red]✗[/] {escape(header)}", highlight=False, soft_wrap=True)
    for problem in problems:
        err_console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)


def _print_line(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)
