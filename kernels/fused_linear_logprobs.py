"""Chunked lm_head losses for preference and distillation objectives: the [tokens × vocab] logits
never exist for the whole batch.

Two functions, both taking the final hidden states and the lm_head weight (so a caller can run
them inside the lm_head module's own forward, where FSDP2 / ZeRO-3 have the full weight):

``fused_linear_logprobs(hidden, weight, target)`` → per-token ``log softmax(h·Wᵀ + b)[target]``
(0 on ignored targets), fp32 [N]. Summed over a sequence's tokens it is the sequence log-prob
``log π(y|x)`` that DPO, IPO, ORPO, SimPO and KTO are written in. The preference losses are
functions of the sequences' log-probs ``ℓ_r = Σ_{t ∈ r} log p_t(y_t)``, so the gradient reaching
a token's logits z_t (row r) is

    ∂L/∂z_t = g_r · (onehot(y_t) − softmax(z_t)),     g_r = ∂L/∂ℓ_r

(times the softcap's derivative 1 − tanh²(x/c) with a final-logit cap), and g_r is only known
once the log-probs it depends on are. Two ways through, both here:

- *recompute* (the default): the forward computes the log-probs only (one matmul per token
  chunk, no gradient pass, nothing of size N × V kept); the backward redoes the chunk loop with
  the per-token upstream gradient ``g_t = g_r(t)`` fed into the cross-entropy kernel. Four
  lm_head-sized matmuls per step (logits, logits again, dX, dW), any chunk size, any loss
  downstream (autograd composes it). This is the deferred path of `fused_linear_cross_entropy`
  with ``reduction="none"`` (log-prob = −CE per token), which this function reuses.
- *one pass* (``group_loss=GroupLoss(fn, rows, size)``): when the loss is a sum over groups of
  rows (a DPO, ORPO or SimPO pair: rows i and i + R/2) and a group's term depends only on its
  own rows' ℓ (and constants such as the reference's log-probs, computed beforehand), g_r is
  known as soon as the chunk holding the group has its logits (as Liger-Kernel's
  ``LigerFusedLinearPreferenceBase`` does too). Per chunk of whole groups:

      logits_c = h_c·Wᵀ (+ b)                       matmul into one buffer, input dtype
      ℓ_r      = −Σ_t CE_t                          CE kernel, losses only (lse, target logit)
      L_c, g_r = fn(ℓ), ∂fn/∂ℓ                      autograd on the chunk's [size, groups] scalars
      dlogits_c = −g_r(t) · ∂CE_t/∂z_t              CE kernel again with that per-token scale, in place
      dh_c = dlogits_c·W,  dW += dlogits_cᵀ·h_c,  db += Σ_t dlogits_c      (fp32 accumulators)

  Three matmuls instead of four: the backward only scales the stored gradients by the incoming
  (scalar) gradient, on the device, skipping the pass when it is exactly 1. (The second CE
  launch re-reads the chunk's logits for their max and sum: memory traffic, small next to a
  matmul.) On a 1B Llama-3 shape the lm_head is about a fifth of the step's FLOPs, so the
  recompute costs ~7% more. The price: the loss must be separable by group (KTO's micro-batch-mean reference point is not),
  a chunk holds at least one whole group (2 × 4096 tokens at V = 128256 in bf16: 2.1 GB,
  above the default budget, which then does not bound the buffer), and the hidden states'
  gradient, [N, H] in the input dtype, is held from forward to backward (32 MiB at 8192 tokens
  × 2048 in bf16), as the fp32 dW accumulator is (V × H × 4 bytes) unless one chunk suffices.
  This mode stays a ``torch.autograd.Function``, not a ``ligertune::`` custom op like the fused
  cross entropy's, because its ``GroupLoss`` carries a Python callable, which no op schema can take.
  With ``GroupLoss(per_token=True)`` the loss reads each token's log-prob rather than the rows'
  sums, and its gradient reaches each token with its own scale (the same second CE launch, one
  scale per token instead of per row): the clipped policy losses of online RL
  (`fused_linear_policy_loss`), whose terms weigh every token by its own importance ratio.

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

This module is longer than the ~500 lines docs/architecture.md asks for: it holds the
objectives' two lm_head losses, which share the chunking and matmul helpers, and the log-probs'
two modes, which share one entry point, its checks and its reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._utils import use_triton
from .chunking import DISTILL_BUFFERS
from .cross_entropy import CEOptions, keep_stored_grads, launch_cross_entropy, row_outputs, scale_stored_grads
from .fused_linear_cross_entropy import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    _accumulate_linear_grads,
    _ce_options,
    _check_linear,
    _finish_linear_grads,
    _mixed_matmul_supported,
    chunk_rows,
    fused_linear_cross_entropy,
)

__all__ = [
    "DIVERGENCES",
    "GroupLoss",
    "GroupedLogprobs",
    "distillation_token_losses",
    "fused_linear_distillation",
    "fused_linear_distillation_reference",
    "fused_linear_logprobs",
    "fused_linear_logprobs_reference",
]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


class GroupLoss(NamedTuple):
    """A loss of groups of rows' sequence log-probs, for `fused_linear_logprobs`'s one-pass mode.

    The tokens are ``rows`` rows of equal length, and group i is rows i, i + G, i + 2G, …
    (G = rows / size): with ``size=2``, row i and row i + R/2, a preference pair as the
    objectives lay it out (first sequences, then second ones).

    ``fn(row_logps, groups)`` is called once per chunk: ``row_logps`` [size, g] holds the Σ
    log-probs of the chunk's rows (member j of the chunk's k-th group, i.e. of group
    ``groups.start + k``, at [j, k]) and ``groups`` is the slice of group indices the chunk
    holds, to index the caller's per-group or per-row constants. It returns the chunk's loss (a
    0-d tensor, differentiable in ``row_logps``) or ``(loss, extras)``, ``extras`` a dict of
    tensors with one leading entry per group of the chunk (metrics), returned detached and
    concatenated over the chunks. The total loss is the sum of the chunks' losses, so a group's
    term must read only its own rows (the chunking is the kernel's choice).

    ``per_token=True``: ``fn`` gets the rows' per-token log-probs [size, g, seq] instead of
    their sums (0 on ignored targets), for a loss that weighs each token by its own log-prob
    (the clipped policy-gradient losses, `ligertune.kernels.fused_linear_policy_loss`); its
    gradient then reaches each token's logits with that token's own scale.
    """

    fn: Callable[[torch.Tensor, slice], torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]]
    rows: int
    size: int = 2
    per_token: bool = False


class GroupedLogprobs(NamedTuple):
    """What `fused_linear_logprobs` returns in its one-pass mode."""

    loss: torch.Tensor  # 0-d: Σ over the chunks of GroupLoss.fn; differentiable in hidden, weight, bias
    row_logps: torch.Tensor  # [rows] fp32, detached: each row's Σ log-probs
    row_tokens: torch.Tensor  # [rows] int64: each row's non-ignored targets
    extras: dict[str, torch.Tensor]  # GroupLoss.fn's extras, [groups, ...] each, detached


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    memory_budget_bytes: int | None = None,
    group_loss: GroupLoss | None = None,
) -> torch.Tensor | GroupedLogprobs:
    """``log_softmax(hidden @ weight.T + bias)[i, target[i]]`` for every row, fp32 [N]; 0 where
    ``target == ignore_index``. Differentiable w.r.t. hidden, weight and bias (see the module
    docstring: the backward recomputes the chunks' logits with the per-row upstream gradient).

    With ``group_loss``, the loss of those log-probs summed per row and grouped (`GroupLoss`)
    instead, its gradient computed in this same pass over chunks of whole groups (module
    docstring, "one pass"): a `GroupedLogprobs`. One entry point for both, so a caller running
    it inside the lm_head's call picks the path with an argument.

    hidden: [N, H]; weight: [V, H]; target: [N] int64; softcap: Gemma 2's final-logit softcap.
    """
    if group_loss is not None:
        return _grouped_logprobs(
            hidden, weight, target, bias, group_loss, ignore_index, softcap, memory_budget_bytes
        )
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
    hidden,
    weight,
    target,
    bias=None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    group_loss: GroupLoss | None = None,
    **_,
) -> torch.Tensor | GroupedLogprobs:
    """Plain PyTorch: the logits materialised, ``log_softmax`` in fp32 (fp64 for fp64 inputs),
    gathered at the targets; with ``group_loss``, summed per row and ``GroupLoss.fn`` applied to
    all groups at once (autograd does the rest). The oracle of the tests, what a TRL-style loss
    computes, and the fallback where Triton cannot run."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = target != ignore_index
    logp = logits.log_softmax(-1).gather(-1, torch.where(valid, target, 0)[:, None])[:, 0]
    logp = torch.where(valid, logp, 0.0)
    if group_loss is None:
        return logp
    rows = logp.view(group_loss.rows, -1).sum(-1)
    size, groups = group_loss.size, _groups(group_loss)
    seen = logp.view(size, groups, -1) if group_loss.per_token else rows.view(size, groups)
    loss, extras = _loss_and_extras(group_loss.fn(seen, slice(0, groups)))
    return GroupedLogprobs(loss, rows.detach(), _row_tokens(target, group_loss, ignore_index), extras)


# --------------------------------------------------------------------------------------------
# One pass over chunks of whole groups
# --------------------------------------------------------------------------------------------


def _groups(group_loss: GroupLoss) -> int:
    return group_loss.rows // group_loss.size


def _row_tokens(target, group_loss: GroupLoss, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index).view(group_loss.rows, -1).sum(-1)


def _loss_and_extras(out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`GroupLoss.fn`'s result as (loss, extras detached)."""
    loss, extras = out if isinstance(out, tuple) else (out, {})
    return loss, {k: v.detach() for k, v in extras.items()}


def _check_groups(n_tokens: int, group_loss: GroupLoss) -> None:
    rows, size = group_loss.rows, group_loss.size
    if not callable(group_loss.fn):
        raise ValueError(f"group_loss.fn is {type(group_loss.fn).__name__}: expected fn(row_logps, groups)")
    if not (isinstance(rows, int) and isinstance(size, int) and rows >= 1 and size >= 1 and rows % size == 0):
        raise ValueError(
            f"group_loss has rows={rows!r}, size={size!r}: need positive ints with rows a multiple of size "
            "(a group is `size` rows, one from each block of rows / size)"
        )
    if n_tokens < rows or n_tokens % rows:
        raise ValueError(
            f"{n_tokens} tokens do not split into group_loss.rows={rows} rows of equal length: pass the "
            "hidden states of [rows, seq] tokens flattened to [rows · seq, H]"
        )


def _evaluate(fn, row_logps: torch.Tensor, groups: slice, compute_grad: bool):
    """(loss, extras, ∂loss/∂row_logps or None) of one chunk: autograd on its [size, g] scalars."""
    leaf = row_logps.detach().requires_grad_(compute_grad)
    with torch.set_grad_enabled(compute_grad):
        loss, extras = _loss_and_extras(fn(leaf, groups))
        grad = None
        if compute_grad and loss.requires_grad:
            grad = torch.autograd.grad(loss, leaf, allow_unused=True, materialize_grads=True)[0]
        elif compute_grad:  # a chunk whose loss does not depend on its rows
            grad = torch.zeros_like(leaf)
    return loss.detach(), extras, grad


def _groups_per_chunk(n_groups: int, group_elements: int, hidden, wide_dw: bool, budget: int) -> int:
    """`chunk_rows` over groups, each a [size · seq, V] block of the logits buffer; where dW is
    summed in a wider dtype and torch has no mixed-precision addmm, the sliced accumulation's
    temporary takes half of the budget (as in the fused cross entropy)."""
    per_chunk = chunk_rows(n_groups, group_elements, hidden.element_size(), budget)
    if wide_dw and per_chunk < n_groups and not _mixed_matmul_supported(hidden.device.type):
        per_chunk = chunk_rows(n_groups, group_elements, 2 * hidden.element_size(), budget)
    return per_chunk


def _grouped_sweep(hidden, weight, bias, target, group_loss: GroupLoss, opts: CEOptions, want, budget):
    """The one-pass loop (module docstring): ((loss, row_logps [rows], extras), (dh, dw, db)).

    A chunk takes whole groups: ``hidden`` viewed as [size, groups, seq, H], a chunk is
    [size, g, seq, H] (copied to contiguous rows when size > 1: C × H, small next to C × V).
    """
    n_tokens, n_hidden = hidden.shape
    n_cols = weight.shape[0]
    size, n_groups = group_loss.size, _groups(group_loss)
    seq = n_tokens // group_loss.rows
    group_tokens = size * seq
    want_dh, want_dw, want_db = want
    compute_grad = want_dh or want_dw or want_db
    accum = torch.promote_types(weight.dtype, torch.float32)
    per_chunk = _groups_per_chunk(
        n_groups, group_tokens * n_cols, hidden, want_dw and accum != weight.dtype, budget
    )
    single_chunk = per_chunk >= n_groups
    buffer = hidden.new_empty(per_chunk * group_tokens, n_cols)
    loss_rows, z_rows, _ = row_outputs(buffer.shape[0], hidden.device, False)

    by_group = hidden.view(size, n_groups, seq, n_hidden)
    target_by_group = target.view(size, n_groups, seq)
    row_logps = torch.empty(size, n_groups, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if want_dh else None
    dw = None
    if want_dw:
        dw = torch.empty(
            n_cols, n_hidden, dtype=weight.dtype if single_chunk else accum, device=hidden.device
        )
    db = torch.zeros(n_cols, dtype=torch.float32, device=hidden.device) if want_db else None
    total, extras = None, []

    for start in range(0, n_groups, per_chunk):
        groups = slice(start, min(start + per_chunk, n_groups))
        g = groups.stop - groups.start
        rows = g * group_tokens
        h = by_group[:, groups].reshape(rows, n_hidden)
        y = target_by_group[:, groups].reshape(rows)
        logits = buffer[:rows]
        if bias is None:
            torch.mm(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        ce = dict(loss_rows=loss_rows[:rows], z_rows=z_rows[:rows], correct_rows=None)
        launch_cross_entropy(logits, y, None, opts, grad=None, grad_scale=None, **ce)
        token_logps = -loss_rows[:rows].view(size, g, seq)
        chunk_logps = token_logps.sum(-1)
        row_logps[:, groups] = chunk_logps
        seen = token_logps if group_loss.per_token else chunk_logps
        loss, kept, grad_logps = _evaluate(group_loss.fn, seen, groups, compute_grad)
        total = loss if total is None else total + loss
        extras.append(kept)
        if not compute_grad:
            continue
        # The kernel writes scale · ∂CE/∂z and log p = −CE: scale = −∂L/∂ℓ_r on every token of
        # row r (−∂L/∂log p_t per token with per_token).
        scale = (-grad_logps).to(torch.float32)
        scale = (
            scale.reshape(rows)
            if group_loss.per_token
            else scale[..., None].expand(size, g, seq).reshape(rows)
        )
        launch_cross_entropy(logits, y, None, opts, grad=logits, grad_scale=scale, **ce)
        if want_dh:
            dh.view(size, n_groups, seq, n_hidden)[:, groups] = (logits @ weight).view(size, g, seq, n_hidden)
        _accumulate_linear_grads(dw, db, logits, h, start == 0, max(1, buffer.numel() // n_hidden))

    # Release the chunk buffer before the accumulator is rounded, so the two never coexist with the copy.
    buffer = logits = None
    dw, db = _finish_linear_grads(dw, db, weight, bias)
    kept = {k: torch.cat([chunk[k] for chunk in extras]) for k in extras[0]}
    return (total, row_logps.view(-1), kept), (dh, dw, db)


class _GroupedLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, group_loss, opts, budget, grad_enabled):
        needs = ctx.needs_input_grad
        want = (
            grad_enabled and needs[0],
            grad_enabled and needs[1],
            grad_enabled and bias is not None and needs[2],
        )
        (loss, row_logps, extras), grads = _grouped_sweep(
            hidden, weight, bias, target, group_loss, opts, want, budget
        )
        keep_stored_grads(ctx, "fused_linear_logprobs", grads, in_place=True)
        ctx.mark_non_differentiable(row_logps)
        return loss, row_logps, extras  # extras: a dict, passed through by autograd untouched

    @staticmethod
    def backward(ctx, grad_loss, _grad_rows, _grad_extras):
        return *scale_stored_grads(ctx, grad_loss), None, None, None, None, None


def _grouped_logprobs(hidden, weight, target, bias, group_loss, ignore_index, softcap, memory_budget_bytes):
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    _check_linear(hidden, weight, bias, torch.float32, memory_budget_bytes)
    _check_groups(hidden.shape[0], group_loss)
    opts = _ce_options(
        hidden,
        weight,
        target,
        None,
        ignore_index=ignore_index,
        label_smoothing=0.0,
        lse_square_scale=0.0,
        softcap=softcap,
        reduction="none",
        num_items_in_batch=None,
        return_z_loss=False,
        return_token_accuracy=False,
    )
    if not use_triton(hidden, weight):
        return fused_linear_logprobs_reference(
            hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap, group_loss=group_loss
        )
    with torch.autocast(device_type, enabled=False):
        loss, row_logps, extras = _GroupedLogprobsFunction.apply(
            hidden.contiguous(),
            weight,
            bias,
            target.contiguous(),
            group_loss,
            opts,
            memory_budget_bytes or DEFAULT_MEMORY_BUDGET_BYTES,
            torch.is_grad_enabled(),
        )
    return GroupedLogprobs(loss, row_logps, _row_tokens(target, group_loss, ignore_index), extras)


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
        rows = chunk_rows(n_rows, n_cols, 4 * DISTILL_BUFFERS, budget)
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
            _accumulate_linear_grads(dw, db, grad, h, False, max(1, rows * n_cols // n_hidden))
        ctx.save_for_backward(dh, *_finish_linear_grads(dw, db, s_weight, s_bias))
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
