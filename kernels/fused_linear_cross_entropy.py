"""Fused linear + cross entropy: ``loss = CE(hidden @ weight.T + bias, target)`` without ever
holding the [N, V] logits.

At vocab 128k–256k the logits (and their gradient) of one batch are gigabytes: 8192 tokens ×
128256 classes is 2.1 GB in bf16, 4.2 GB in fp32, before the gradient. Here the tokens are
processed in chunks of ``C`` rows, and everything of size C × V lives in one preallocated buffer:

    logits_c  = h_c @ Wᵀ (+ b)                  torch matmul (cuBLAS) into the buffer, input dtype
    dlogits_c = CE kernel, in place              loss rows + ∂ℓ/∂logits · scale (cross_entropy.py)
    dh_c      = dlogits_c @ W                    written straight into grad_hidden[c]
    dW       += dlogits_cᵀ @ h_c                 accumulated over chunks (see below)
    db       += Σ_rows dlogits_c                 fp32

so the gradients are complete when the forward returns; ``backward`` only multiplies them by the
incoming (scalar) gradient — with the device-side "skip when exactly 1" kernel, no host sync.

Chunk size. ``C`` comes from ``memory_budget_bytes`` and the shapes: the largest C with
C × V × element size within the budget, then the chunks are balanced (N split into equal parts)
and rounded up to a multiple of 64 rows when that stays within the budget (matmul tiles). The
default budget (768 MiB) gives, at V = 128256 in bf16, 6 chunks of 2752 rows for N = 16384 —
matmuls big enough to run near full speed, and a buffer well under the 1 GiB extra-memory target.
One exception (``sweep_rows``): when dW needs an fp32 accumulator over the chunks, a single chunk
of all N rows is taken whenever its [N, V] buffer needs no more memory than the accumulator it
saves. At N = 8192, H = 4096, V = 128256 the two peaks are equal (3.2 GB), and the single chunk runs
eager's three GEMM shapes with no accumulation pass and no chunking loss.

dW accumulation. ``accum_dtype`` (fp32 by default) is the dtype of the running sum over chunks.
Summing in bf16 rounds the running total once per chunk, and the rounding error grows with the
number of chunks (long runs drift). With fp32 each chunk's product is added to an fp32
accumulator by cuBLAS (``addmm`` with ``out_dtype=float32``, bf16 inputs, fp32 C) and rounded to
the weight's dtype once at the end. The price is memory: the accumulator is V × H × 4 bytes
(2.1 GB at 128256 × 4096) on top of the bf16 gradient, so the ≤ 1 GiB extra-memory target holds
only with ``accum_dtype=weight.dtype``. Two cases need no accumulator at all: a single chunk
(cuBLAS already sums over all N in fp32) and fp32 weights. Where torch cannot run that mixed
``addmm`` (CPU, older torch) each chunk's product is computed in slices of the weight's rows in
the input dtype and added to the fp32 accumulator; the slices reuse the budget (the logits buffer
then gets half of it).

``reduction="none"``: the upstream gradient differs per token, and dW = Σ_i g_i · dlogits_iᵀ h_i
cannot be rescaled after the fact without keeping the [N, V] gradient. So the forward computes
only the losses (one matmul per chunk, no gradient pass) and the backward redoes the chunk loop
with the per-token scale fed into the CE kernel: four matmuls in all instead of three, never
more memory.

The function takes the lm_head weight as an argument and keeps nothing between calls, so a
caller can run it inside the lm_head module's own forward, where FSDP2 / ZeRO-3 have the full
weight gathered; a weight tied to the embedding gets its two gradient contributions summed by
autograd as usual. Under autocast, hidden/weight/bias are cast to the autocast dtype first, like
``F.linear`` would.

Custom ops (docs/perf-notes.md, "Custom ops"). The sweep is ``ligertune::fused_linear_cross_entropy_fwd``,
returning (loss, z_loss, token_accuracy, dh, dW, db) with a fake implementation and an autograd
formula, so torch.compile records one node and never traces the chunk loop. Its backward is the
cross entropy's (`scale_stored_grads`): the stored gradients scaled in place in eager mode, at
most once per forward; a fresh product under compile. The deferred ``reduction="none"``
backward is ``ligertune::fused_linear_cross_entropy_bwd``; it computes fresh gradients from the
saved inputs, so it may run more than once.
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.nn.functional as F

from ._utils import use_triton
from .chunking import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows, sweep_rows
from .cross_entropy import (
    CEOptions,
    check_options,
    count_arg,
    fake_loss_outputs,
    keep_stored_grads,
    launch_cross_entropy,
    op_outputs,
    package,
    reduce_rows,
    reduction_scales,
    reference_loss,
    row_outputs,
    scale_stored_grads,
)

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "sweep_rows",
]


@functools.cache
def _mixed_matmul_supported(device_type: str) -> bool:
    """Whether torch runs mm/addmm with bf16 inputs into an fp32 output/accumulator on this device."""
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _matmul_into(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool, slice_rows: int
) -> None:
    """``out = a @ b`` or ``out += a @ b``, where ``out`` may be wider (fp32) than ``a`` and ``b``."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif _mixed_matmul_supported(out.device.type):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        # Each slice's product is rounded to the input dtype once, then summed exactly enough in
        # `out`'s dtype: the error no longer grows with the number of chunks.
        for r in range(0, out.shape[0], slice_rows):
            part = a[r : r + slice_rows] @ b
            if accumulate:
                out[r : r + slice_rows] += part
            else:
                out[r : r + slice_rows].copy_(part)


