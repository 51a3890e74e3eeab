"""The errors a user can act on, one type per kind of fix, and what the CLI does with each.

Every layer raises these (never a bare ValueError for a user's mistake), and the CLI turns them
into one line per problem, no traceback:

- `RecipeError`: a recipe key, an option or a combination of them; exit status 2, raised before
  any model or GPU work wherever the recipe alone decides it.
- `DataError`: a dataset, tokenizer or data file; exit status 2.
- `TrainingError`: the run cannot go on (a non-finite loss, a run directory in use); exit
  status 1. Whatever was saved stays saved, and the message says where and what to do.
"""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe problem the user must fix. `problems` holds one message per line."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"{source}: " if source else ""
        super().__init__(head + "invalid recipe\n" + "\n".join(f"  {p}" for p in problems))


class DataError(ValueError):
    """A dataset or tokenizer problem the user must fix; the message is one line."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says where and what to do."""


class OutOfMemoryError(TrainingError):
    """The GPU ran out of memory in a step; the message names the plan's suggestion. A type of its
    own so that `ligertune compare` reports the arm as out of memory, a finding, not a failure."""


def shown(text: object) -> str:
    """A key or name as an error line shows it: as written, or quoted when it holds a newline, a
    control character or a space (a problem stays on one line, and an odd name stays visible)."""
    value = str(text)
    return value if value and value.isprintable() and " " not in value else repr(value)
