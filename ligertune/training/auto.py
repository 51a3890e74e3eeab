"""``training.activation_checkpointing: auto`` and ``training.micro_batch_size: auto``, resolved
at setup against the GPU the run has (or ``training.memory_budget_gib``).

The budget: ``training.memory_budget_gib`` when set, else the CUDA device's total memory; on
CPU there is none, so auto reads as no checkpointing and micro-batch 1 (and the recipe's
``gradient_accumulation_steps``), and the start log says so. The choice is
`ligertune.plan.choose.choose`: the fastest setting the estimate says fits with `HEADROOM_FRACTION` left free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ligertune.errors import RecipeError
from ligertune.models.shape import frozen_shape, recipe_shape
from ligertune.plan.choose import candidates, cheapest_fix, choose, gib
from ligertune.plan.recipe import base_setting, global_per_rank, micro_batch_choices, recipe_checkpointing
from ligertune.plan.setting import CHECKPOINTING, GIB

if TYPE_CHECKING:
    from ligertune.config import Recipe


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe  # with every auto replaced by a value
    message: str | None  # what auto chose and why, for the start log


def memory_budget(recipe: Recipe, device: torch.device) -> int | None:
    """Bytes the plan may use on one GPU: the recipe's budget, the device's memory, or None."""
    if recipe.training.memory_budget_gib is not None:
        return int(recipe.training.memory_budget_gib * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def resolve_auto(recipe: Recipe, world_size: int, device: torch.device) -> Resolved:
    """The recipe with ``auto`` checkpointing and micro-batch size chosen (unchanged without auto)."""
    training = recipe.training
    auto_ckpt = recipe_checkpointing(recipe) == "auto"
    auto_micro = training.micro_batch_size == "auto"
    if not (auto_ckpt or auto_micro):
        return Resolved(recipe, None)
    budget = memory_budget(recipe, device)
    per_rank = global_per_rank(recipe, world_size)
    if per_rank is not None and training.global_batch_size % world_size:
        raise RecipeError(
            [
                f"training.global_batch_size: {training.global_batch_size} is not divisible by the {world_size} ranks"
            ]
        )
    if budget is None:
        micro = 1 if auto_micro else training.micro_batch_size
        ckpt = "none" if auto_ckpt else recipe_checkpointing(recipe)
        every, modules = (
            training.activation_checkpointing_every,
            list(training.activation_checkpointing_modules),
        )
        message = "auto: no GPU memory to plan against (CPU, no training.memory_budget_gib)"
    else:
        shape = recipe_shape(recipe)
        base = base_setting(recipe, world_size, frozen_shape(recipe))
        micros = micro_batch_choices(recipe, world_size) if auto_micro else (base.micro_batch_size,)
        ckpts = CHECKPOINTING if auto_ckpt else (base.checkpointing,)
        settings = [s for s in candidates(base, micros, ckpts) if s.offload == base.offload]
        picked = choose(shape, settings, budget)
        if picked is None:
            raise RecipeError(
                [
                    f"training: no micro-batch size and checkpointing fits {gib(budget)} per GPU; "
                    f"ligertune plan suggests: {cheapest_fix(shape, base, budget)}"
                ]
            )
        micro, ckpt = picked.setting.micro_batch_size, picked.setting.checkpointing
        every, modules = picked.setting.every, list(picked.setting.modules)
        message = (
            f"auto: {picked.setting.label()} (predicted peak {gib(picked.breakdown.peak)} of {gib(budget)}; "
            "`ligertune plan` shows the table)"
        )
    # The resolved recipe is what checkpoints record and resumes compare: it must read back as a
    # valid recipe, so keys that only go with `auto` are settled too.
    changes: dict = {}
    if auto_ckpt:
        changes["activation_checkpointing"] = ckpt
        selective = ckpt == "selective"
        default_every = type(training).model_fields["activation_checkpointing_every"].default
        changes["activation_checkpointing_every"] = every if selective else default_every
        changes["activation_checkpointing_modules"] = modules if selective else []
    if auto_micro:
        changes["micro_batch_size"] = micro
        changes["global_batch_size"] = None
        if per_rank is not None:
            changes["gradient_accumulation_steps"] = max(1, per_rank // micro)
    if auto_micro and per_rank is not None:
        message += f"; gradient_accumulation_steps {changes['gradient_accumulation_steps']} keeps the global batch {training.global_batch_size}"
    resolved = recipe.model_copy(update={"training": training.model_copy(update=changes)})
    return Resolved(resolved, message)


def oom_suggestion(recipe: Recipe, world_size: int, budget: int) -> str:
    """What to change after a real out-of-memory: the fastest setting the estimate says fits
    (among smaller micro-batches and every checkpointing), else the cheapest fix."""
    shape = recipe_shape(recipe)
    base = base_setting(recipe, world_size, frozen_shape(recipe))
    micros = tuple(b for b in micro_batch_choices(recipe, world_size) if b <= base.micro_batch_size) or (1,)
    picked = choose(shape, candidates(base, micros, CHECKPOINTING), budget)
    if picked is None:
        return cheapest_fix(shape, base, budget)
    s = picked.setting
    changes = [
        f"training.micro_batch_size={s.micro_batch_size}",
        f"training.activation_checkpointing={s.checkpointing}",
    ]
    if s.checkpointing == "selective":
        changes.append(f"training.activation_checkpointing_every={s.every}")
        if s.modules:
            changes.append(f"training.activation_checkpointing_modules=[{','.join(s.modules)}]")
    if s.offload:
        changes.append("training.activation_offload=true")
    return " ".join(changes) + f" (predicted peak {gib(picked.breakdown.peak)})"