def _accumulate_linear_grads(dw, db, grad_logits, h, first: bool, slice_rows: int) -> None:
    """One chunk's share of the linear layer's gradients: dW += grad_logitsᵀ·h (the first chunk
    writes instead), db += Σ_rows grad_logits (fp32). A None accumulator is not wanted."""
    if dw is not None:
        _matmul_into(dw, grad_logits.t(), h, accumulate=not first, slice_rows=slice_rows)
    if db is not None:
        db += grad_logits.sum(0, dtype=torch.float32)


def _finish_linear_grads(dw, db, weight, bias):
    """The accumulators rounded to their parameters' dtypes."""
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return dw, db


def _rows_of(scale, start, end):
    """A chunk's part of a per-row scale ([N]); a 0-d scale or None as is."""
    return scale if scale is None or scale.dim() == 0 else scale[start:end]


def _sweep(
    hidden,
    weight,
    bias,
    target,
    class_weight,
    opts,
    *,
    grad_scale,
    z_grad_scale=None,
    want_grads,
    compute_acc,
    accum_dtype,
    budget,
):
    """One pass over the token chunks.

    ``grad_scale``: None for losses only, else a 0-d tensor (one scale for every row) or an [N]
    tensor (per-token upstream gradient); ``z_grad_scale`` the z-loss term's (``grad_scale`` when
    None; see ``launch_cross_entropy``). ``want_grads``: (hidden, weight, bias) flags.
    Returns ((loss_rows, z_rows, correct_rows), (dh, dw, db)).
    """
    n_rows, n_hidden = hidden.shape
    n_cols = weight.shape[0]
    want_dh, want_dw, want_db = want_grads if grad_scale is not None else (False, False, False)
    compute_grad = want_dh or want_dw or want_db

    wide_dw = want_dw and accum_dtype != weight.dtype
    rows = sweep_rows(
        n_rows,
        n_cols,
        n_hidden,
        hidden.element_size(),
        budget,
        accumulator_bytes=accum_dtype.itemsize if wide_dw else 0,
        weight_bytes=weight.element_size(),
    )
    single_chunk = rows >= n_rows
    if wide_dw and not single_chunk and not _mixed_matmul_supported(hidden.device.type):
        # The sliced accumulation's temporary takes half of the budget.
        rows = chunk_rows(n_rows, n_cols, 2 * hidden.element_size(), budget)
    buffer = hidden.new_empty(rows, n_cols)

    loss_rows, z_rows, correct_rows = row_outputs(n_rows, hidden.device, compute_acc)
    dh = torch.empty_like(hidden) if want_dh else None
    dw = None
    if want_dw:
        dw = torch.empty(
            n_cols, n_hidden, dtype=weight.dtype if single_chunk else accum_dtype, device=hidden.device
        )
    db = torch.zeros(n_cols, dtype=torch.float32, device=hidden.device) if want_db else None

    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        h = hidden[start:end]
        logits = buffer[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        launch_cross_entropy(
            logits,
            target[start:end],
            class_weight,
            opts,
            loss_rows=loss_rows[start:end],
            z_rows=z_rows[start:end],
            correct_rows=correct_rows[start:end] if compute_acc else None,
            grad=logits if compute_grad else None,
            grad_scale=_rows_of(grad_scale, start, end),
            z_grad_scale=_rows_of(z_grad_scale, start, end),
        )
        if not compute_grad:
            continue
        if want_dh:
            torch.mm(logits, weight, out=dh[start:end])
        _accumulate_linear_grads(dw, db, logits, h, start == 0, max(1, buffer.numel() // n_hidden))

    # Release the chunk buffer before the accumulator is rounded, so the two never coexist with the copy.
    buffer = logits = None
    dw, db = _finish_linear_grads(dw, db, weight, bias)
    return (loss_rows, z_rows, correct_rows), (dh, dw, db)


# --------------------------------------------------------------------------------------------
# Custom ops and their autograd
# --------------------------------------------------------------------------------------------
# As in cross_entropy.py: one torch.compile node per launch, the CEOptions fields flattened into
# scalar arguments, the count a tensor (`count_arg`), no output aliasing an input.


def _fake_linear_grads(hidden, weight, bias, want_dh: bool, want_dw: bool, want_db: bool):
    """The fake ``(dh, dw, db)`` of the ops: each of its parameter's shape and dtype (dW and db
    are rounded to them at the end of the sweep), empty when not wanted."""
    dh = torch.empty_like(hidden) if want_dh else None
    dw = weight.new_empty(weight.shape) if want_dw else None
    db = bias.new_empty(bias.shape) if want_db else None
    return op_outputs(hidden, dh, dw, db)


@torch.library.custom_op("ligertune::fused_linear_cross_entropy_fwd", mutates_args=())
def _fused_linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    num_items: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    reduction: str,
    return_z_loss: bool,
    return_token_accuracy: bool,
    want_dh: bool,
    want_dw: bool,
    want_db: bool,
    accum_dtype: torch.dtype,
    budget: int,
    scale_in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, z_loss, token_accuracy, dh, dw, db)``, those not asked for empty; the gradients
    (``want_*``) are kept for the backward. With ``reduction="none"`` none is computed here: the
    backward redoes the sweep (`_fused_linear_cross_entropy_bwd`). ``scale_in_place`` is not
    used here: an input so that the autograd formula knows whether the backward may overwrite
    the gradients."""
    opts = CEOptions(
        ignore_index,
        label_smoothing,
        lse_square_scale,
        softcap,
        reduction,
        return_z_loss,
        return_token_accuracy,
    )
    scale, z_scale, n_valid = reduction_scales(target, class_weight, opts, num_items, weight.shape[0])
    deferred = reduction == "none"
    rows, grads = _sweep(
        hidden,
        weight,
        bias,
        target,
        class_weight,
        opts,
        grad_scale=None if deferred else scale,
        z_grad_scale=None if deferred else z_scale,
        want_grads=(want_dh, want_dw, want_db),
        compute_acc=return_token_accuracy,
        accum_dtype=accum_dtype,
        budget=budget,
    )
    loss_outputs = op_outputs(rows[0], *reduce_rows(*rows, scale, z_scale, n_valid, opts))
    return *loss_outputs, *op_outputs(hidden, *grads)


@_fused_linear_cross_entropy_fwd.register_fake
def _(
    hidden,
    weight,
    target,
    bias,
    class_weight,
    num_items,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    reduction,
    return_z_loss,
    return_token_accuracy,
    want_dh,
    want_dw,
    want_db,
    accum_dtype,
    budget,
    scale_in_place,
):
    losses = fake_loss_outputs(target, reduction, return_z_loss, return_token_accuracy)
    if reduction == "none":
        want_dh = want_dw = want_db = False
    return *losses, *_fake_linear_grads(hidden, weight, bias, want_dh, want_dw, want_db)


@torch.library.custom_op("ligertune::fused_linear_cross_entropy_bwd", mutates_args=())
def _fused_linear_cross_entropy_bwd(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    want_dh: bool,
    want_dw: bool,
    want_db: bool,
    accum_dtype: torch.dtype,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh, dw, db)`` of ``reduction="none"`` (module docstring): the sweep again, with the
    upstream ``grad_loss[i]`` as row i's scale in the CE kernel; a gradient not wanted is empty."""
    opts = CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap, "none", False, False)
    _, grads = _sweep(
        hidden,
        weight,
        bias,
        target,
        class_weight,
        opts,
        grad_scale=grad_loss,
        want_grads=(want_dh, want_dw, want_db),
        compute_acc=False,
        accum_dtype=accum_dtype,
        budget=budget,
    )
    return op_outputs(hidden, *grads)


@_fused_linear_cross_entropy_bwd.register_fake
def _(
    grad_loss,
    hidden,
    weight,
    target,
    bias,
    class_weight,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    want_dh,
    want_dw,
    want_db,
    accum_dtype,
    budget,
):
    return _fake_linear_grads(hidden, weight, bias, want_dh, want_dw, want_db)


def _wanted(grads, want) -> list[torch.Tensor | None]:
    """The ops' ``(dh, dw, db)`` with None for a gradient not wanted (the op's empty stand-in)."""
    return [g if w else None for g, w in zip(grads, want, strict=True)]


def _fused_linear_cross_entropy_setup(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, _, *options = inputs
    *kernel_opts, reduction, _, _, want_dh, want_dw, want_db, accum_dtype, budget, scale_in_place = options
    _, z, acc, *grads = output
    # As in cross_entropy.py: reported values and stored gradients are not differentiable, and
    # get None in backward rather than materialised zeros (a [V, H] one for dw).
    ctx.mark_non_differentiable(z, acc, *grads)
    ctx.set_materialize_grads(False)
    want = (want_dh, want_dw, want_db)
    ctx.deferred = reduction == "none"
    if ctx.deferred:
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)
        ctx.sweep_args = (*kernel_opts, *want, accum_dtype, budget)
        ctx.want = want
    else:
        keep_stored_grads(ctx, "fused_linear_cross_entropy", _wanted(grads, want), scale_in_place)


def _fused_linear_cross_entropy_backward(ctx, grad_loss, *_):
    if ctx.deferred:
        # Fresh gradients from the saved inputs: nothing is overwritten, a second backward is fine.
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        grads = _fused_linear_cross_entropy_bwd(
            grad_loss, hidden, weight, target, bias, class_weight, *ctx.sweep_args
        )
        dh, dw, db = _wanted(grads, ctx.want)
    else:
        dh, dw, db = scale_stored_grads(ctx, grad_loss)
    return dh, dw, None, db, *(None,) * 15


_fused_linear_cross_entropy_fwd.register_autograd(
    _fused_linear_cross_entropy_backward, setup_context=_fused_linear_cross_entropy_setup
)


def _check_linear(hidden, weight, bias, accum_dtype, memory_budget_bytes):
    if hidden.dim() != 2:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)}; expected [N, H]: flatten with .reshape(-1, hidden.shape[-1])"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}; expected [V, {hidden.shape[1]}] (the lm_head weight, "
            "as stored by nn.Linear(hidden, vocab))"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [{weight.shape[0]}] or None")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} has dtype {t.dtype}; expected a floating dtype")
        if t.dtype != hidden.dtype:
            raise ValueError(
                f"{name} is {t.dtype} but hidden is {hidden.dtype}: cast them to one dtype "
                "(or run under torch.autocast, which casts both)"
            )
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if not isinstance(accum_dtype, torch.dtype) or accum_dtype not in (weight.dtype, torch.float32):
        raise ValueError(
            f"accum_dtype={accum_dtype}: use torch.float32 (default) or the weight's dtype {weight.dtype} "
            "(less memory, the running dW sum is rounded once per chunk)"
        )
    if memory_budget_bytes is not None and (
        not isinstance(memory_budget_bytes, numbers.Integral) or memory_budget_bytes <= 0
    ):
        raise ValueError(
            f"memory_budget_bytes={memory_budget_bytes!r}: must be a positive int (bytes), or None"
        )


