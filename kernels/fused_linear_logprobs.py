"""Chunked lm_head losses for preference and distillation objectives: the [tokens × vocab] logits
never exist for the whole batch.

Two functions, both taking the final hidden states and the lm_head weight (so a caller can run
them inside the lm_head module's own forward, where FSDP2 / ZeRO-3 have the full weight):

``fused_linear_logprobs(hidden, weight, target)`` → per-token ``log softmax(h·Wᵀ + b)[target]``
(0 on ignored targets), fp32 [N]. Summed over a sequence's tokens it is the sequence log-prob
``log π(y|x)`` that DPO, IPO, ORPO, SimPO and KTO are written in. The preference losses are
functions of every sequence's log-prob, so the gradient reaching a token's logits,
``g_seq · (onehot(y_t) − softmax(z_t))``, is only known once all of them are. Two ways out:

- *pair-chunked, one pass* (Liger's ``LigerFusedLinearPreferenceBase``): chunks of whole pairs,
  the pair loss evaluated inside the kernel per chunk, gradients accumulated immediately: three
  lm_head matmuls, but a chunk must hold whole sequences (at 2 × 4096 tokens and V = 128256 in
  bf16, 2.1 GB) and the kernel must know the loss.
- *recompute* (here): the forward computes the log-probs only (one matmul per token chunk, no
  gradient pass, nothing of size N × V kept); the backward redoes the chunk loop with the
  per-token upstream gradient ``g_t = g_seq(t)`` fed into the cross-entropy kernel. Four
  matmuls instead of three (on a 1B Llama-3 shape the lm_head is about a fifth of the FLOPs,
  so ~7% more step FLOPs), any chunk size, any loss downstream (autograd composes it).

This is exactly the deferred path of `fused_linear_cross_entropy` with ``reduction="none"``
(log-prob = −CE per token; the Triton cross-entropy kernel computes the log-softmax, the gather
and, in the backward, the scaled gradient in place), which this function reuses.

``fused_linear_distillation(student_hidden, student_weight, teacher_hidden, teacher_weight,
target)`` → the distillation loss summed over label tokens and divided by ``num_items``:

    ℓ_t = α · CE(z_s,t, y_t) + (1 − α) · T² · D(p_t, q_t),   p = softmax(z_t / T) (teacher),
                                                             q = softmax(z_s / T) (student)
    D ∈ { forward KL  Σ p (log p − log q)        (Hinton et al. 2015, "Distilling the knowledge
                                                   in a neural network"; T² keeps the soft
                                                   gradients' scale as T changes)
          reverse KL  Σ q (log q − log p)        (mode seeking; GKD, Agarwal et al. 2024)
          JSD(β)      β·KL(p‖m) + (1−β)·KL(q‖m), m = β p + (1 − β) q   (GKD's generalised JSD) }

Here the scale (1/N) is known in the forward, so the gradient is computed in the same pass, as
the fused linear cross entropy does: per chunk of C tokens the student and teacher logits
(C × V each, input dtype), the per-token loss in fp32 and its gradient w.r.t. the student's
logits (autograd on the chunk: C × V fp32 temporaries), then ``dh_c = g_c·W_s`` and
``dW_s += g_cᵀ·h_c`` (fp32 accumulator unless the weight is fp32). The chunk size comes from
``memory_budget_bytes`` counting about six C × V fp32 buffers. The teacher gets no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .fused_linear_cross_entropy import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    _matmul_into,
    chunk_rows,
    fused_linear_cross_entropy,
)

__all__ = [
    "DIVERGENCES",
    "distillation_token_losses",
    "fused_linear_distillation",
    "fused_linear_distillation_reference",
    "fused_linear_logprobs",
    "fused_linear_logprobs_reference",
]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
# fp32 C × V buffers alive at once in a distillation chunk: both log-softmaxes, probabilities,
# the mixture (JSD), the gradient.
_DISTILL_BUFFERS = 6


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    memory_budget_bytes: int | None = None,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T + bias)[i, target[i]]`` for every row, fp32 [N]; 0 where
    ``target == ignore_index``. Differentiable w.r.t. hidden, weight and bias (see the module
    docstring: the backward recomputes the chunks' logits with the per-row upstream gradient).

    hidden: [N, H]; weight: [V, H]; target: [N] int64; softcap: Gemma 2's final-logit softcap.
    """
    loss = fused_linear_cross_entropy(
        hidden,
        weight,
        target,
        bias,
        ignore_index=ignore_index,
        softcap=softcap,
        reduction="none",
        memory_budget_bytes=memory_budget_bytes,
    )
    return -loss


