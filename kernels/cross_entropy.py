"""Cross entropy over materialised logits: loss and gradient in one pass over the logits.

Math (row ``i``: logits ``x ∈ R^V``, target ``y``, class weights ``w`` — all ones when not
given —, label smoothing ``ε``, z-loss scale ``s``, optional final-logit cap ``c``)::

    z_j = c · tanh(x_j / c)            (Gemma 2/3 soft cap; z = x without it)
    lse = log Σ_j exp(z_j),   p_j = exp(z_j − lse)
    ℓ   = (1−ε) · w_y · (lse − z_y)  +  (ε/V) · Σ_j w_j · (lse − z_j)  +  s · lse²

The first two terms are exactly PyTorch's weighted, label-smoothed cross entropy (the smoothing
term weighs every class by its own weight, the nll term by the target's); the last is the z-loss,
added per token and unweighted. Differentiating, with ``W = Σ_j w_j`` (``V`` without weights)::

    ∂ℓ/∂z_j = p_j · A − (1−ε) · w_y · [j = y] − (ε/V) · w_j,    A = (1−ε) · w_y + (ε/V) · W + 2 s · lse
    ∂z_j/∂x_j = 1 − tanh²(x_j / c) = 1 − (z_j / c)²              (chain rule through the cap)

Rows whose target is ``ignore_index`` have ℓ = 0 and a zero gradient row.

Precision. The kernel never forms ``lse − z_j`` from a rounded ``lse``: rounding ``lse`` costs
half an ulp of ``|lse|`` (1.5e-5 absolute at 300), an error every ``p_j`` and every loss term
would inherit as a relative error of the same size. With ``m`` the row max and ``d = Σ_j
exp(z_j − m)`` it uses ``p_j = exp((z_j − m) − log d)``, ``lse − z_y = (m − z_y) + log d`` and
``Σ_j w_j (lse − z_j) = W · log d + Σ_j w_j (m − z_j)`` (the last sum kept relative to the running
max in the first loop). ``z_j − m`` is exact near the max and ``log d ≤ log V`` is small, so the
softmax and the loss keep fp32's relative accuracy at any logit magnitude, like PyTorch's
``log_softmax`` (which subtracts the max the same way). ``lse`` itself is used only where its
absolute value matters: the z-loss ``s · lse²`` and its gradient ``2 s · lse · p_j``.

Reductions (all normalisers stay device tensors: no host synchronisation anywhere):

* ``"sum"``: Σ_i ℓ_i.  ``"none"``: the vector ℓ (fp32).
* ``"mean"``: Σ_i ce_i / D + Σ_i s · lse_i² / T, with ``ce_i`` the first two terms of ℓ_i,
  ``T`` the number of non-ignored targets and ``D = T``, or with class weights
  ``D = Σ_{i not ignored} w_{y_i}`` — the cross entropy exactly as
  ``torch.nn.functional.cross_entropy``, whose weighted mean divides the smoothing term by that
  same weight sum. Without class weights ``D = T`` and this is Σ_i ℓ_i / T. Where PyTorch returns
  NaN (``T = 0``: every target ignored) this returns 0 with a zero gradient.
* The z-loss is divided by the token count ``T`` even with class weights (as Liger-Kernel does;
  issue #19). The weighted mean is a weighted average of the per-token cross entropy, invariant
  to multiplying every class weight by a constant; the z-loss is a regulariser on every token's
  log-partition function, which the class weights do not weigh (it is added unweighted per
  token). Dividing it by ``Σ w_y`` would make its strength depend on the arbitrary scale of the
  weights (weights ×10 → z-loss ÷10) and on the batch's class mix; dividing by ``T`` keeps ``s``
  meaning "per token", as in PaLM's definition of the z-loss.
* ``num_items_in_batch`` (only with ``reduction="mean"``): ``D`` and ``T`` are both replaced by
  the given count, so the micro-batches of a gradient-accumulation step, each divided by the
  step's total count, add up to the loss and gradient of the one big batch (with class weights
  and a z-loss the big batch has two normalisers, which one count cannot reproduce: pass the
  step's ``Σ w_y`` to match its cross entropy, its token count to match its z-loss).

``z_loss`` (when asked) is ``Σ_i s · lse_i²`` under the same reduction (for ``"mean"`` divided
by ``T``, or by ``num_items_in_batch``), returned detached for logging: its gradient is already
part of ``loss``'s. ``token_accuracy`` is the fraction of non-ignored tokens whose argmax (first
maximum on ties, like ``torch.argmax``) is the target, or, for ``reduction="none"``, a 0/1 value
per token (0 on ignored ones); it comes from the same pass over the logits. The loss is always
fp32; the gradient has the logits' dtype.

Kernel design. CE is a streaming problem: read the logits once, write the gradient once (speed
of light for bf16 8192 × 128256 on an H200 is 2 × 2.1 GB / 4.2 TB/s ≈ 1.0 ms). One program per
row runs two loops over blocks of the row: the first keeps an online max / sum-of-exponentials
(plus the smoothing sums and the running argmax), the second re-reads the row and writes the
gradient, already multiplied by the reduction's scale. The second read of a row should mostly
hit L2: a 128k bf16 row is 256 KB; compiled for sm_90 at 16 warps the kernel takes 59 registers
per thread (125 with every option on), so 1–2 programs (rows) per SM are in flight, 33–67 MB on
132 SMs against a 50 MB L2, and the second loop walks the row backwards, so the blocks read
last in the first loop are re-read first. The gradient can overwrite the logits
(``inplace_backward=True``), which is how the fused linear cross entropy uses this kernel.

Since the gradient is computed in the forward pass, ``backward`` only multiplies it by the
incoming gradient. That multiply is done by a kernel that reads the scalar on the device and
skips the whole pass when it is exactly 1 (the usual case), so no host has to look at it; for
bf16 logits any other value rounds the stored bf16 gradient a second time (≤ 1 more ulp). For
``reduction="none"`` the stored gradient is per-token unscaled and ``backward`` scales row ``i``
by ``grad_output[i]``. Backward may run once per forward (the stored gradient is scaled in place).

Custom ops (docs/perf-notes.md, "Custom ops"). The launch is ``ligertune::cross_entropy_fwd``,
a ``torch.library`` custom op returning (loss, z_loss, token_accuracy, gradient) with a fake
implementation and an autograd formula, so torch.compile records one node and never traces the
launch. Its backward, shared with the fused linear cross entropy (`scale_stored_grads`), scales
the stored gradient in place with ``ligertune::scale_rows_`` (an op declaring the overwrite) in
eager mode; under torch.compile it multiplies into a fresh tensor, the compiled graph owning its
buffers, and a second backward is then allowed. ``inplace_backward`` is the mutating op
``ligertune::cross_entropy_fwd_``, taken in eager mode only; torch.library registers no autograd
formula for a mutating op, so a small ``autograd.Function`` supplies it there.

Target values outside ``[0, V)`` that are not ``ignore_index``: on CPU tensors they raise a
``ValueError`` up front; on a GPU checking them would need a host sync, so the kernel instead
makes that row's loss NaN, which a training loop's non-finite-loss guard catches.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from ._utils import INTERPRET, next_power_of_2, num_warps_for, use_triton

__all__ = ["CrossEntropyLoss", "CrossEntropyOutput", "cross_entropy", "cross_entropy_reference"]

REDUCTIONS = ("mean", "sum", "none")

# Columns per loop iteration. On a GPU, 16384 bf16 (32 KB) per iteration with 16 warps keeps 32
# values per thread in flight: a 128k row takes 8 iterations per pass. Under the interpreter the
# cost is per iteration, not per element, but a small block makes the CPU tests (vocab ≤ 4096)
# cover the multi-block loop and a partial last block.
_GPU_BLOCK = 16384
_INTERPRET_BLOCK = 1024
# Columns per iteration of the rescaling kernel (rows of gradients: vocab or hidden sized).
_SCALE_BLOCK = 4096
# Start of the running max: below every finite logit a model produces. A finite start (rather
# than −inf) keeps exp(m_old − m_new) defined when a whole block is −inf (a masked-out part of
# the vocabulary). constexpr: compiled kernels may only read constexpr globals.
_MAX_FLOOR = tl.constexpr(-3.0e38)


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy`` returns when ``return_z_loss`` or ``return_token_accuracy`` is set."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None


class CEOptions(NamedTuple):
    """Validated cross-entropy options, shared with the fused linear cross entropy."""

    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: float | None
    reduction: str
    return_z_loss: bool
    return_token_accuracy: bool


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # libdevice's tanh does not run under the CPU interpreter. 2σ(2x) − 1 is exact in real
    # arithmetic; its absolute error (~1e-7) times the cap stays below a bf16 logit's own rounding.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _cross_entropy_kernel(
    LOGITS,
    GRAD,
    TARGET,
    CLASS_WEIGHT,
    LOSS,
    Z_LOSS,
    CORRECT,
    GRAD_SCALE,
    Z_GRAD_SCALE,
    stride_logits,
    stride_grad,
    stride_grad_scale,
    stride_z_grad_scale,
    n_cols,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ACC: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 row offsets: 8192 rows × 256000 columns already pass 2³¹.
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride_logits
    GRAD += row * stride_grad
    offs = tl.arange(0, BLOCK)
    y = tl.load(TARGET + row).to(tl.int64)

    if y == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(Z_LOSS + row, 0.0)
        if COMPUTE_ACC:
            tl.store(CORRECT + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=GRAD.dtype.element_ty)
            for start in range(0, n_cols, BLOCK):
                tl.store(GRAD + start + offs, zeros, mask=start + offs < n_cols)
        return

    # Pass 1: online max and sum of exponentials (and the smoothing sums and the argmax).
    m = tl.full([], _MAX_FLOOR, tl.float32)
    d = tl.zeros([], tl.float32)
    sum_wdz = tl.zeros([], tl.float32)  # Σ_j w_j (m − z_j) over the columns so far (smoothing only)
    sum_w = tl.zeros([], tl.float32)  # Σ_j w_j over the columns so far (smoothing only)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        z = tl.load(LOGITS + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if COMPUTE_ACC:
            # On the raw logits: the cap is monotonic but may round distinct values to one.
            blk_best, blk_idx = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
            best_idx = tl.where(blk_best > best, start + blk_idx, best_idx)
            best = tl.maximum(best, blk_best)
        if HAS_SOFTCAP:
            z = tl.where(mask, softcap * _tanh(z / softcap), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                w = tl.load(CLASS_WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                w = mask.to(tl.float32)
            # Moving the running max from m to m_new adds (m_new − m) to every m − z_j seen so far.
            sum_wdz += sum_w * (m_new - m) + tl.sum(w * tl.where(mask, m_new - z, 0.0), axis=0)
            sum_w += tl.sum(w, axis=0)
        m = m_new
    log_d = tl.log(d)
    lse = m + log_d

    # A target outside [0, V) reads NaN instead of out-of-bounds memory: the row's loss is NaN.
    y_ok = (y >= 0) & (y < n_cols)
    z_y = tl.load(LOGITS + y, mask=y_ok, other=float("nan")).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * _tanh(z_y / softcap)
    if HAS_WEIGHT:
        w_y = tl.load(CLASS_WEIGHT + y, mask=y_ok, other=float("nan")).to(tl.float32)
    else:
        w_y = 1.0
    eps_per_class = label_smoothing / n_cols

    # lse − z_j = (m − z_j) + log d: never lse − z_j itself, whose rounding of lse (half an ulp of
    # |lse|, 1.5e-5 at 300) would be the error of every term (module docstring, "Precision").
    z_loss = lse_square_scale * lse * lse
    loss = (1.0 - label_smoothing) * w_y * ((m - z_y) + log_d) + z_loss
    if HAS_SMOOTHING:
        loss += eps_per_class * (sum_w * log_d + sum_wdz)
    tl.store(LOSS + row, loss)
    tl.store(Z_LOSS + row, z_loss)
    if COMPUTE_ACC:
        tl.store(CORRECT + row, (best_idx == y).to(tl.float32))

    # Pass 2: the gradient, scaled by the reduction's factor, written over GRAD (may alias LOGITS:
    # every element is read before the same program overwrites it).
    if COMPUTE_GRAD:
        scale = tl.load(GRAD_SCALE + row * stride_grad_scale).to(tl.float32)
        z_scale = tl.load(Z_GRAD_SCALE + row * stride_z_grad_scale).to(tl.float32)
        a = (1.0 - label_smoothing) * w_y
        if HAS_SMOOTHING:
            a += eps_per_class * sum_w
        a = a * scale + (2.0 * lse_square_scale * lse) * z_scale
        at_target = scale * (1.0 - label_smoothing) * w_y
        # Backwards over the row: the blocks pass 1 read last are the likeliest to still be in L2.
        n_blocks = tl.cdiv(n_cols, BLOCK)
        for i in range(0, n_blocks):
            cols = (n_blocks - 1 - i) * BLOCK + offs
            mask = cols < n_cols
            z = tl.load(LOGITS + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(z / softcap)
                z = softcap * t
            # p_j = exp((z_j − m) − log d): z_j − m is exact near the max (Sterbenz), log d small.
            g = tl.exp((z - m) - log_d) * a
            if HAS_SMOOTHING:
                if HAS_WEIGHT:
                    w = tl.load(CLASS_WEIGHT + cols, mask=mask, other=0.0).to(tl.float32)
                    g -= (scale * eps_per_class) * w
                else:
                    g -= scale * eps_per_class
            g = tl.where(cols == y, g - at_target, g)
            if HAS_SOFTCAP:
                g *= 1.0 - t * t
            tl.store(GRAD + cols, g.to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows_kernel(X, SCALE, stride_x, stride_scale, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(SCALE + row * stride_scale).to(tl.float32)
    ptrs = X + row * stride_x + tl.arange(0, BLOCK)
    # The incoming gradient is almost always exactly 1: deciding that here, on the device, saves a
    # full read and write of the gradient without a host sync.
    if s != 1.0:
        for start in range(0, n_cols, BLOCK):
            mask = start + tl.arange(0, BLOCK) < n_cols
            x = tl.load(ptrs + start, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs + start, (x * s).to(X.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch helpers (shared with fused_linear_cross_entropy.py)
# --------------------------------------------------------------------------------------------


def launch_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    opts: CEOptions,
    *,
    loss_rows: torch.Tensor,
    z_rows: torch.Tensor,
    correct_rows: torch.Tensor | None,
    grad: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    z_grad_scale: torch.Tensor | None = None,
) -> None:
    """Run the kernel over the rows of ``logits`` [N, V] (unit column stride).

    Writes per-row fp32 ``loss_rows``, ``z_rows`` and (if given) ``correct_rows``; when ``grad``
    is given (it may be ``logits`` itself) writes ∂ℓ_i/∂x_i · scale_i into it, where ``grad_scale``
    is a 0-d tensor (one scale for all rows) or an [N] tensor (row ``i`` uses element ``i``).
    ``z_grad_scale`` (same forms; ``grad_scale`` when None) scales the z-loss term's part of the
    gradient instead: the two differ for a class-weighted mean (``reduction_scales``).
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    block = min(next_power_of_2(n_cols), _INTERPRET_BLOCK if INTERPRET else _GPU_BLOCK)
    compute_grad = grad is not None
    if z_grad_scale is None:
        z_grad_scale = grad_scale
    _cross_entropy_kernel[(n_rows,)](
        logits,
        grad if compute_grad else logits,
        target,
        class_weight if class_weight is not None else loss_rows,
        loss_rows,
        z_rows,
        correct_rows if correct_rows is not None else loss_rows,
        grad_scale if compute_grad else loss_rows,
        z_grad_scale if compute_grad else loss_rows,
        logits.stride(0),
        grad.stride(0) if compute_grad else 0,
        grad_scale.stride(0) if compute_grad and grad_scale.dim() == 1 else 0,
        z_grad_scale.stride(0) if compute_grad and z_grad_scale.dim() == 1 else 0,
        n_cols,
        opts.ignore_index,
        opts.label_smoothing,
        opts.lse_square_scale,
        opts.softcap if opts.softcap is not None else 1.0,
        HAS_WEIGHT=class_weight is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0.0,
        HAS_SOFTCAP=opts.softcap is not None,
        COMPUTE_ACC=correct_rows is not None,
        COMPUTE_GRAD=compute_grad,
        BLOCK=block,
        num_warps=num_warps_for(block),
    )


