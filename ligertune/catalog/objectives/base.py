"""What every objective declares about itself (`ObjectiveOptions`), and the parts two of them
share (a reference model: `ReferenceOptions`).

An objective is the recipe's ``objective:`` section and the loss it names. Its options model
here is that section (the recipe schema is a union of these models, told apart by ``name``), and
its class-level facts are what the rest of the tool asks of it without ever branching on its
name: the data formats it trains on (`formats`, checked by the rule ``objective.fits_data``),
how its loss runs at the lm_head (`loss_head`, for the memory plan), the metrics it logs, its
own rules, and the frozen model it holds besides the policy (`frozen_model`). Its loss is a
class of `ligertune.objectives` that names this model as its ``options`` (torch lives there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from ligertune.catalog.formats import SEQUENCE_FORMATS
from ligertune.catalog.rules import Rule
from ligertune.catalog.section import ModelSection, Section

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

# How an objective's loss runs at the lm_head, which decides what the memory plan counts there
# (`ligertune.plan.activations`):
#   causal    the model's own causal-LM loss (the fused linear CE, our CE kernel or eager CE)
#   pairs     one pass per chunk of whole pairs: log-probs, loss and gradient together
#   logprobs  per-token log-probs first (the fused CE with reduction none), then the loss
#   distillation  the student's and the teacher's logits compared token by token
#   policy    one pass per chunk of whole generated completions (their tokens only): per-token
#             log-probs, the clipped policy loss and its gradient together
LossHead = Literal["causal", "pairs", "logprobs", "distillation", "policy"]


@dataclass(frozen=True)
class FrozenModel:
    """A model an objective holds for the whole run besides the policy, without gradients."""

    role: str  # "reference" or "teacher": how the plan and the log name it
    section: ModelSection


class ObjectiveOptions(Section):
    """Base of every objective's options; a subclass sets ``name`` to a one-value Literal."""

    name: str

    formats: ClassVar[tuple[str, ...]] = SEQUENCE_FORMATS
    loss_head: ClassVar[LossHead] = "causal"
    metrics: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[tuple[Rule, ...]] = ()
    summary: ClassVar[str] = ""  # one line for the recipe reference

    def frozen_model(self, recipe: Recipe) -> FrozenModel | None:
        """The frozen model this objective keeps on the GPU besides the policy, or None."""
        return None

    # -- an objective that makes its own data while it trains (online RL) ----------------------

    def generated_tokens(self) -> int:
        """Tokens it generates after each prompt, at most: each row of ``data.max_seq_len`` keeps
        that many for the completion (the prompt is cut to the rest), and the memory plan counts
        a generation phase (its KV cache) when this is not 0."""
        return 0

    def rows_per_sample(self) -> int:
        """Rows of a micro-batch per sample of the data: the completions generated per prompt."""
        return 1

    def updates_per_window(self) -> int:
        """Optimizer steps that train on the micro-batches made from one window of data (several
        policy updates per generation batch); the loop takes a new window every that many steps."""
        return 1


# -- a reference model (dpo, kto) -------------------------------------------------------------


def reference_fits(recipe: Recipe) -> list[str]:
    """objective.reference_model goes with objective.reference frozen, and not with lora (the reference is then the adapters-off policy)."""
    objective = recipe.objective
    problems = []
    if objective.reference_model is not None and objective.reference != "frozen":
        problems.append(
            f"objective.reference_model: only for objective.reference frozen, not {objective.reference}; "
            "remove objective.reference_model"
        )
    if objective.reference_model is not None and recipe.lora is not None:
        problems.append(
            "objective.reference_model: with lora the reference is the policy with its adapters off (no second "
            "copy); remove objective.reference_model"
        )
    if objective.reference_model is not None:
        problem = objective.reference_model.source_problem("objective.reference_model")
        problems += [problem] if problem else []
    return problems


REFERENCE_RULE = Rule("objective.reference", reference_fits)


class ReferenceOptions(ObjectiveOptions):
    """The options of an objective scored against a reference model's log-probs."""

    reference: Literal["frozen", "precomputed", "none"] = Field(
        "frozen",
        description="Reference log-probs: frozen (a frozen copy of reference_model, or with lora the policy "
        "with its adapters off), precomputed (data columns: preference ref_chosen_logps/ref_rejected_logps, "
        "kto ref_logps/ref_kl_logps) or none (reference-free).",
    )
    reference_model: ModelSection | None = Field(
        None, description="The frozen reference (default: the model section, i.e. the starting weights)."
    )

    rules: ClassVar[tuple[Rule, ...]] = (REFERENCE_RULE,)

    def frozen_model(self, recipe: Recipe) -> FrozenModel | None:
        """A frozen copy of the starting model (or of ``reference_model``); none with LoRA, whose
        reference is the policy with its adapters off, nor when the reference is precomputed or
        absent."""
        if self.reference != "frozen" or recipe.lora is not None:
            return None
        return FrozenModel("reference", self.reference_model or recipe.model)
