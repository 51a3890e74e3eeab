"""One training process in a job of one or many: the `Runtime` the loop talks to, one class per
strategy (`ddp`, `fsdp`, `deepspeed`; `runtime` holds the one-process base and what all
multi-process strategies share), the torchrun environment read in one place (`env`), and the
launcher that starts a job (`launch`)."""

from __future__ import annotations

from ligertune.config import Recipe
from ligertune.distributed.ddp import DDPRuntime
from ligertune.distributed.deepspeed import DeepSpeedRuntime
from ligertune.distributed.env import launched_as, rank_label
from ligertune.distributed.fsdp import FSDPRuntime
from ligertune.distributed.runtime import OptimizerFactory, ProcessGroupRuntime, Runtime, resolve_device
from ligertune.errors import RecipeError

STRATEGIES: dict[str, type[ProcessGroupRuntime]] = {
    "ddp": DDPRuntime,
    "fsdp": FSDPRuntime,
    "deepspeed": DeepSpeedRuntime,
}


def create_runtime(recipe: Recipe) -> Runtime:
    """The runtime for this process, from the recipe and the launcher's environment. A
    multi-process strategy joins the process group here."""
    strategy = recipe.parallel.strategy
    launched = launched_as()
    if strategy == "none":
        if launched.multi_process:
            raise RecipeError(
                [
                    f"parallel.strategy: none, but this process was launched as one of {launched.world_size} "
                    "(WORLD_SIZE is set, e.g. by torchrun); every process would train the same model into "
                    "the same output directory. Set parallel.strategy to ddp, fsdp or deepspeed, or launch one process"
                ]
            )
        return Runtime(resolve_device(recipe.training.device))
    return STRATEGIES[strategy](recipe)


__all__ = [
    "DDPRuntime",
    "DeepSpeedRuntime",
    "FSDPRuntime",
    "OptimizerFactory",
    "ProcessGroupRuntime",
    "Runtime",
    "create_runtime",
    "rank_label",
    "resolve_device",
]