@torch.library.custom_op("ligertune::scale_rows_", mutates_args=("x",))
def scale_rows_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``x *= scale`` in place for a contiguous ``x`` viewed as rows of its last dimension.

    ``scale`` is a 0-d tensor or one value per row (any stride, e.g. an expanded gradient). Rows
    whose scale is exactly 1 are left untouched without the host reading the value. A custom op
    that declares the buffer it overwrites (the eager backward of the losses, `scale_stored_grads`).
    """
    rows = x.view(-1, x.shape[-1])
    if rows.numel() == 0:
        return
    block = min(next_power_of_2(rows.shape[1]), _SCALE_BLOCK)
    _scale_rows_kernel[(rows.shape[0],)](
        rows,
        scale,
        rows.stride(0),
        scale.stride(0) if scale.dim() == 1 else 0,
        rows.shape[1],
        BLOCK=block,
        num_warps=num_warps_for(block),
    )


@scale_rows_.register_fake
def _(x, scale):
    return None


def reduction_scales(
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    opts: CEOptions,
    num_items: torch.Tensor | None,
    n_cols: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, z_scale, n_valid): the factors of the summed cross entropy and of the summed
    z-loss, and the non-ignored count.

    All are 0-d fp32 tensors on ``target``'s device, computed without a host sync; ``num_items``
    is the count as `count_arg` passes it. The scale is 1 for "sum" and "none"; for "mean" it is
    1/D (0 when D = 0, see the module docstring). ``z_scale`` is ``scale`` itself, except for a
    class-weighted mean without ``num_items``, where it is 1/(non-ignored tokens) and ``scale``
    is 1/Σ w_y (module docstring, "Reductions").
    """
    device = target.device
    valid = target != opts.ignore_index
    n_valid = valid.sum(dtype=torch.float32)
    if num_items is not None:
        denom = num_items.to(device=device, dtype=torch.float32).reshape(())
    elif opts.reduction == "mean":
        if class_weight is None:
            denom = n_valid
        else:
            # Out-of-range targets (NaN rows, see the docstring) read a clamped weight here.
            w_y = class_weight.float()[target.clamp(0, n_cols - 1)]
            denom = torch.where(valid, w_y, 0.0).sum()
    else:
        one = torch.ones((), dtype=torch.float32, device=device)
        return one, one, n_valid
    scale = torch.where(denom > 0, 1.0 / denom, 0.0)
    if opts.reduction != "mean" or class_weight is None or num_items is not None:
        return scale, scale, n_valid
    return scale, torch.where(n_valid > 0, 1.0 / n_valid.clamp_min(1.0), 0.0), n_valid


