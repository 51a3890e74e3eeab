"""Where a preference objective's reference log-probs come from (``objective.reference``), and how
frozen models (that reference, a distillation teacher) are built.

- ``frozen``: a frozen copy of the starting model (``objective.reference_model``, default the
  recipe's model section), built by `build_frozen`. With LoRA there is no copy: the reference is
  the policy with its adapters switched off (peft's ``disable_adapter()``), which *is* the
  starting model, run through the policy's own (wrapped) forward under ``no_grad``.
- ``precomputed``: the data's columns (``ref_chosen_logps``/``ref_rejected_logps``, KTO
  ``ref_logps``/``ref_kl_logps``), computed offline on the same tokenisation and truncation.
- ``none``: reference-free (log π_ref = 0), e.g. DPO without a reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ligertune.catalog.objectives import ObjectiveOptions
from ligertune.errors import DataError, RecipeError
from ligertune.lora import is_adapted
from ligertune.objectives.logps import lm_head_is_fused, sequence_logps
from ligertune.patching import patch_model

if TYPE_CHECKING:
    from ligertune.catalog.section import ModelSection
    from ligertune.catalog.strategies import ParallelOptions
    from ligertune.config import Recipe
    from ligertune.objectives.base import Batch, Building


class Placement(Protocol):
    """What building an objective asks of the parallel strategy: `ligertune.distributed.Runtime`
    (a layer above this one, so named here by the methods used): building and placing a frozen
    model, and for an objective that generates, the policy's weights held gathered while it
    generates and the collectives that score a generation batch over every rank."""

    rank: int
    world_size: int
    device: torch.device
    options_model: type[ParallelOptions]  # what the strategy supports (`ParallelOptions.supports`)

    def build_model(self, recipe: Recipe) -> nn.Module: ...

    def wrap_frozen(self, model: nn.Module, recipe: Recipe) -> nn.Module: ...

    def gathered(self, model: nn.Module) -> contextlib.AbstractContextManager: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def max_over_ranks(self, values: list[int]) -> list[int]: ...


def build_frozen(recipe: Recipe | None, section: ModelSection, runtime: Placement | None) -> nn.Module:
    """A frozen model from a model section (a reference or a teacher), with the recipe's
    precision, seed and kernels, built and placed by the strategy as it builds and places the
    policy: whole on the device (none, ddp, deepspeed stages 1-2); empty on the meta device,
    sharded per decoder layer and root and filled from rank 0 (fsdp with sharded init); inside
    ``zero.Init``, then a ZeRO-3 inference engine (deepspeed stage 3). No parameter requires grad, no optimizer holds them,
    and it is in eval mode. Returns what to call (under ZeRO-3 the engine).

    The kernels are the policy's so that the frozen model computes the policy's numbers: a
    reference equal to the starting model gives exactly the policy's log-probs at step 0 (every
    reward 0). And the fused linear cross entropy's forward is what lets its lm_head compute
    log-probs inside its own module call, where FSDP2 and ZeRO-3 gather the weight
    (`ligertune.objectives.logps`). A random-init section equal to the policy's builds the
    policy's starting weights (same seed)."""
    if recipe is None or runtime is None:
        raise RecipeError(
            ["objective: a frozen reference or teacher needs the recipe and the runtime to build it"]
        )
    frozen = recipe.model_copy(update={"model": section})
    model = runtime.build_model(frozen)
    patch_model(model, recipe.kernels)
    model.requires_grad_(False)
    model = runtime.wrap_frozen(model, frozen)
    model.eval()
    return model


class Reference:
    """``logps(policy, batch)``: the reference's Σ log-probs per row [R], without gradients. A
    frozen `model` takes the fused path when its own lm_head can (its patched kernels decide);
    ``adapters_off`` runs the policy, so `fused` is the policy's."""

    def __init__(
        self, kind: str, *, model: nn.Module | None = None, adapted: nn.Module | None = None, fused=False
    ):
        self.kind, self.model, self.adapted = kind, model, adapted
        self.fused = lm_head_is_fused(model) if model is not None else fused

    def check(self, batch: Batch) -> None:
        """Host-side, before the forward: precomputed log-probs must be in the data."""
        if self.kind == "precomputed" and "ref_logps" not in batch:
            raise DataError(
                "objective.reference precomputed needs the reference log-prob columns in every row of the data "
                "(preference: ref_chosen_logps, ref_rejected_logps; kto: ref_logps, ref_kl_logps)"
            )

    def logps(self, policy: nn.Module, batch: Batch) -> torch.Tensor:
        rows = batch["input_ids"].shape[0]
        if self.kind == "none":
            return torch.zeros(rows, device=batch["input_ids"].device)
        if self.kind == "precomputed":
            return batch["ref_logps"].float()
        return self.run(policy, batch, sequence_logps)[0]

    def run(self, policy: nn.Module, batch: Batch, logps: Callable):
        """``logps(model, batch, fused)`` (`ligertune.objectives.logps`) of the reference model,
        without gradients: the frozen copy, or the policy with its adapters off."""
        if self.kind == "adapters_off":
            with self.adapted.disable_adapter(), torch.no_grad():
                return logps(policy, batch, self.fused)
        with torch.no_grad():
            return logps(self.model, batch, self.fused)


def build_reference(kind: str, options: ObjectiveOptions, building: Building, fused: bool) -> Reference:
    """The reference of ``objective.reference`` `kind`: a frozen model (the objective's
    `frozen_model`, built and placed like the policy), the adapters-off policy with LoRA,
    precomputed columns or none."""
    if kind != "frozen":
        return Reference(kind)
    if building.policy is not None and is_adapted(building.policy):
        return Reference("adapters_off", adapted=building.policy, fused=fused)
    recipe = building.recipe
    frozen = options.frozen_model(recipe) if recipe is not None else None
    return Reference(
        "frozen", model=build_frozen(recipe, frozen.section if frozen else None, building.runtime)
    )