def fused_linear_logprobs_reference(
    hidden, weight, target, bias=None, *, ignore_index: int = -100, softcap: float | None = None, **_
) -> torch.Tensor:
    """Plain PyTorch: the logits materialised, ``log_softmax`` in fp32 (fp64 for fp64 inputs),
    gathered at the targets. The oracle of the tests and what a TRL-style loss computes."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = target != ignore_index
    logp = logits.log_softmax(-1).gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    return torch.where(valid, logp, 0.0)


# --------------------------------------------------------------------------------------------
# Distillation
# --------------------------------------------------------------------------------------------


def distillation_token_losses(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    ce_weight: float = 0.5,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ_t, CE_t, D_t) per row, fp32 (fp64 for fp64 inputs), 0 on ignored rows, from logits
    [C, V] (see the module docstring for ℓ). Differentiable w.r.t. the student's logits."""
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    s, t = student_logits.to(dtype), teacher_logits.to(dtype)
    if softcap is not None:
        s, t = softcap * torch.tanh(s / softcap), softcap * torch.tanh(t / softcap)
    valid = target != ignore_index
    safe = torch.where(valid, target, 0)
    ce = -s.log_softmax(-1).gather(-1, safe[:, None])[:, 0]
    log_q, log_p = (s / temperature).log_softmax(-1), (t / temperature).log_softmax(-1)
    if divergence == "forward_kl":
        div = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif divergence == "reverse_kl":
        div = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif divergence == "jsd":
        log_m = torch.logaddexp(log_p + math.log(jsd_beta), log_q + math.log1p(-jsd_beta))
        div = jsd_beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - jsd_beta) * (
            log_q.exp() * (log_q - log_m)
        ).sum(-1)
    else:
        raise ValueError(f"divergence={divergence!r}: use one of {DIVERGENCES}")
    ce, div = torch.where(valid, ce, 0.0), torch.where(valid, div, 0.0)
    return ce_weight * ce + (1 - ce_weight) * temperature**2 * div, ce, div


