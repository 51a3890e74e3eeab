"""``distill``: knowledge distillation from a frozen teacher (``objective.teacher``) on the data's
label tokens (any SFT format, packing allowed: the teacher sees the same rows).

Per label token t, with teacher logits z_T and student logits z_S over the same vocabulary,
p = softmax(z_T / T), q = softmax(z_S / T):

    ℓ_t = α · CE(z_S, y_t) + (1 − α) · T² · D(p, q)

    D: forward_kl  KL(p‖q)       Hinton et al. 2015, "Distilling the Knowledge in a Neural
                                 Network" (T² keeps the soft term's gradient scale as T changes)
       reverse_kl  KL(q‖p)       mode-seeking (GKD, Agarwal et al. 2024, "On-Policy Distillation
                                 of Language Models: Learning from Self-Generated Mistakes")
       jsd         β·KL(p‖m) + (1−β)·KL(q‖m),  m = β·p + (1−β)·q   (GKD's generalised JSD)

α = ``ce_weight``, T = ``temperature``, β = ``jsd_beta``. Items are label tokens, as for SFT,
so the loss is Σ_t ℓ_t / N. This is supervised (off-policy) KD on the dataset's responses;
GKD's on-policy sampling is not done here. Metrics: ``ce`` and ``kl`` (the divergence D,
whichever is chosen), per label token.

The fused path computes ℓ chunk by chunk from both models' final hidden states and lm_head
weights (`fused_linear_distillation`): neither model's [tokens × vocab] logits exist for the
batch. It needs both lm_head weights whole at once, which under FSDP2 and ZeRO-3 exist only
inside each lm_head's own module call (its hooks gather the weight before and free it after).
So the calls are nested: the student's forward runs its lm_head with a loss function that runs
the teacher's forward (no gradients) with a loss function that, inside the teacher's lm_head
call, computes the loss from the student's hidden states and weight (still gathered: the
student's lm_head call has not returned) and the teacher's. The loss leaves through a closure,
not through the teacher's outputs, so the teacher's wrapper never sees a tensor that needs
gradients. The price under sharding: the student's gathered lm_head (FSDP2: its whole root
unit) stays gathered while the teacher's forward runs. The materialised path (kernels off)
runs the two HF forwards one after the other and compares their logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ligertune.catalog.objectives.distill import DistillOptions
from ligertune.errors import RecipeError
from ligertune.kernels.fused_linear_logprobs import distillation_token_losses, fused_linear_distillation
from ligertune.objectives.base import Batch, Building, Objective, ObjectiveOutput
from ligertune.objectives.causal_lm import count_label_tokens
from ligertune.objectives.logps import lm_head_is_fused, model_inputs, shifted_targets
from ligertune.objectives.reference import build_frozen
from ligertune.patching.losses import LM_HEAD_LOSS_FN

# The options of `DistillOptions` the kernels take as keywords.
KERNEL_OPTIONS = ("divergence", "temperature", "jsd_beta", "ce_weight")


class Distill(Objective):
    options_model = DistillOptions

    def __init__(self, teacher: nn.Module, fused: bool, **options):
        """`teacher`: the frozen teacher as the strategy placed it (`build_frozen`); `fused`:
        whether both lm_heads run our fused kernel; `options`: `KERNEL_OPTIONS`."""
        self.teacher, self.fused, self.options = teacher, fused, options

    @classmethod
    def build(cls, options: DistillOptions, building: Building) -> Distill:
        teacher = build_frozen(building.recipe, options.teacher, building.runtime)
        policy = building.policy
        if policy is not None and _vocabulary(policy) != _vocabulary(teacher):
            raise RecipeError(
                [
                    f"objective.teacher: its vocabulary has {_vocabulary(teacher)} tokens, the model's "
                    f"{_vocabulary(policy)}; distillation compares them token by token: use a teacher with the "
                    "student's tokenizer"
                ]
            )
        fused = policy is not None and lm_head_is_fused(policy) and lm_head_is_fused(teacher)
        return cls(teacher, fused, **{k: getattr(options, k) for k in KERNEL_OPTIONS})

    def count(self, batch: Batch) -> int:
        return count_label_tokens(batch)

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        if not self.fused:
            return self._materialised(model, batch, num_items)
        labels, terms = batch["labels"], {}
        grad = torch.is_grad_enabled()  # training or evaluation: the student's loss follows it

        def student_head(
            hidden, student_weight, target, student_bias=None, *, ignore_index, softcap=None, **_
        ):
            def teacher_head(teacher_hidden, teacher_weight, _target, teacher_bias=None, **_):
                with torch.set_grad_enabled(grad):
                    terms["loss"], terms["ce"], terms["kl"] = fused_linear_distillation(
                        hidden,
                        student_weight,
                        teacher_hidden,
                        teacher_weight,
                        target,
                        student_bias,
                        teacher_bias,
                        ignore_index=ignore_index,
                        softcap=softcap,
                        num_items=num_items,
                        **self.options,
                    )
                return terms["loss"].detach()

            with torch.no_grad():
                self.teacher(**model_inputs(batch), labels=labels, **{LM_HEAD_LOSS_FN: teacher_head})
            return terms["loss"]

        loss = model(**model_inputs(batch), labels=labels, **{LM_HEAD_LOSS_FN: student_head}).loss
        return ObjectiveOutput(loss, {"ce": terms["ce"].float(), "kl": terms["kl"].float()})

    def _materialised(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        student = model(**model_inputs(batch)).logits
        with torch.no_grad():
            teacher = self.teacher(**model_inputs(batch)).logits
        losses, ce, div = distillation_token_losses(
            student.reshape(-1, student.shape[-1]),
            teacher.reshape(-1, teacher.shape[-1]),
            shifted_targets(batch["labels"]).reshape(-1),
            softcap=None,  # each HF forward applied its model's final-logit softcap already
            **self.options,
        )
        n = num_items.to(losses.dtype)
        return ObjectiveOutput(losses.sum() / n, {"ce": ce.detach().sum() / n, "kl": div.detach().sum() / n})


def _vocabulary(model: nn.Module) -> int:
    """The rows of a causal LM's lm_head, read from the module (``out_features``), not from its
    weight, whose shape a sharded strategy has changed (ZeRO-3 leaves an empty placeholder)."""
    return model.get_output_embeddings().out_features
