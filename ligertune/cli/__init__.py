"""The `ligertune` command line: a thin Typer shell over the modules that do the work.

`common` holds the app, its global options and the one error handler every command is registered
with (`common.command`); each other module registers its commands on that app when imported:
`recipes` (validate, recipes, env), `run` (train, plan, preprocess, bench, compare), `models`
(generate, download), `artifacts` (merge, export) and `evaluate` (eval).
"""

from __future__ import annotations

import sys

# isort: off
# Each module registers its commands on the app, in this order in `ligertune --help`.
from ligertune.cli import recipes  # noqa: F401
from ligertune.cli import run  # noqa: F401
from ligertune.cli import models  # noqa: F401
from ligertune.cli import artifacts  # noqa: F401
from ligertune.cli import evaluate  # noqa: F401

# isort: on
from ligertune.cli.common import app
from ligertune.cli.help import reflow_commands

reflow_commands(app)

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
