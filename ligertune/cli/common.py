"""The Typer app every command registers on, its global options, and how errors are printed.

Every command is registered through `command`, which reports any `ligertune.errors.LigertuneError`
it raises in one place: one line per problem (no traceback), prefixed with the rank under
torchrun, and the exit status the error's kind means (`LigertuneError.exit_code`: 2 for a recipe,
data or usage mistake, 1 when a run cannot go on or something outside failed).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import typer
from rich.markup import escape

from ligertune import __version__
from ligertune.errors import LigertuneError, UsageError
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
        report(UsageError("--quiet and --verbose contradict each other; give one"))
        raise typer.Exit(2)
    verbosity = "quiet" if quiet else "verbose" if verbose else "normal"
    configure_logging(verbosity, console)
    # Processes started from here (torchrun's ranks run `ligertune train`) inherit the choice.
    if quiet:
        os.environ["LIGERTUNE_QUIET"] = "1"
    if verbose:
        os.environ["LIGERTUNE_VERBOSE"] = "1"


def report(error: LigertuneError) -> None:
    """Print `error` as the CLI shows every error: ``error:`` and its lines, the first prefixed
    with the rank that hit it in a multi-process run, never wrapped or read as markup."""
    who = ""
    if "WORLD_SIZE" in os.environ:  # under a launcher, where torch is imported anyway
        from ligertune.distributed.env import rank_label

        who = rank_label()
    first, *rest = error.lines
    err_console.print(f"[bold red]error:[/] {escape(who + first)}", highlight=False, soft_wrap=True)
    for line in rest:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)


def reporting(function: Callable) -> Callable:
    """`function` with every `LigertuneError` it raises reported (`report`) and turned into the
    exit status of its kind."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except LigertuneError as error:
            report(error)
            raise typer.Exit(error.exit_code) from None

    return run


def command(*args, on: typer.Typer = app, **kwargs) -> Callable:
    """Register a command on `on` (the app, or a sub-app) with its errors reported: the
    decorator every command uses instead of Typer's own."""

    def register(function: Callable) -> Callable:
        on.command(*args, **kwargs)(reporting(function))
        return function

    return register


def usage(message: str) -> UsageError:
    """An error in how a command was called, for ``raise usage(...)``."""
    return UsageError(message)


def print_problems(header: str, problems: list[str]) -> None:
    err_console.print(f"[bold red]✗[/] {escape(header)}", highlight=False, soft_wrap=True)
    for problem in problems:
        err_console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)


def print_line(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)
