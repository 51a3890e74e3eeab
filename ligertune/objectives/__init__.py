"""Training objectives behind one seam (`base.Objective`): the loss a recipe trains with.

``sft`` (`causal_lm`): next-token cross entropy on the label tokens. The preference objectives
``dpo`` (with IPO and hinge variants), ``orpo``, ``simpo`` (`pairs` and one module each) train
on pairs of responses, ``kto`` on unpaired desirable/undesirable examples, and ``distill``
(`distill`) on a frozen teacher's distribution; `logps` computes sequence log-probs without the
[tokens × vocab] logits, `reference` provides the reference model's and builds the frozen
models (reference, teacher), which the parallel strategy places like the policy (a replica, or
sharded under FSDP2 and ZeRO-3). Adding an objective is one module here with a class following
`Objective`, an entry in `OBJECTIVES`, and its tests (docs/architecture.md walks through one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ligertune.errors import RecipeError
from ligertune.objectives.base import Batch, Objective, ObjectiveOutput
from ligertune.objectives.causal_lm import CausalLM
from ligertune.objectives.distill import Distill
from ligertune.objectives.dpo import DPO
from ligertune.objectives.kto import KTO
from ligertune.objectives.logps import lm_head_is_fused
from ligertune.objectives.orpo import ORPO
from ligertune.objectives.reference import Placement, build_frozen, build_reference
from ligertune.objectives.simpo import SimPO

if TYPE_CHECKING:
    from ligertune.config import Recipe
    from ligertune.config.schema import ObjectiveSection

OBJECTIVES: dict[str, type] = {
    "sft": CausalLM,
    "dpo": DPO,
    "orpo": ORPO,
    "simpo": SimPO,
    "kto": KTO,
    "distill": Distill,
}


def build_objective(
    objective: str | ObjectiveSection = "sft",
    *,
    recipe: Recipe | None = None,
    policy: nn.Module | None = None,
    runtime: Placement | None = None,
) -> Objective:
    """The objective a recipe's ``objective`` section names. `policy` is the trained model (a
    peft model with LoRA: its reference is the adapters-off policy), the one the strategy
    wrapped, not the wrapper; `recipe` and `runtime` (the strategy's, `ligertune.distributed`)
    build and place a frozen reference or teacher (`build_frozen`)."""
    if isinstance(objective, str):
        if objective != "sft":
            raise ValueError(
                f"objective {objective!r} needs its recipe section: build_objective(recipe.objective, ...)"
            )
        return CausalLM()
    name = objective.name
    if name == "sft":
        return CausalLM()
    fused = policy is not None and lm_head_is_fused(policy)
    if name == "distill":
        teacher = build_frozen(recipe, objective.teacher, runtime)
        student_vocab = _vocabulary(policy) if policy is not None else None
        teacher_vocab = _vocabulary(teacher)
        if student_vocab is not None and student_vocab != teacher_vocab:
            raise RecipeError(
                [
                    f"objective.teacher: its vocabulary has {teacher_vocab} tokens, the model's {student_vocab}; "
                    "distillation compares them token by token: use a teacher with the student's tokenizer"
                ]
            )
        options = {k: getattr(objective, k) for k in ("divergence", "temperature", "jsd_beta", "ce_weight")}
        return Distill(teacher, fused and lm_head_is_fused(teacher), **options)
    reference = build_reference(objective.reference_kind, recipe, policy, runtime, fused)
    options = {
        "dpo": ("loss_type", "label_smoothing"),
        "simpo": ("gamma_beta_ratio", "label_smoothing"),
        "kto": ("desirable_weight", "undesirable_weight"),
    }.get(name, ())
    return OBJECTIVES[name](
        objective.strength, reference, fused, **{k: getattr(objective, k) for k in options}
    )


def _vocabulary(model: nn.Module) -> int:
    """The rows of a causal LM's lm_head, read from the module (``out_features``), not from its
    weight, whose shape a sharded strategy has changed (ZeRO-3 leaves an empty placeholder)."""
    return model.get_output_embeddings().out_features


__all__ = ["OBJECTIVES", "Batch", "Objective", "ObjectiveOutput", "build_objective"]
