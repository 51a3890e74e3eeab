"""The errors a user can act on, one type per kind of fix, and the exit status each means.

Every layer raises these (never a bare ValueError for a user's mistake), and the CLI turns each
into one line per problem, no traceback, and exits with the error's `exit_code` (`ligertune.cli`
has the one handler):

- `RecipeError`: a recipe key, an option or a combination of them; exit status 2, raised before
  any model or GPU work wherever the recipe alone decides it.
- `DataError`: a dataset, tokenizer or data file; exit status 2.
- `UsageError`: a command's arguments (a missing file argument, a destination that exists); 2.
- `TrainingError`: the run cannot go on (a non-finite loss, a run directory in use); exit
  status 1. Whatever was saved stays saved, and the message says where and what to do.
- `ExternalError`: something outside the user's input failed (a download, the hub); 1.

Errors of one tool (generate, bench, compare, launch) subclass the kind they are.
"""

from __future__ import annotations


class LigertuneError(Exception):
    """Base of every error the CLI reports in one line per problem, exiting with `exit_code`."""

    exit_code = 2

    @property
    def lines(self) -> list[str]:
        """What the CLI prints after ``error:``, one line each."""
        return [str(self)]


class RecipeError(LigertuneError, ValueError):
    """A recipe problem the user must fix. `problems` holds one message per line."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"{source}: " if source else ""
        super().__init__(head + "invalid recipe\n" + "\n".join(f"  {p}" for p in problems))

    @property
    def lines(self) -> list[str]:
        return [
            f"{self.source + ': ' if self.source else ''}invalid recipe",
            *(f"  {p}" for p in self.problems),
        ]


class DataError(LigertuneError, ValueError):
    """A dataset or tokenizer problem the user must fix; the message is one line."""


class UsageError(LigertuneError, ValueError):
    """A command was given arguments it cannot use; the message says what to give instead."""


class TrainingError(LigertuneError, RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says where and what to do."""

    exit_code = 1


class ExternalError(LigertuneError):
    """Something outside the user's input failed (a download, a service); the message says what."""

    exit_code = 1


class OutOfMemoryError(TrainingError):
    """The GPU ran out of memory in a step; the message names the plan's suggestion. A type of its
    own so that `ligertune compare` reports the arm as out of memory, a finding, not a failure."""


def shown(text: object) -> str:
    """A key or name as an error line shows it: as written, or quoted when it holds a newline, a
    control character or a space (a problem stays on one line, and an odd name stays visible)."""
    value = str(text)
    return value if value and value.isprintable() and " " not in value else repr(value)