def reduce_rows(
    loss_rows: torch.Tensor,
    z_rows: torch.Tensor,
    correct_rows: torch.Tensor | None,
    scale: torch.Tensor,
    z_scale: torch.Tensor,
    n_valid: torch.Tensor,
    opts: CEOptions,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, z_loss or None, token_accuracy or None) from the per-row kernel outputs.

    ``loss_rows`` include the z-loss; ``scale`` and ``z_scale`` as from `reduction_scales`, so the
    loss is ``scale · Σ ℓ_i + (z_scale − scale) · Σ z_i``."""
    z = z_rows if opts.return_z_loss else None
    if opts.reduction == "none":
        return loss_rows, z, correct_rows
    loss = loss_rows.sum() * scale
    if z_scale is not scale:
        loss = loss + z_rows.sum() * (z_scale - scale)
    if z is not None:
        z = z.sum() * z_scale
    acc = None if correct_rows is None else correct_rows.sum() / n_valid.clamp_min(1.0)
    return loss, z, acc


def row_outputs(n_rows: int, device: torch.device, with_accuracy: bool):
    """Fresh fp32 per-row outputs for ``launch_cross_entropy``: (loss_rows, z_rows, correct_rows or None)."""
    f32 = dict(dtype=torch.float32, device=device)
    correct_rows = torch.empty(n_rows, **f32) if with_accuracy else None
    return torch.empty(n_rows, **f32), torch.empty(n_rows, **f32), correct_rows


def op_outputs(like: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``tensors`` as a custom op returns them: an absent one (None) as an empty tensor of
    ``like``'s dtype (an op's outputs are a fixed list of tensors)."""
    return tuple(like.new_empty(0) if t is None else t for t in tensors)


