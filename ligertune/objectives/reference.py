"""Where a preference objective's reference log-probs come from (``objective.reference``).

- ``frozen``: a frozen copy of the starting model (``objective.reference_model``, default the
  recipe's model section), built by `ligertune.models.build.build_model`, in eval mode, without
  gradients, on the training device. With LoRA there is no copy: the reference is the policy
  with its adapters switched off (peft's ``disable_adapter()``), which *is* the starting model,
  run through the policy's own forward under ``no_grad``.
- ``precomputed``: the data's columns (``ref_chosen_logps``/``ref_rejected_logps``, KTO
  ``ref_logps``/``ref_kl_logps``), computed offline on the same tokenisation and truncation.
- ``none``: reference-free (log π_ref = 0), e.g. DPO without a reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ligertune.errors import DataError, RecipeError
from ligertune.lora import is_adapted
from ligertune.models.build import build_model
from ligertune.objectives.base import Batch
from ligertune.objectives.logps import frozen_logps, sequence_logps

if TYPE_CHECKING:
    from ligertune.config import Recipe
    from ligertune.config.schema import ModelSection


def build_frozen(recipe: Recipe, section: ModelSection, device: torch.device) -> nn.Module:
    """A frozen model from a model section, with the recipe's precision and seed: eval mode, no
    parameter requiring grad, on `device`. A random-init section equal to the policy's builds
    the policy's starting weights (same seed)."""
    model = build_model(recipe.model_copy(update={"model": section}), device)
    model.eval()
    model.requires_grad_(False)
    return model


class Reference:
    """``logps(policy, batch)``: the reference's Σ log-probs per row [R], without gradients."""

    def __init__(
        self, kind: str, *, model: nn.Module | None = None, adapted: nn.Module | None = None, fused=False
    ):
        self.kind, self.model, self.adapted, self.fused = kind, model, adapted, fused

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
        if self.kind == "adapters_off":
            with self.adapted.disable_adapter(), torch.no_grad():
                return sequence_logps(policy, batch, self.fused)[0]
        return frozen_logps(self.model, batch)


def build_reference(
    kind: str, recipe: Recipe | None, policy: nn.Module | None, device, fused: bool
) -> Reference:
    if kind != "frozen":
        return Reference(kind)
    if policy is not None and is_adapted(policy):
        return Reference("adapters_off", adapted=policy, fused=fused)
    if recipe is None or device is None:
        raise RecipeError(
            ["objective.reference: frozen needs the recipe and device to build the reference model"]
        )
    section = recipe.objective.reference_model or recipe.model
    return Reference("frozen", model=build_frozen(recipe, section, device))
