"""Command help that rich wraps to the terminal, not where the docstring's source lines end.

Typer's rich help keeps a docstring's single line breaks, so a paragraph written over three
source lines printed as three short lines cut mid-sentence at any terminal width. `reflow` joins
the lines of each prose paragraph and leaves the rest as written: indented lines (the
examples), list items and blank lines. `reflow_commands` applies it to every command of an app
once they are registered (their docstrings stay readable in the source).
"""

from __future__ import annotations

import inspect

import typer


def reflow(doc: str) -> str:
    """`doc` with each prose paragraph on one line (see the module docstring)."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(_paragraph(p) for p in paragraphs)


def _paragraph(text: str) -> str:
    lines = text.splitlines()
    if any(line.startswith((" ", "- ", "* ")) for line in lines):
        return text  # examples and lists keep their lines
    return " ".join(line.strip() for line in lines)


def reflow_commands(app: typer.Typer) -> None:
    """Give every command and sub-app of `app` (recursively) its reflowed docstring as help."""
    for command in app.registered_commands:
        if command.help is None and command.callback is not None and command.callback.__doc__:
            command.help = reflow(command.callback.__doc__)
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub.registered_callback and sub.registered_callback.callback.__doc__:
            info = sub.registered_callback
            if info.help is None:
                info.help = reflow(info.callback.__doc__)
        reflow_commands(sub)
