"""One training process in a job of one or many: the `Runtime` the loop talks to, one engine per
strategy (`ddp`, `fsdp`, `deepspeed`; `runtime` holds the one-process base and what all
multi-process strategies share), the torchrun environment read in one place (`env`), and the
launcher that starts a job (`launch`).

Every module of the package is imported here, so that each engine's `Runtime` subclass registers
itself under the catalog options model it runs (``options_model``); `create_runtime` finds it
from the recipe's ``parallel`` section. A new strategy is its catalog module and its engine's
module here, nothing else (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from ligertune.catalog.strategies import STRATEGIES
from ligertune.config import Recipe
from ligertune.distributed.env import launched_as, rank_label
from ligertune.distributed.runtime import OptimizerFactory, ProcessGroupRuntime, Runtime, resolve_device
from ligertune.errors import RecipeError

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def create_runtime(recipe: Recipe) -> Runtime:
    """The runtime for this process (the engine of the recipe's ``parallel`` section), from the
    recipe and the launcher's environment. A multi-process strategy joins the process group
    here."""
    launched = launched_as()
    if not recipe.parallel.multi_process:
        if launched.multi_process:
            several = ", ".join(STRATEGIES.name_of(s) for s in STRATEGIES if s.multi_process)
            raise RecipeError(
                [
                    f"parallel.strategy: {recipe.parallel.strategy}, but this process was launched as one of "
                    f"{launched.world_size} (WORLD_SIZE is set, e.g. by torchrun); every process would train the "
                    f"same model into the same output directory. Set parallel.strategy to one of {several}, or "
                    "launch one process"
                ]
            )
        return Runtime(resolve_device(recipe.training.device))
    return Runtime.implementation(recipe.parallel)(recipe)


__all__ = [
    "OptimizerFactory",
    "ProcessGroupRuntime",
    "Runtime",
    "create_runtime",
    "rank_label",
    "resolve_device",
]
