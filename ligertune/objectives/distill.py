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
GKD's on-policy sampling is not done here. The fused path computes ℓ chunk by chunk inside the
student's lm_head call from both models' hidden states (`fused_linear_distillation`): neither
model's [tokens × vocab] logits exist for the batch. Metrics: ``ce`` and ``kl`` (the divergence
D, whichever is chosen), per label token.
"""

from __future__ import annotations

import torch
from torch import nn

from ligertune.kernels.fused_linear_logprobs import distillation_token_losses, fused_linear_distillation
from ligertune.objectives.base import Batch, ObjectiveOutput
from ligertune.objectives.causal_lm import count_label_tokens
from ligertune.objectives.logps import frozen_hidden, head_of, model_inputs, shifted_targets
from ligertune.patching.losses import LM_HEAD_LOSS_FN


class Distill:
    name = "distill"

    def __init__(self, teacher: nn.Module, fused: bool, **options):
        self.teacher, self.fused, self.options = teacher, fused, options

    def count(self, batch: Batch) -> int:
        return count_label_tokens(batch["labels"])

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        with torch.no_grad():
            teacher_hidden = frozen_hidden(self.teacher, batch)
        teacher_hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
        weight, bias, softcap = head_of(self.teacher)
        labels = batch["labels"]
        if self.fused:
            terms = {}

            def loss_fn(
                hidden, student_weight, target, student_bias=None, *, ignore_index, softcap=None, **_
            ):
                loss, terms["ce"], terms["kl"] = fused_linear_distillation(
                    hidden,
                    student_weight,
                    teacher_hidden,
                    weight,
                    target,
                    student_bias,
                    bias,
                    ignore_index=ignore_index,
                    softcap=softcap,
                    num_items=num_items,
                    **self.options,
                )
                return loss

            loss = model(**model_inputs(batch), labels=labels, **{LM_HEAD_LOSS_FN: loss_fn}).loss
            return ObjectiveOutput(loss, {"ce": terms["ce"].float(), "kl": terms["kl"].float()})
        student = model(**model_inputs(batch)).logits
        with torch.no_grad():
            teacher = nn.functional.linear(teacher_hidden, weight, bias)
        losses, ce, div = distillation_token_losses(
            student.reshape(-1, student.shape[-1]),
            teacher,
            shifted_targets(labels).reshape(-1),
            softcap=None,  # the HF forward applied the student's softcap to its logits already
            **self.options,
        )
        n = num_items.to(losses.dtype)
        return ObjectiveOutput(losses.sum() / n, {"ce": ce.detach().sum() / n, "kl": div.detach().sum() / n})
