"""The mixture-of-experts experts block: grouped GEMMs around a fused gated activation.

Contract (Hugging Face's ``Experts.forward`` in transformers 5.17: qwen3_moe, qwen2_moe, mixtral,
deepseek_v3 with ``layout="gate_up_halves"``; gpt_oss with ``layout="gpt_oss"``)::

    out[t] = Σ_j w[t, j] · expert_{e(t, j)}(x[t])        e(t, j) = top_k_index[t, j], w = top_k_weights

``gate_up_halves``: ``gate_up_proj [E, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up),
``down_proj [E, H, I]``, ``expert_e(x) = W2_e · (silu(g) ⊙ u)`` with ``[g; u] = W1_e · x``.
``gpt_oss``: ``gate_up_proj [E, H, 2I]`` with gate and up interleaved along the last dimension
(gate ``[..., ::2]``, up ``[..., 1::2]``), ``gate_up_bias [E, 2I]`` (same interleaving),
``down_proj [E, I, H]``, ``down_bias [E, H]``, and the clamped activation
``(clamp(u, −L, L) + 1) · ĝ · σ(α·ĝ)`` with ``ĝ = min(g, L)`` (α = 1.702, L = 7).

The path (per call; N = T·k (token, slot) pairs, all on the device, no host synchronisation):

1. Route: a stable sort of the N expert ids puts the pairs in expert order (``perm``); the end
   of each expert's group is ``searchsorted(sorted ids, e, right)`` (``offs``, int32, [E]); an
   expert with no tokens is an empty group. The backward sorts again (N integers: cheap) rather
   than keeping the permutation.
2. ``gate_up [N, 2I] = grouped_mm(hidden[perm // k], W1ᵀ, offs)``: the token rows gathered in
   expert order, one GEMM per expert in one launch.
3. ``a [N, I] = act(gate_up + b1_e)``: Triton, bias added in the kernel; only ``a`` is written.
4. ``y [N, H] = grouped_mm(a, W2ᵀ, offs)``.
5. Combine (Triton): ``out[t] = Σ_j w[t, j] · (y[pos(t, j)] + b2_e)`` with ``pos`` the inverse
   permutation: each program gathers a token's k rows and sums them in fp32, in slot order. No
   atomics: the result is deterministic and rounded once.

Backward. With ``dy_s = dout[t(s)]`` (the output gradient gathered in expert order, *not* scaled
by the routing weight) and ``G = dy · W2`` per expert ([N, I]):

* ``∂L/∂w[t, j] = ⟨dout_t, y_s⟩ = Σ_c G_sc · a_sc + ⟨dout_t, b2_e⟩`` (s = pos(t, j));
* ``∂L/∂a_s = w_s · G_s``, through the activation's derivative to ``d gate_up_s`` (``a`` recomputed
  from the saved pre-activation, in the same kernel that reduces the dot product above and writes
  ``w_s · a_s`` over ``G``);
* ``∂L/∂W2_e = Σ_{s∈e} dy_sᵀ (w_s · a_s)``, ``∂L/∂b2_e = Σ_{s∈e} w_s · dy_s``: a grouped GEMM
  whose groups partition the reduction dimension, and a segment sum (Triton, fp32, in row order);
* ``∂L/∂x_s = d gate_up_s · W1_e``, gathered back per token as in the forward combine (weights 1);
* ``∂L/∂W1_e = Σ_{s∈e} d gate_up_sᵀ x_s``, ``∂L/∂b1_e = Σ_{s∈e} d gate_up_s``.

Saved for backward: the inputs (references: hidden, top_k_index, top_k_weights, weights, biases
are held by the caller anyway) and the pre-activation ``gate_up`` [T·k, 2I] in the input dtype
(before the bias, which both kernels add as they load it), i.e. ``2·T·k·I·e`` bytes (e = bytes per element): 201 MB per layer for Qwen3-30B-A3B's experts at
T = 8192 in bf16. Nothing of size [T·k, H] and not ``a`` is kept. Peak extra memory in the
backward: ``dy``, ``G`` and ``d gate_up`` together, ``T·k·(H + 3I)·e`` bytes (570 MB for
Qwen3-30B-A3B); the down projection's gradients are taken first so that ``dy`` is gone before
the gate/up side gathers ``[T·k, H]`` buffers of its own.

When it runs. Triton on CUDA or under ``TRITON_INTERPRET=1`` with float32/bfloat16/float16
inputs whose H and I rows are whole 16-byte units and whose weights start on a 16-byte boundary
(grouped_mm's layout rules), and a torch with
``torch.nn.functional.grouped_mm`` (2.10+) or ``torch._grouped_mm`` (2.8+); otherwise the
per-expert loop `moe_experts_reference` (HF's eager algorithm, with host synchronisation). On
CUDA, torch's grouped_mm is a single grouped kernel for bfloat16 on SM80+; other dtypes take
torch's own per-group fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import next_power_of_2, use_triton

LAYOUTS = ("gate_up_halves", "gpt_oss")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0

# torch.nn.functional.grouped_mm is the public name from torch 2.10; torch._grouped_mm the same
# kernel since 2.8. None: the reference path.
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Columns per program of the elementwise kernels; rows per step of the segment sum.
_BLOCK = 1024
_SEGMENT_ROWS = 16


@triton.jit
def _gate_up_offsets(cols, n_inter, INTERLEAVED: tl.constexpr):
    """Column offsets of gate and up within a [2I] row, for intermediate columns ``cols``."""
    if INTERLEAVED:
        return 2 * cols, 2 * cols + 1
    return cols, n_inter + cols


@triton.jit
def _load_gate_up(
    gu_ptr, bias_ptr, expert_ptr, row, cols, mask, n_inter, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr
):
    g_off, u_off = _gate_up_offsets(cols, n_inter, INTERLEAVED)
    base = gu_ptr + row * (2 * n_inter)
    g = tl.load(base + g_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + u_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = bias_ptr + tl.load(expert_ptr + row) * (2 * n_inter)
        g += tl.load(bias + g_off, mask=mask, other=0.0).to(tl.float32)
        u += tl.load(bias + u_off, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _act_and_grads(g, u, alpha, limit, GPT_OSS: tl.constexpr):
    """(a, ∂a/∂g, ∂a/∂u) in fp32. The clamps pass gradient on their closed ranges, as torch's."""
    if GPT_OSS:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.sigmoid(alpha * gc)
        glu = gc * sig
        da_dg = tl.where(g <= limit, (uc + 1.0) * (sig + alpha * glu * (1.0 - sig)), 0.0)
        da_du = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
        return (uc + 1.0) * glu, da_dg, da_du
    sig = tl.sigmoid(g)
    silu = g * sig
    return silu * u, u * (sig + silu * (1.0 - sig)), silu