def fake_loss_outputs(target: torch.Tensor, reduction: str, return_z_loss: bool, return_token_accuracy: bool):
    """The fake (loss, z_loss, token_accuracy) of the loss ops: fp32, one value per row for
    ``reduction="none"`` else 0-d; an output not asked for is empty."""
    shape = (target.shape[0],) if reduction == "none" else ()

    def f32(wanted: bool) -> torch.Tensor:
        return target.new_empty(shape if wanted else (0,), dtype=torch.float32)

    return f32(True), f32(return_z_loss), f32(return_token_accuracy)


def keep_stored_grads(ctx, name: str, grads, in_place: bool) -> None:
    """Save the gradients that a forward pass computed (None where not wanted) for
    `scale_stored_grads`. ``name``: the public function, for the error of a second backward."""
    ctx.save_for_backward(*grads)
    ctx.stored_grads_of, ctx.scale_in_place, ctx.backward_done = name, in_place, False


def scale_stored_grads(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward of a loss whose gradients were computed in its forward pass (the cross
    entropy, the fused linear cross entropy, the one-pass group loss): each stored gradient
    times the incoming ``grad_loss`` (0-d, or one value per row for ``reduction="none"``).

    In eager mode (``in_place``) the gradients are scaled in their own memory by `scale_rows_`,
    which skips the pass when the scale is exactly 1 (the usual case): no second [N, V], [N, H]
    or [V, H] buffer. That can happen once: a second backward through the same forward
    (``retain_graph=True``, or double backward) would scale them twice, so it raises. Under
    torch.compile the product is a fresh tensor, computed as the kernel does (fp32 product,
    rounded once to the gradient's dtype): the compiled graph plans its own buffers, inductor
    fuses the multiply into one pass, and nothing is overwritten, so a second backward is right.
    """
    if not ctx.scale_in_place:
        scale = grad_loss if grad_loss.dim() == 0 else grad_loss[:, None]
        return tuple(None if g is None else (g.float() * scale).to(g.dtype) for g in ctx.saved_tensors)
    # Checked before the saved tensors are read: the first backward bumped their version.
    name = ctx.stored_grads_of
    if ctx.backward_done:
        raise RuntimeError(
            f"{name}'s backward ran twice: its gradients are computed once and scaled in place; "
            f"retain_graph / double backward are not supported (use {name}_reference for that)"
        )
    ctx.backward_done = True
    grads = ctx.saved_tensors
    for g in grads:
        if g is not None:
            scale_rows_(g, grad_loss)
    return grads


def package(loss, z_loss, token_accuracy, opts: CEOptions):
    """The public return convention: the loss alone, or a ``CrossEntropyOutput`` (the outputs
    not asked for are None)."""
    if opts.return_z_loss or opts.return_token_accuracy:
        return CrossEntropyOutput(
            loss,
            z_loss if opts.return_z_loss else None,
            token_accuracy if opts.return_token_accuracy else None,
        )
    return loss


def check_options(
    n_rows: int,
    n_cols: int,
    device: torch.device,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    *,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    reduction,
    num_items_in_batch,
    return_z_loss,
    return_token_accuracy,
    weight_name: str = "weight",
) -> CEOptions:
    """Validate everything but the logits themselves; raise ValueError naming the problem and the fix."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {REDUCTIONS}")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise ValueError(f"ignore_index={ignore_index!r}: must be an int (-100 by convention)")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must be in [0, 1]")
    if not float(lse_square_scale) >= 0.0:
        raise ValueError(f"lse_square_scale={lse_square_scale}: the z-loss scale must be ≥ 0 (e.g. 1e-4)")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap={softcap}: must be > 0 (Gemma 2 uses 30.0); pass None to disable it")
    if n_cols == 0:
        raise ValueError("the vocabulary is empty: logits need at least one column")
    if target.dim() != 1 or target.shape[0] != n_rows:
        raise ValueError(
            f"target has shape {tuple(target.shape)}; expected [{n_rows}] (one class index per logits row: "
            "flatten [batch, seq] targets with .reshape(-1))"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"target has dtype {target.dtype}: class indices must be integers (torch.long)")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but the logits are on {device}: move it with .to()")
    # Values are read by the host only on CPU and outside torch.compile: a read is a host sync on
    # a GPU (the kernel makes such rows NaN instead) and a graph break under compile.
    host_reads = not torch.compiler.is_compiling()
    if target.device.type == "cpu" and n_rows > 0 and host_reads:
        bad = (target != ignore_index) & ((target < 0) | (target >= n_cols))
        if bool(bad.any()):
            raise ValueError(
                f"target has {int(bad.sum())} values outside [0, {n_cols}) that are not ignore_index={ignore_index} "
                f"(first: {int(target[bad][0])}): check the tokenizer's vocabulary size against the model's"
            )
    if class_weight is not None:
        if class_weight.shape != (n_cols,) or not class_weight.dtype.is_floating_point:
            raise ValueError(
                f"{weight_name} (class weights) has shape {tuple(class_weight.shape)} and dtype {class_weight.dtype}; "
                f"expected a floating tensor of shape [{n_cols}] (one weight per class)"
            )
        if class_weight.device != device:
            raise ValueError(f"{weight_name} (class weights) is on {class_weight.device}, not {device}")
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError(
                f"num_items_in_batch replaces the denominator of reduction='mean'; got reduction={reduction!r}"
            )
        count = num_items_in_batch
        if isinstance(count, torch.Tensor):
            if count.numel() != 1:
                raise ValueError(
                    f"num_items_in_batch has shape {tuple(count.shape)}: pass one count (0-d tensor or int)"
                )
            # Only a count in CPU memory can be checked for free; on the device (or under
            # compile) a count ≤ 0 gives a zero loss.
            count = count.item() if count.device.type == "cpu" and host_reads else 1
        if not isinstance(count, numbers.Real) or not count > 0:
            raise ValueError(
                f"num_items_in_batch={num_items_in_batch!r}: must be a positive number or a 0-d tensor"
            )
    return CEOptions(
        ignore_index=int(ignore_index),
        label_smoothing=float(label_smoothing),
        lse_square_scale=float(lse_square_scale),
        softcap=None if softcap is None else float(softcap),
        reduction=reduction,
        return_z_loss=bool(return_z_loss),
        return_token_accuracy=bool(return_token_accuracy),
    )


def count_arg(num_items_in_batch, device: torch.device) -> torch.Tensor | None:
    """``num_items_in_batch`` as the loss ops take it: None, or a tensor on ``device``.

    A count in device memory, or in CPU memory for CPU logits, stays as it is (no host sync;
    under torch.compile, no graph break). A Python number, or a count in CPU memory for GPU
    logits, is filled on the device from the host's value: copying it from pageable memory
    would wait for the stream.
    """
    count = num_items_in_batch
    if count is None or (isinstance(count, torch.Tensor) and (count.device == device or count.is_cuda)):
        return count
    if isinstance(count, torch.Tensor):
        count = count.item()
    return torch.full((), float(count), dtype=torch.float32, device=device)


def _logits_options(logits: torch.Tensor, target, weight, **options) -> CEOptions:
    """``check_options`` preceded by the checks of the logits themselves."""
    if logits.dim() != 2:
        raise ValueError(
            f"logits have shape {tuple(logits.shape)}; expected [N, V]: flatten with .reshape(-1, logits.shape[-1])"
        )
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits have dtype {logits.dtype}; expected a floating dtype (bf16, fp16, fp32)")
    return check_options(*logits.shape, logits.device, target, weight, **options)


# --------------------------------------------------------------------------------------------
# Custom ops and their autograd (the scaling backward is shared with the fused linear CE)
# --------------------------------------------------------------------------------------------
# Each launch is a ``torch.library`` custom op: torch.compile records one node with a fake
# implementation and an autograd formula, never the launch code. The options are the CEOptions
# fields in order, flattened into scalar arguments, and the count a tensor (`count_arg`). Ops never
# return an alias of an input: the forward writing the gradient over the logits is its own op,
# declaring the overwrite, used in eager mode only (docs/perf-notes.md, "Custom ops").


def _launch_and_reduce(logits, target, class_weight, num_items, opts: CEOptions, grad):
    """(loss, z_loss, token_accuracy) of the logits as the ops return them; the gradient, times
    the reduction's factor (per token unscaled for "none"), written into ``grad`` unless None."""
    scale, z_scale, n_valid = reduction_scales(target, class_weight, opts, num_items, logits.shape[1])
    rows = row_outputs(logits.shape[0], logits.device, opts.return_token_accuracy)
    launch_cross_entropy(
        logits,
        target,
        class_weight,
        opts,
        loss_rows=rows[0],
        z_rows=rows[1],
        correct_rows=rows[2],
        grad=grad,
        grad_scale=scale,
        z_grad_scale=z_scale,
    )
    return op_outputs(rows[0], *reduce_rows(*rows, scale, z_scale, n_valid, opts))


@torch.library.custom_op("ligertune::cross_entropy_fwd", mutates_args=())
def _cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    num_items: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    reduction: str,
    return_z_loss: bool,
    return_token_accuracy: bool,
    compute_grad: bool,
    scale_in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z_loss, token_accuracy, grad)``, those not asked for empty. ``grad`` is the
    gradient of the loss w.r.t. the logits (per token for "none"), kept for the backward.
    ``scale_in_place`` is not used here: it is an input so that the autograd formula (which sees
    the op's inputs) knows whether the backward may overwrite ``grad``."""
    opts = CEOptions(
        ignore_index,
        label_smoothing,
        lse_square_scale,
        softcap,
        reduction,
        return_z_loss,
        return_token_accuracy,
    )
    grad = torch.empty_like(logits) if compute_grad else None
    return *_launch_and_reduce(logits, target, class_weight, num_items, opts, grad), *op_outputs(logits, grad)


@_cross_entropy_fwd.register_fake
def _(
    logits,
    target,
    class_weight,
    num_items,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    reduction,
    return_z_loss,
    return_token_accuracy,
    compute_grad,
    scale_in_place,
):
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
    return *fake_loss_outputs(target, reduction, return_z_loss, return_token_accuracy), grad


def _cross_entropy_setup(ctx, inputs, output):
    compute_grad, scale_in_place = inputs[-2:]
    _, z, acc, grad = output
    # z_loss and token_accuracy are reported values (the z-loss's gradient is part of the loss's);
    # outputs without a gradient get None in backward instead of materialised zeros.
    ctx.mark_non_differentiable(z, acc, grad)
    ctx.set_materialize_grads(False)
    keep_stored_grads(ctx, "cross_entropy", [grad if compute_grad else None], scale_in_place)


def _cross_entropy_backward(ctx, grad_loss, _grad_z, _grad_acc, _grad_grad):
    (grad,) = scale_stored_grads(ctx, grad_loss)
    return grad, *(None,) * 12


_cross_entropy_fwd.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


@torch.library.custom_op("ligertune::cross_entropy_fwd_", mutates_args=("logits",))
def _cross_entropy_fwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    num_items: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    reduction: str,
    return_z_loss: bool,
    return_token_accuracy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z_loss, token_accuracy)`` as `_cross_entropy_fwd`, the gradient written over
    ``logits`` (``inplace_backward``: no second [N, V] buffer)."""
    opts = CEOptions(
        ignore_index,
        label_smoothing,
        lse_square_scale,
        softcap,
        reduction,
        return_z_loss,
        return_token_accuracy,
    )
    return _launch_and_reduce(logits, target, class_weight, num_items, opts, logits)


@_cross_entropy_fwd_.register_fake
def _(
    logits,
    target,
    class_weight,
    num_items,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    reduction,
    return_z_loss,
    return_token_accuracy,
):
    return fake_loss_outputs(target, reduction, return_z_loss, return_token_accuracy)


class _GradOverLogits(torch.autograd.Function):
    """The autograd of `_cross_entropy_fwd_`. ``register_autograd`` takes no formula for an op
    that mutates its inputs, and a functional op may not hand back its input's memory as the
    gradient; torch's advice for a mutating op is an autograd.Function around it. It runs in
    eager mode only (`cross_entropy` takes it outside compilation), so dynamo never traces it."""

    @staticmethod
    def forward(ctx, logits, *args):
        loss, z, acc = _cross_entropy_fwd_(logits, *args)
        ctx.mark_non_differentiable(z, acc)
        keep_stored_grads(ctx, "cross_entropy", [logits], in_place=True)
        return loss, z, acc

    @staticmethod
    def backward(ctx, grad_loss, _grad_z, _grad_acc):
        (grad,) = scale_stored_grads(ctx, grad_loss)
        return grad, *(None,) * 10


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    inplace_backward: bool = False,
):
    """Cross entropy of ``logits`` [N, V] against ``target`` [N] (see the module docstring for the math).

    Args:
        weight: class weights [V] (``torch.nn.functional.cross_entropy`` semantics).
        ignore_index: targets with this value contribute 0 to the loss and get a zero gradient.
        label_smoothing: ε in [0, 1].
        lse_square_scale: z-loss scale ``s``; adds ``s · lse²`` per token.
        softcap: ``c`` for ``z = c · tanh(x / c)`` applied before the softmax (Gemma 2/3), or None.
        reduction: "mean", "sum" or "none".
        num_items_in_batch: with ``reduction="mean"``, divide the sum by this count (int or 0-d
            tensor) instead of by this batch's own count — for gradient accumulation.
        return_z_loss, return_token_accuracy: also return these (as a ``CrossEntropyOutput``).
        inplace_backward: write the gradient over ``logits`` (saves an [N, V] buffer). Only when
            nothing else will read the logits afterwards — autograd cannot detect the overwrite.
            Ignored under torch.compile, whose graph owns its buffers.

    Returns:
        The fp32 loss, or ``CrossEntropyOutput(loss, z_loss, token_accuracy)`` when a return flag is set.
    """
    opts = _logits_options(
        logits,
        target,
        weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
    )
    if not use_triton(logits):
        return reference_loss(logits, target, weight, opts, num_items_in_batch)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    args = (
        target.contiguous(),
        None if weight is None else weight.contiguous(),
        count_arg(num_items_in_batch, logits.device),
        *opts,
    )
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    # Under torch.compile nothing is overwritten: the compiled graph owns its buffers.
    eager = not torch.compiler.is_compiling()
    if inplace_backward and compute_grad and eager:
        loss, z, acc = _GradOverLogits.apply(logits, *args)
    else:
        loss, z, acc, _ = _cross_entropy_fwd(logits, *args, compute_grad, eager)
    return package(loss, z, acc, opts)


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    inplace_backward: bool = False,
):
    """Pure-PyTorch ``cross_entropy`` with the same arguments and results (``inplace_backward`` is
    ignored). Computes in fp32 (fp64 for fp64 logits) through ``log_softmax``; differentiable by
    autograd. The CPU fallback of ``cross_entropy`` and the reference of its tests."""
    opts = _logits_options(
        logits,
        target,
        weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
    )
    return reference_loss(logits, target, weight, opts, num_items_in_batch)


def reference_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    opts: CEOptions,
    num_items_in_batch: int | torch.Tensor | None,
):
    """The math of ``cross_entropy_reference`` on inputs already validated by ``check_options``
    (also the CPU fallback of ``cross_entropy`` and of the fused linear cross entropy)."""
    n_cols = logits.shape[1]
    x = logits if logits.dtype == torch.float64 else logits.float()
    if opts.softcap is not None:
        x = opts.softcap * torch.tanh(x / opts.softcap)
    lse = torch.logsumexp(x, dim=-1)
    # Not x − lse: log_softmax subtracts the max first (see "Precision" in the module docstring).
    logp = torch.log_softmax(x, dim=-1)
    valid = target != opts.ignore_index
    safe_target = torch.where(valid, target, 0).long()
    eps = opts.label_smoothing
    if class_weight is None:
        w_y = torch.ones_like(lse)
        smooth = -logp.sum(-1)
    else:
        w = class_weight.to(x.dtype)
        w_y = w[safe_target]
        smooth = -(logp * w).sum(-1)
    nll = -logp.gather(1, safe_target[:, None]).squeeze(1) * w_y
    z_rows = torch.where(valid, opts.lse_square_scale * lse.square(), 0.0)
    ce_rows = torch.where(valid, (1.0 - eps) * nll + (eps / n_cols) * smooth, 0.0)
    loss_rows = ce_rows + z_rows
    correct = (valid & (logits.argmax(-1) == target)).to(x.dtype) if opts.return_token_accuracy else None

    if opts.reduction == "none":
        return package(loss_rows, z_rows if opts.return_z_loss else None, correct, opts)
    n_valid = valid.sum().to(x.dtype)
    if num_items_in_batch is not None:
        denom = z_denom = torch.as_tensor(num_items_in_batch, device=x.device).to(x.dtype)
    elif opts.reduction == "mean":
        denom, z_denom = torch.where(valid, w_y, 0.0).sum(), n_valid
    else:
        denom = z_denom = torch.ones((), dtype=x.dtype, device=x.device)
    # Factors that do not depend on the logits: dividing by a zero count would give NaN
    # gradients through torch.where, multiplying by 0 gives zeros.
    scale = torch.where(denom > 0, 1.0 / denom, 0.0)
    z_scale = torch.where(z_denom > 0, 1.0 / z_denom, 0.0)
    loss = ce_rows.sum() * scale + z_rows.sum() * z_scale
    z_loss = z_rows.sum() * z_scale if opts.return_z_loss else None
    acc = correct.sum() / valid.sum().clamp_min(1) if correct is not None else None
    return package(loss, z_loss, acc, opts)


class CrossEntropyLoss(nn.Module):
    """``cross_entropy`` with its options fixed at construction; ``forward(logits, target)``."""

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        reduction: str = "mean",
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        inplace_backward: bool = False,
    ):
        super().__init__()
        self.register_buffer("weight", weight)
        self.options = dict(
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale,
            softcap=softcap,
            reduction=reduction,
            return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy,
            inplace_backward=inplace_backward,
        )

    def forward(self, logits, target, num_items_in_batch=None):
        return cross_entropy(
            logits, target, weight=self.weight, num_items_in_batch=num_items_in_batch, **self.options
        )