class _FusedDistillationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, target, scale, options, budget):
        needs = ctx.needs_input_grad
        want_dh, want_dw, want_db = needs[0], needs[1], s_bias is not None and needs[2]
        n_rows, n_hidden = s_hidden.shape
        n_cols = s_weight.shape[0]
        rows = chunk_rows(n_rows, n_cols, 4 * _DISTILL_BUFFERS, budget)
        exact = torch.float64 if s_hidden.dtype == torch.float64 else torch.float32
        sums = torch.zeros(3, dtype=exact, device=s_hidden.device)  # loss, ce, divergence
        scale = scale.to(exact)
        dh = torch.empty_like(s_hidden) if want_dh else None
        accum = s_weight.dtype if s_weight.dtype == torch.float32 else torch.float32
        dw = torch.zeros(n_cols, n_hidden, dtype=accum, device=s_hidden.device) if want_dw else None
        db = torch.zeros(n_cols, dtype=torch.float32, device=s_hidden.device) if want_db else None
        for start in range(0, n_rows, rows):
            end = min(start + rows, n_rows)
            h = s_hidden[start:end]
            teacher = F.linear(t_hidden[start:end], t_weight, t_bias)
            logits = F.linear(h, s_weight, s_bias).detach().requires_grad_(want_dh or want_dw or want_db)
            with torch.enable_grad():
                loss, ce, div = distillation_token_losses(logits, teacher, target[start:end], **options)
                total = loss.sum() * scale
                grad = torch.autograd.grad(total, logits)[0] if logits.requires_grad else None
            sums += torch.stack([total.detach(), ce.detach().sum() * scale, div.detach().sum() * scale])
            if grad is None:
                continue
            if want_dh:
                torch.mm(grad, s_weight, out=dh[start:end])
            if want_dw:
                _matmul_into(dw, grad.t(), h, accumulate=True, slice_rows=max(1, rows * n_cols // n_hidden))
            if want_db:
                db += grad.sum(0, dtype=torch.float32)
        ctx.save_for_backward(
            dh,
            None if dw is None else dw.to(s_weight.dtype),
            None if db is None else db.to(s_bias.dtype),
        )
        ctx.mark_non_differentiable(sums)
        return sums[0].clone(), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        dh, dw, db = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        grads = [None if g is None else (g * scale).to(g.dtype) for g in (dh, dw, db)]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None, None


def _check_distillation(
    s_hidden, s_weight, t_hidden, t_weight, target, divergence, temperature, jsd_beta, ce_weight
):
    if s_hidden.dim() != 2 or t_hidden.dim() != 2 or s_hidden.shape[0] != t_hidden.shape[0]:
        raise ValueError(
            f"student hidden {tuple(s_hidden.shape)} and teacher hidden {tuple(t_hidden.shape)}: expected "
            "[N, H_s] and [N, H_t] with the same N (flatten batch and sequence)"
        )
    if s_weight.shape[0] != t_weight.shape[0]:
        raise ValueError(
            f"student vocabulary {s_weight.shape[0]} ≠ teacher vocabulary {t_weight.shape[0]}: "
            "distillation compares the two distributions token by token"
        )
    if target.shape != (s_hidden.shape[0],):
        raise ValueError(f"target has shape {tuple(target.shape)}; expected [{s_hidden.shape[0]}]")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence={divergence!r}: use one of {DIVERGENCES}")
    if not temperature > 0 or not 0 < jsd_beta < 1 or not 0 <= ce_weight <= 1:
        raise ValueError(
            f"temperature={temperature}, jsd_beta={jsd_beta}, ce_weight={ce_weight}: need temperature > 0, "
            "0 < jsd_beta < 1 and 0 ≤ ce_weight ≤ 1"
        )


def fused_linear_distillation(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    *,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    ce_weight: float = 0.5,
    ignore_index: int = -100,
    softcap: float | None = None,
    num_items: int | torch.Tensor = 1,
    memory_budget_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce, divergence): Σ_t ℓ_t / num_items and the two terms' sums / num_items (detached),
    chunked (module docstring). Student hidden [N, H_s] and weight [V, H_s]; teacher [N, H_t],
    [V, H_t]; target [N] (ignored rows count for nothing). Under autocast the inputs are cast to
    the autocast dtype, like ``F.linear``."""
    _check_distillation(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        target,
        divergence,
        temperature,
        jsd_beta,
        ce_weight,
    )
    device_type = student_hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        student_hidden, student_weight, teacher_hidden, teacher_weight = (
            x.to(dtype) for x in (student_hidden, student_weight, teacher_hidden, teacher_weight)
        )
        student_bias = None if student_bias is None else student_bias.to(dtype)
        teacher_bias = None if teacher_bias is None else teacher_bias.to(dtype)
    scale = 1.0 / torch.as_tensor(num_items, device=student_hidden.device).to(torch.float32).clamp_min(1)
    options = dict(
        divergence=divergence,
        temperature=temperature,
        jsd_beta=jsd_beta,
        ce_weight=ce_weight,
        ignore_index=ignore_index,
        softcap=softcap,
    )
    with torch.autocast(device_type, enabled=False):
        loss, sums = _FusedDistillationFunction.apply(
            student_hidden.contiguous(),
            student_weight,
            student_bias,
            teacher_hidden.detach().contiguous(),
            teacher_weight.detach(),
            None if teacher_bias is None else teacher_bias.detach(),
            target.contiguous(),
            scale,
            options,
            memory_budget_bytes or DEFAULT_MEMORY_BUDGET_BYTES,
        )
    return loss, sums[1], sums[2]


def fused_linear_distillation_reference(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    target,
    student_bias=None,
    teacher_bias=None,
    *,
    num_items: int | torch.Tensor = 1,
    memory_budget_bytes: int | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain PyTorch, the logits materialised: the oracle of the tests."""
    student = F.linear(student_hidden, student_weight, student_bias)
    with torch.no_grad():
        teacher = F.linear(teacher_hidden, teacher_weight, teacher_bias)
    loss, ce, div = distillation_token_losses(student, teacher, target, **options)
    n = torch.as_tensor(num_items, device=student.device).to(loss.dtype).clamp_min(1)
    return loss.sum() / n, ce.detach().sum() / n, div.detach().sum() / n