@triton.jit
def _act_fwd_kernel(
    gu_ptr,
    bias_ptr,
    expert_ptr,
    out_ptr,
    n_inter,
    alpha,
    limit,
    INTERLEAVED: tl.constexpr,
    GPT_OSS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    g, u = _load_gate_up(gu_ptr, bias_ptr, expert_ptr, row, cols, mask, n_inter, INTERLEAVED, HAS_BIAS)
    a, _, _ = _act_and_grads(g, u, alpha, limit, GPT_OSS)
    tl.store(out_ptr + row * n_inter + cols, a.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    gu_ptr,
    bias_ptr,
    expert_ptr,
    grad_ptr,
    weight_ptr,
    dgu_ptr,
    dweight_ptr,
    n_inter,
    alpha,
    limit,
    INTERLEAVED: tl.constexpr,
    GPT_OSS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grad holds G = ∂L/∂a before the routing weight; each element is read, then overwritten
    # with w·a by the same program (the operand of ∂L/∂W2), so no second [N, I] buffer exists.
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(weight_ptr + row).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_inter
        g, u = _load_gate_up(gu_ptr, bias_ptr, expert_ptr, row, cols, mask, n_inter, INTERLEAVED, HAS_BIAS)
        a, da_dg, da_du = _act_and_grads(g, u, alpha, limit, GPT_OSS)
        grad = tl.load(grad_ptr + row * n_inter + cols, mask=mask, other=0.0).to(tl.float32)
        dot += grad * a
        g_off, u_off = _gate_up_offsets(cols, n_inter, INTERLEAVED)
        dgu = dgu_ptr + row * (2 * n_inter)
        tl.store(dgu + g_off, (w * grad * da_dg).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu + u_off, (w * grad * da_du).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_ptr + row * n_inter + cols, (w * a).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.store(dweight_ptr + row, tl.sum(dot, axis=0))


@triton.jit
def _combine_kernel(
    rows_ptr,
    pos_ptr,
    weight_ptr,
    expert_ptr,
    bias_ptr,
    out_ptr,
    k,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = Σ_j w[t, j] · (rows[pos[t·k + j]] + bias[expert[t·k + j]]), fp32, slot order."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(k):
        pair = token * k + j
        src = tl.load(pos_ptr + pair)
        row = tl.load(rows_ptr + src * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            expert = tl.load(expert_ptr + pair)
            row += tl.load(bias_ptr + expert * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            row *= tl.load(weight_ptr + pair).to(tl.float32)
        acc += row
    tl.store(out_ptr + token * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _segment_sum_kernel(
    rows_ptr,
    weight_ptr,
    offs_ptr,
    out_ptr,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[e] = Σ_{offs[e-1] ≤ s < offs[e]} (w[s] ·) rows[s], fp32, in row order (deterministic)."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + expert).to(tl.int64)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for first in range(start, end, ROWS):
        rows = first + tl.arange(0, ROWS)
        row_mask = rows < end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(rows_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            x *= tl.load(weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        acc += x
    tl.store(out_ptr + expert.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=col_mask)


def _block(n_cols: int) -> int:
    return min(_BLOCK, next_power_of_2(max(n_cols, 1)))


def _route(top_k_index: torch.Tensor, n_experts: int):
    """(expert id per sorted pair, perm, offs, pos): pairs in expert order, ``perm[s]`` the flat
    (token, slot) index of sorted row s, ``offs[e]`` the end of expert e's rows, ``pos`` the
    inverse of ``perm``. A stable sort, so both passes (and every run) agree on the order."""
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    experts = torch.arange(n_experts, device=top_k_index.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(perm.numel(), device=perm.device)
    return sorted_ids, perm, offs, pos


def _w1(gate_up_proj: torch.Tensor, layout: str) -> torch.Tensor:
    """The gate/up weights as grouped_mm's right operand, [E, H, 2I] (a view)."""
    return gate_up_proj.transpose(1, 2) if layout == "gate_up_halves" else gate_up_proj


def _w2(down_proj: torch.Tensor, layout: str) -> torch.Tensor:
    """The down weights as grouped_mm's right operand, [E, I, H] (a view)."""
    return down_proj.transpose(1, 2) if layout == "gate_up_halves" else down_proj


def _activation(gate_up, bias, sorted_ids, layout, alpha, limit) -> torch.Tensor:
    n_rows, n_inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n_rows, n_inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = _block(n_inter)
        _act_fwd_kernel[(n_rows, triton.cdiv(n_inter, block))](
            gate_up,
            bias if bias is not None else gate_up,
            sorted_ids,
            out,
            n_inter,
            alpha,
            limit,
            INTERLEAVED=layout == "gpt_oss",
            GPT_OSS=layout == "gpt_oss",
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return out


def _combine(rows, pos, n_tokens, k, weights=None, experts=None, bias=None, dtype=None) -> torch.Tensor:
    n_cols = rows.shape[1]
    out = torch.empty(n_tokens, n_cols, dtype=dtype or rows.dtype, device=rows.device)
    if out.numel():
        block = _block(n_cols)
        _combine_kernel[(n_tokens, triton.cdiv(n_cols, block))](
            rows,
            pos,
            weights if weights is not None else rows,
            experts if experts is not None else pos,
            bias if bias is not None else rows,
            out,
            k,
            n_cols,
            HAS_WEIGHT=weights is not None,
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return out


def _segment_sum(rows, offs, weights, dtype) -> torch.Tensor:
    n_experts, n_cols = offs.shape[0], rows.shape[1]
    out = torch.empty(n_experts, n_cols, dtype=torch.float32, device=rows.device)
    if out.numel():
        block = min(128, next_power_of_2(n_cols))
        _segment_sum_kernel[(n_experts, triton.cdiv(n_cols, block))](
            rows,
            weights if weights is not None else rows,
            offs,
            out,
            n_cols,
            HAS_WEIGHT=weights is not None,
            ROWS=_SEGMENT_ROWS,
            BLOCK=block,
        )
    return out.to(dtype)


def _gate_up_width(gate_up_proj: torch.Tensor, layout: str) -> int:
    return gate_up_proj.shape[1] if layout == "gate_up_halves" else gate_up_proj.shape[2]


# One custom op per pass (module docstring of kernels/rms_norm.py, docs/perf-notes.md "Custom
# ops"): torch.compile sees one node for the forward and one for the backward.


@torch.library.custom_op("ligertune::moe_experts_fwd", mutates_args=())
def _moe_experts_fwd(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    layout: str,
    alpha: float,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate_up [T·k, 2I])``: the result and the pre-activation (before the bias)
    that the backward recomputes the activation from."""
    n_tokens, k = top_k_index.shape
    sorted_ids, perm, offs, pos = _route(top_k_index, gate_up_proj.shape[0])
    gate_up = _GROUPED_MM(hidden[perm // k], _w1(gate_up_proj, layout), offs=offs)
    act = _activation(gate_up, gate_up_bias, sorted_ids, layout, alpha, limit)
    y = _GROUPED_MM(act, _w2(down_proj, layout), offs=offs)
    del act
    out = _combine(
        y,
        pos,
        n_tokens,
        k,
        weights=top_k_weights.reshape(-1),
        experts=top_k_index.reshape(-1),
        bias=down_bias,
        dtype=hidden.dtype,
    )
    return out, gate_up


@_moe_experts_fwd.register_fake
def _(
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout, alpha, limit
):
    n_pairs = top_k_index.numel()
    return hidden.new_empty(hidden.shape), hidden.new_empty(n_pairs, _gate_up_width(gate_up_proj, layout))


@torch.library.custom_op("ligertune::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd(
    dout: torch.Tensor,
    gate_up: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    layout: str,
    alpha: float,
    limit: float,
    needs: list[bool],
) -> list[torch.Tensor]:
    """The gradients of (hidden, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
    down_bias) for which ``needs`` is true, in that order (module docstring, "Backward")."""
    need_dx, need_dw, need_dw1, need_dw2, need_db1, need_db2 = needs
    n_tokens, k = top_k_index.shape
    sorted_ids, perm, offs, pos = _route(top_k_index, gate_up_proj.shape[0])
    dout = dout.to(hidden.dtype).contiguous()
    dy = dout[perm // k]
    w_sorted = top_k_weights.reshape(-1)[perm]
    grad_act = _GROUPED_MM(dy, _w2(down_proj, layout).transpose(1, 2), offs=offs)
    d_gate_up = torch.empty_like(gate_up)
    d_weight_sorted = torch.empty(gate_up.shape[0], dtype=torch.float32, device=gate_up.device)
    n_inter = gate_up.shape[1] // 2
    if gate_up.numel():
        _act_bwd_kernel[(gate_up.shape[0],)](
            gate_up,
            gate_up_bias if gate_up_bias is not None else gate_up,
            sorted_ids,
            grad_act,
            w_sorted,
            d_gate_up,
            d_weight_sorted,
            n_inter,
            alpha,
            limit,
            INTERLEAVED=layout == "gpt_oss",
            GPT_OSS=layout == "gpt_oss",
            HAS_BIAS=gate_up_bias is not None,
            BLOCK=_block(n_inter),
        )
    weighted_act = grad_act  # overwritten in place by the kernel: w_s · a_s
    # The down projection's gradients first, so dy and w·a are freed before the [T·k, H]
    # buffers of the gate/up side exist (the backward's peak is then dy + G + d gate_up).
    d_w2 = d_b2 = None
    if need_dw2:
        if layout == "gate_up_halves":
            d_w2 = _GROUPED_MM(dy.t(), weighted_act, offs=offs)
        else:
            d_w2 = _GROUPED_MM(weighted_act.t(), dy, offs=offs)
    if need_db2:
        d_b2 = _segment_sum(dy, offs, w_sorted, down_bias.dtype)
    del dy, weighted_act, grad_act
    grads = []
    if need_dx:
        dx_sorted = _GROUPED_MM(d_gate_up, _w1(gate_up_proj, layout).transpose(1, 2), offs=offs)
        grads.append(_combine(dx_sorted, pos, n_tokens, k, dtype=hidden.dtype))
        del dx_sorted
    if need_dw:
        d_weight = d_weight_sorted[pos].view(n_tokens, k)
        if down_bias is not None:
            # ⟨dout_t, b2_e⟩ for every (token, expert) is one small [T, E] GEMM; pick the k used.
            d_weight = d_weight + (dout.float() @ down_bias.float().t()).gather(1, top_k_index)
        grads.append(d_weight.to(top_k_weights.dtype))
    if need_dw1:
        x_sorted = hidden[perm // k]
        if layout == "gate_up_halves":
            grads.append(_GROUPED_MM(d_gate_up.t(), x_sorted, offs=offs))
        else:
            grads.append(_GROUPED_MM(x_sorted.t(), d_gate_up, offs=offs))
        del x_sorted
    if need_dw2:
        grads.append(d_w2)
    if need_db1:
        grads.append(_segment_sum(d_gate_up, offs, None, gate_up_bias.dtype))
    if need_db2:
        grads.append(d_b2)
    return grads


@_moe_experts_bwd.register_fake
def _(
    dout,
    gate_up,
    hidden,
    top_k_index,
    top_k_weights,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    layout,
    alpha,
    limit,
    needs,
):
    like = (hidden, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    return [t.new_empty(t.shape) for t, need in zip(like, needs, strict=True) if need]


def _moe_setup(ctx, inputs, output):
    (
        hidden,
        top_k_index,
        top_k_weights,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        layout,
        alpha,
        limit,
    ) = inputs
    _, gate_up = output
    ctx.mark_non_differentiable(gate_up)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(
        gate_up, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias
    )
    ctx.layout, ctx.alpha, ctx.limit = layout, alpha, limit


def _moe_backward(ctx, dout, _):
    n_inputs = 10
    if dout is None:
        return (None,) * n_inputs
    gate_up, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias = (
        ctx.saved_tensors
    )
    flags = ctx.needs_input_grad
    needs = [
        flags[0],
        flags[2],
        flags[3],
        flags[4],
        gate_up_bias is not None and flags[5],
        down_bias is not None and flags[6],
    ]
    computed = iter(
        _moe_experts_bwd(
            dout,
            gate_up,
            hidden,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            gate_up_bias,
            down_bias,
            ctx.layout,
            ctx.alpha,
            ctx.limit,
            needs,
        )
    )
    dx, dw, dw1, dw2, db1, db2 = (next(computed) if need else None for need in needs)
    return dx, None, dw, dw1, dw2, db1, db2, None, None, None


_moe_experts_fwd.register_autograd(_moe_backward, setup_context=_moe_setup)


def _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"unknown experts layout {layout!r}; supported: {', '.join(LAYOUTS)}")
    if hidden.dim() != 2 or top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            "expected hidden [T, H], top_k_index [T, k] and top_k_weights [T, k], got "
            f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
        )
    if top_k_index.shape[0] != hidden.shape[0] or top_k_index.dtype != torch.int64:
        raise ValueError(
            f"top_k_index must be int64 with one row per token ({hidden.shape[0]}), "
            f"got {top_k_index.dtype} {tuple(top_k_index.shape)}"
        )
    n_experts, hidden_size = gate_up_proj.shape[0], hidden.shape[1]
    two_inter = _gate_up_width(gate_up_proj, layout)
    inter = two_inter // 2
    if layout == "gate_up_halves":
        expected = {
            "gate_up_proj": (n_experts, two_inter, hidden_size),
            "down_proj": (n_experts, hidden_size, inter),
        }
    else:
        expected = {
            "gate_up_proj": (n_experts, hidden_size, two_inter),
            "down_proj": (n_experts, inter, hidden_size),
        }
    expected["gate_up_bias"] = (n_experts, two_inter)
    expected["down_bias"] = (n_experts, hidden_size)
    given = {
        "gate_up_proj": gate_up_proj,
        "down_proj": down_proj,
        "gate_up_bias": gate_up_bias,
        "down_bias": down_bias,
    }
    for name, t in given.items():
        if t is not None and tuple(t.shape) != expected[name]:
            raise ValueError(
                f"{name}: expected shape {expected[name]} for layout {layout!r}, got {tuple(t.shape)}"
            )
    if two_inter % 2:
        raise ValueError(f"gate_up_proj's gate/up dimension must be even, got {two_inter}")
    for name, t in given.items():
        if t is not None and t.dtype != hidden.dtype:
            raise ValueError(f"{name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
    if not top_k_weights.is_floating_point():
        raise ValueError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")


def _grouped_path(hidden, gate_up_proj, down_proj, *others) -> bool:
    """Whether the grouped-GEMM path can run (module docstring, "When it runs")."""
    if _GROUPED_MM is None or hidden.dtype not in _GROUPED_DTYPES:
        return False
    if not use_triton(hidden, gate_up_proj, down_proj, *others):
        return False
    # grouped_mm wants 16-byte aligned rows and base pointers. Its other operands are buffers
    # this module allocates; the weights are the caller's (a memory-mapped checkpoint can be
    # misaligned). Fake tensors under compile have no address to check.
    unit = 16 // hidden.element_size()
    if any(d % unit for d in (*gate_up_proj.shape[1:], *down_proj.shape[1:])):
        return False
    return torch.compiler.is_compiling() or all(w.data_ptr() % 16 == 0 for w in (gate_up_proj, down_proj))


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    layout: str = "gate_up_halves",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """``Σ_k w_tk · expert_e(x_t)``: a drop-in for a transformers MoE ``Experts.forward``.

    A patch calls it as ``moe_experts(hidden_states, top_k_index, top_k_weights,
    self.gate_up_proj, self.down_proj, layout=...)``:

    * ``layout="gate_up_halves"`` for the modules whose ``gate_up_proj`` is ``[E, 2I, H]`` with the
      gate in the first half and ``down_proj`` ``[E, H, I]``, activation SiLU (qwen3_moe,
      qwen2_moe, mixtral, deepseek_v3: check ``config.hidden_act == "silu"``; no biases);
    * ``layout="gpt_oss"`` for ``GptOssExperts``: ``gate_up_proj [E, H, 2I]`` interleaved,
      ``down_proj [E, I, H]``, with ``gate_up_bias=self.gate_up_proj_bias``,
      ``down_bias=self.down_proj_bias``, ``alpha=self.alpha``, ``limit=self.limit``.

    hidden ``[T, H]``; top_k_index ``[T, k]`` int64 with every id in ``[0, E)`` (expert-parallel
    sentinels ``≥ E`` are not supported: unchecked, since checking would read the device);
    top_k_weights ``[T, k]``, any float dtype (the combine runs in fp32); weights and biases in
    hidden's dtype. Returns ``[T, H]`` in hidden's dtype. Differentiable in hidden, top_k_weights,
    the weights and the biases; tensors that do not require grad get none computed. Under
    ``torch.autocast`` hidden, the weights and the biases are cast to the autocast dtype (as a
    linear layer's operands would be) and the result is returned in hidden's original dtype, as
    HF's experts return it.
    """
    out_dtype = hidden.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        # The op is opaque to autocast, which would otherwise leave fp32 master weights in fp32.
        compute = torch.get_autocast_dtype(hidden.device.type)
        hidden, gate_up_proj, down_proj = (t.to(compute) for t in (hidden, gate_up_proj, down_proj))
        gate_up_bias, down_bias = (None if t is None else t.to(compute) for t in (gate_up_bias, down_bias))
    _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout)
    extras = [t for t in (gate_up_bias, down_bias) if t is not None]
    if not _grouped_path(hidden, gate_up_proj, down_proj, top_k_index, top_k_weights, *extras):
        out = moe_experts_reference(
            hidden,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            layout=layout,
            alpha=alpha,
            limit=limit,
        )
        return out.to(out_dtype)
    out, _ = _moe_experts_fwd(
        hidden.contiguous(),
        top_k_index.contiguous(),
        top_k_weights.contiguous(),
        gate_up_proj.contiguous(),
        down_proj.contiguous(),
        None if gate_up_bias is None else gate_up_bias.contiguous(),
        None if down_bias is None else down_bias.contiguous(),
        layout,
        float(alpha),
        float(limit),
    )
    return out.to(out_dtype)


def _activation_reference(gate, up, layout, alpha, limit) -> torch.Tensor:
    if layout == "gpt_oss":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    return F.silu(gate) * up


def moe_experts_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    layout: str = "gate_up_halves",
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """`moe_experts` as a per-expert loop in plain PyTorch (HF's eager algorithm): each expert's
    tokens gathered, its two matmuls and the activation in the input dtype, the weighted rows
    summed into an fp32 (or wider) buffer, the result in hidden's dtype. Reads the routing on the
    host (one synchronisation per expert)."""
    _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout)
    out = hidden.new_zeros(hidden.shape, dtype=torch.promote_types(hidden.dtype, torch.float32))
    for expert in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        x = hidden[token]
        if layout == "gate_up_halves":
            gate_up = x @ gate_up_proj[expert].t()
        else:
            gate_up = x @ gate_up_proj[expert]
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[expert]
        if layout == "gate_up_halves":
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = gate_up[:, ::2], gate_up[:, 1::2]
        act = _activation_reference(gate, up, layout, alpha, limit)
        y = act @ (down_proj[expert].t() if layout == "gate_up_halves" else down_proj[expert])
        if down_bias is not None:
            y = y + down_bias[expert]
        out = out.index_add(0, token, y.to(out.dtype) * top_k_weights[token, slot, None].to(out.dtype))
    return out.to(hidden.dtype)