def _ce_options(hidden, weight, target, class_weight, **options) -> CEOptions:
    """``check_options`` for the logits ``hidden @ weight.T`` [N, V] that are never materialised."""
    return check_options(
        hidden.shape[0],
        weight.shape[0],
        hidden.device,
        target,
        class_weight,
        weight_name="class_weight",
        **options,
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    accum_dtype: torch.dtype = torch.float32,
    memory_budget_bytes: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without materialising the logits.

    Args:
        hidden: [N, H] final hidden states (flatten batch and sequence).
        weight: [V, H] lm_head weight (may be tied to the input embedding).
        target: [N] class indices.
        bias: [V] or None.
        class_weight: per-class weights [V] — the ``weight`` argument of ``cross_entropy`` (renamed
            here because ``weight`` is the lm_head's).
        ignore_index, label_smoothing, lse_square_scale, softcap, reduction, num_items_in_batch,
        return_z_loss, return_token_accuracy: as in ``cross_entropy``.
        accum_dtype: dtype of the dW running sum over chunks: torch.float32 (default) or the
            weight's dtype (saves V × H × 4 bytes; see the module docstring).
        memory_budget_bytes: bound on the chunk buffer (default ``DEFAULT_MEMORY_BUDGET_BYTES``).

    Returns:
        The fp32 loss, or ``CrossEntropyOutput(loss, z_loss, token_accuracy)`` when a return flag is set.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    _check_linear(hidden, weight, bias, accum_dtype, memory_budget_bytes)
    opts = _ce_options(
        hidden,
        weight,
        target,
        class_weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
    )
    if not use_triton(hidden, weight):
        return _linear_reference(hidden, weight, target, bias, class_weight, opts, num_items_in_batch)
    grad_enabled = torch.is_grad_enabled()
    with torch.autocast(device_type, enabled=False):
        loss, z, acc, *_ = _fused_linear_cross_entropy_fwd(
            hidden.contiguous(),
            weight,
            target.contiguous(),
            bias,
            None if class_weight is None else class_weight.contiguous(),
            count_arg(num_items_in_batch, hidden.device),
            *opts,
            grad_enabled and hidden.requires_grad,
            grad_enabled and weight.requires_grad,
            grad_enabled and bias is not None and bias.requires_grad,
            accum_dtype,
            memory_budget_bytes or DEFAULT_MEMORY_BUDGET_BYTES,
            # Under torch.compile nothing is overwritten: the compiled graph owns its buffers.
            not torch.compiler.is_compiling(),
        )
    return package(loss, z, acc, opts)


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    accum_dtype: torch.dtype = torch.float32,
    memory_budget_bytes: int | None = None,
):
    """Pure PyTorch: ``cross_entropy_reference(F.linear(hidden, weight, bias), target, ...)``.

    Materialises the logits (in the inputs' dtype, as the fused path does); ``accum_dtype`` and
    ``memory_budget_bytes`` are validated for signature compatibility and have no effect.
    """
    _check_linear(hidden, weight, bias, accum_dtype, memory_budget_bytes)
    opts = _ce_options(
        hidden,
        weight,
        target,
        class_weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
    )
    return _linear_reference(hidden, weight, target, bias, class_weight, opts, num_items_in_batch)


def _linear_reference(hidden, weight, target, bias, class_weight, opts: CEOptions, num_items_in_batch):
    """The pure-PyTorch math on validated inputs: the reference, and the fallback where Triton cannot run."""
    return reference_loss(F.linear(hidden, weight, bias), target, class_weight, opts, num_items_in_batch)
