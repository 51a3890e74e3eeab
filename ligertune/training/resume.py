"""Resuming: which checkpoint, what it restores, and what the log says about it.

A checkpoint restores the weights, the optimizer and the schedule (through the runtime, which
knows its format), every rank's RNG states, the step and the data position (epoch, next
micro-batch). The data position only names the same batches when the data order's inputs are
unchanged (`ORDER_KEYS`); otherwise the resume goes on with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ligertune.config import Recipe
from ligertune.distributed import Runtime
from ligertune.errors import RecipeError
from ligertune.run.checkpoint import CheckpointManager, load_checkpoint, restore_rng_state

# What fixes the data order; a resume with other values cannot replay the same batches.
ORDER_KEYS = ("seed", "micro_batch_size", "world_size", "data")


def data_order(recipe: Recipe, world_size: int) -> dict[str, Any]:
    """The inputs of the data order, as saved with every checkpoint."""
    return {
        "seed": recipe.seed,
        "micro_batch_size": recipe.training.micro_batch_size,
        "world_size": world_size,
        "data": recipe.data.model_dump(mode="json"),
    }


def resume_path(recipe: Recipe, manager: CheckpointManager) -> Path | None:
    choice = recipe.checkpoint.resume
    if choice == "none":
        return None
    if choice == "auto":
        return manager.latest()
    return recipe.resolve(choice)


def position_warning(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The data position of a checkpoint only means the same batches if the data order's
    inputs are unchanged."""
    changed = [k for k in ORDER_KEYS if saved.get(k) != current.get(k)]
    if not changed:
        return None
    return (
        f"warning: {', '.join(changed)} changed since the checkpoint was saved; resuming at the same "
        "micro-batch index, but the batches from here on differ from the original run's"
    )


@dataclass
class Resumed:
    step: int
    epoch: int
    batch_index: int
    message: str


def resume(
    path: Path, runtime: Runtime, model, optimizer, scheduler, order: dict, total_steps: int
) -> Resumed:
    """Load checkpoint `path` into the wrapped model, optimizer and schedule (every rank)."""
    try:
        saved = load_checkpoint(path, runtime.rank)
    except ValueError as e:
        raise RecipeError([f"checkpoint.resume: {e}"]) from None
    runtime.load_state(saved, model, optimizer)
    scheduler.load_state_dict(saved.scheduler)
    if saved.rng is not None:  # None: this rank did not exist in the saving job
        restore_rng_state(saved.rng)
    step, epoch, batch_index = saved.step, saved.state["epoch"], saved.state["batch_index"]
    message = f"resumed from {saved.path} (step {step}, epoch {epoch}, micro-batch {batch_index})"
    warning = position_warning(saved.state.get("order", {}), order)
    if warning:
        message += "\n" + warning
    if step >= total_steps:
        message += (
            f"\nthe run is already complete ({step} of {total_steps} steps); to train again, set a new "
            "output_dir or checkpoint.resume=none"
        )
    return Resumed(step, epoch, batch_index, message)
