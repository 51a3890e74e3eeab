"""``distill``: knowledge distillation from a frozen teacher on the data's label tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from ligertune.catalog.objectives.base import FrozenModel, ObjectiveOptions
from ligertune.catalog.rules import Rule
from ligertune.catalog.section import ModelSection

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe


def teacher_given(recipe: Recipe) -> list[str]:
    """objective.name distill needs objective.teacher, a model section naming one model."""
    teacher = recipe.objective.teacher
    if teacher is None:
        return ["objective.teacher: distill needs a teacher model section (name_or_path or config)"]
    problem = teacher.source_problem("objective.teacher")
    return [problem] if problem else []


class DistillOptions(ObjectiveOptions):
    name: Literal["distill"] = Field("distill", description="The objective.")
    teacher: ModelSection | None = Field(
        None, description="The frozen teacher (same vocabulary as the model), as a model section."
    )
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="KL(teacher‖student), KL(student‖teacher) or the generalised JSD."
    )
    temperature: float = Field(1.0, gt=0, description="Softmax temperature T of both models.")
    jsd_beta: float = Field(0.5, gt=0, lt=1, description="jsd: mixture weight β of the teacher.")
    ce_weight: float = Field(0.5, ge=0, le=1, description="α in α·CE(labels) + (1 − α)·T²·divergence.")

    loss_head: ClassVar[str] = "distillation"
    metrics: ClassVar[tuple[str, ...]] = ("ce", "kl")
    rules: ClassVar[tuple[Rule, ...]] = (Rule("objective.teacher", teacher_given),)
    summary: ClassVar[str] = "distillation from a frozen teacher's distribution on the label tokens"

    def frozen_model(self, recipe: Recipe) -> FrozenModel | None:
        return FrozenModel("teacher", self.teacher) if self.teacher is not None else None
