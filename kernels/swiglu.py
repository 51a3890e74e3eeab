"""Gated activations for LLM MLPs: SwiGLU and GeGLU (tanh), Triton forward and backward.

Math. Both activations are ``act(g) = g·σ(β(g))`` with σ the logistic sigmoid:

* SiLU:      ``β(g) = g``, so ``silu(g) = g·σ(g)``;
* GELU-tanh: ``0.5·g·(1 + tanh(z))`` with ``z = √(2/π)·(g + 0.044715·g³)``; because
  ``0.5·(1 + tanh z) = σ(2z)`` this is ``g·σ(β(g))`` with ``β(g) = 2z``. The kernel never
  evaluates tanh, which also sidesteps libdevice (unavailable under Triton's CPU interpreter).

The gated output is ``o = act(g)·u``. With ``σ = σ(β(g))`` and σ' = σ(1 − σ)::

    act'(g) = σ + g·σ·(1 − σ)·β'(g)        β'(g) = 1 (SiLU),  2√(2/π)·(1 + 3·0.044715·g²) (GELU-tanh)
    ∂L/∂u = ∂L/∂o · act(g)
    ∂L/∂g = ∂L/∂o · u · act'(g)

Memory. The forward saves only ``g`` and ``u`` (which the MLP holds anyway) and the backward
recomputes ``act(g)`` from them: an elementwise recompute is free for a memory-bound kernel and
saves storing ``act(g)``. With ``inplace_backward=True`` the backward writes ``∂L/∂g`` and
``∂L/∂u`` over the saved ``g`` and ``u`` buffers, so it allocates nothing (2 × the activation's
size less at peak). That destroys g and u: use it only where they are private intermediates,
as inside an MLP (`GatedMLP` does). It is ignored (the backward allocates) unless g and u are
provably private: neither is a leaf nor a view of one (a parameter split with
``param.chunk(2, -1)`` is a view of a leaf and is never written), both are viewed as rows without
a copy, and they share no element (see `_owns_its_memory`, `_disjoint`). What cannot be checked
is a reference the caller keeps to a non-leaf activation and reads after backward; another graph
node that saved g or u and runs its backward later raises autograd's "modified by an inplace
operation" error (the in-place op bumps their version counters).

Speed. Pure streaming kernels: forward reads g, u and writes o; backward reads ∂L/∂o, g, u and
writes ∂L/∂g, ∂L/∂u; fp32 arithmetic, storage dtype in and out. Contiguous inputs run as one flat
1-D range of elements (4096 per program); row-strided inputs (the two halves of a fused
``gate_up_proj`` output, as in Phi3) run as rows of ``cols`` elements with a row stride, without
a copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from ._utils import next_power_of_2, use_triton

# Elements per program. 4096 × 2 bytes (bf16) per tensor at 8 warps is 16 elements, two 16-byte
# vector loads, per thread: enough bytes in flight per SM to saturate HBM.
_BLOCK = 4096
_NUM_WARPS = 8

_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = tl.constexpr(0.044715)

# Accepted activation names -> the canonical name the kernels compile for. HF spellings are
# accepted so a model config's `hidden_act` passes through as is; "gelu" (erf form) is a
# different function and is not.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_tanh": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """Return act(g) and act'(g) in fp32 (see the module docstring for the β form)."""
    if ACT == "silu":
        beta = g
        dbeta = 1.0
    else:
        beta = 2.0 * _SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g)
        dbeta = 2.0 * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    sig = tl.sigmoid(beta)
    return g * sig, sig + g * sig * (1.0 - sig) * dbeta


@triton.jit
def _block_offsets(n_cols, n_col_blocks, BLOCK: tl.constexpr, INT64: tl.constexpr):
    """(row, column offsets, mask) of this program's block of a [rows, n_cols] grid."""
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < n_cols


@triton.jit
def _gated_fwd_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_cols,
    n_col_blocks,
    gate_stride,
    up_stride,
    out_stride,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64: tl.constexpr,
):
    row, cols, mask = _block_offsets(n_cols, n_col_blocks, BLOCK, INT64)
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(g, ACT)
    tl.store(out_ptr + row * out_stride + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    dout_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    n_cols,
    n_col_blocks,
    dout_stride,
    gate_stride,
    up_stride,
    dgate_stride,
    dup_stride,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    INT64: tl.constexpr,
):
    # dgate/dup may alias gate/up (in-place backward): each element is read before it is
    # written, by the same program, so the aliasing is safe.
    row, cols, mask = _block_offsets(n_cols, n_col_blocks, BLOCK, INT64)
    do = tl.load(dout_ptr + row * dout_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(g, ACT)
    tl.store(dgate_ptr + row * dgate_stride + cols, (do * u * dact).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * dup_stride + cols, (do * act).to(dup_ptr.dtype.element_ty), mask=mask)


def _as_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """2-D views ``[rows, cols]`` with unit column stride, one shape for all of `tensors`.

    All contiguous: one row of every element (the flat 1-D kernel). Otherwise rows of the last
    dimension with a row stride each, which covers slices such as ``x.chunk(2, -1)`` without a
    copy; a tensor whose leading dimensions do not merge into one stride is copied.
    """
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    rows = [t.reshape(-1, t.shape[-1]) for t in tensors]
    return [r if r.stride(1) == 1 or r.shape[1] == 1 else r.contiguous() for r in rows]


def _rows_in_place(t: torch.Tensor) -> bool:
    """Whether `_as_rows` views `t` without a copy: contiguous, or rows of unit column stride whose
    leading dimensions merge into one row stride (e.g. one half of a fused projection)."""
    if t.is_contiguous():
        return True
    merged = all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2))
    return t.stride(-1) == 1 and merged


def _needs_int64(rows: list[torch.Tensor], block: int) -> bool:
    """Whether offsets ``row * stride + col`` can pass int32 (masked lanes run a block past the end)."""
    n_rows, n_cols = rows[0].shape
    return max(n_rows * r.stride(0) for r in rows) + n_cols + block >= 2**31


def _launch(kernel, rows: list[torch.Tensor], activation: str) -> None:
    """Run `kernel` over 2-D views of equal shape (pointers then row strides, in `rows` order)."""
    n_rows, n_cols = rows[0].shape
    if n_rows * n_cols == 0:
        return
    block = min(_BLOCK, next_power_of_2(n_cols))
    n_col_blocks = triton.cdiv(n_cols, block)
    kernel[(n_rows * n_col_blocks,)](
        *rows,
        n_cols,
        n_col_blocks,
        *(r.stride(0) for r in rows),
        ACT=activation,
        BLOCK=block,
        INT64=_needs_int64(rows, block),
        num_warps=_NUM_WARPS,
    )


# Custom ops (one torch.compile node each; module docstring). The in-place backward is its own
# op that declares the gate/up buffers it overwrites; ops never return an alias of an input.


@torch.library.custom_op("ligertune::gated_act_fwd", mutates_args=())
def _gated_act_fwd(
    gate: torch.Tensor, up: torch.Tensor, activation: str, inplace_backward: bool
) -> torch.Tensor:
    """``act(gate) · up``, contiguous. ``inplace_backward`` is not used here: it is an input so
    that the autograd formula (which sees the op's inputs) can read it."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _launch(_gated_fwd_kernel, _as_rows(gate, up, out), activation)
    return out


@_gated_act_fwd.register_fake
def _(gate, up, activation, inplace_backward):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("ligertune::gated_act_bwd", mutates_args=())
def _gated_act_bwd(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(∂L/∂gate, ∂L/∂up)``, contiguous, recomputing ``act(gate)``."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty_like(dgate)
    _launch(_gated_bwd_kernel, _as_rows(dout, gate, up, dgate, dup), activation)
    return dgate, dup


@_gated_act_bwd.register_fake
def _(dout, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@torch.library.custom_op("ligertune::gated_act_bwd_", mutates_args=("gate", "up"))
def _gated_act_bwd_(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """The backward written over ``gate`` and ``up``: afterwards they hold their own gradients.
    Both must be `_rows_in_place` (else the gradients would land in `_as_rows`'s copies)."""
    dout_rows, gate_rows, up_rows = _as_rows(dout, gate, up)
    _launch(_gated_bwd_kernel, [dout_rows, gate_rows, up_rows, gate_rows, up_rows], activation)


@_gated_act_bwd_.register_fake
def _(dout, gate, up, activation):
    return None


def _owns_its_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is an autograd intermediate's: ``t`` is not a leaf, and neither is
    the tensor it is a view of (``_base`` is the root of a chain of views).

    A leaf is a parameter, an input the user created (with or without ``requires_grad``), or a
    detached tensor: memory the user still holds. A view of a leaf (``param.chunk(2, -1)``,
    ``param[:, :n]``) is itself a non-leaf, so testing ``t.is_leaf`` alone would let the backward
    write gradients into the parameter; its ``_base`` is the leaf and gives it away. A non-leaf
    root is the output of an op in the graph (a projection's matmul): no one but the graph holds it
    unless the caller kept a reference, which is what ``inplace_backward=True`` promises against.
    """
    root = t if t._base is None else t._base
    return not t.is_leaf and not root.is_leaf


def _row_layout(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(storage offset, row stride, columns, rows) in elements of a `_rows_in_place` tensor."""
    if t.is_contiguous():
        return t.storage_offset(), max(1, t.numel()), t.numel(), 1
    return t.storage_offset(), t.stride(-2), t.shape[-1], t.numel() // t.shape[-1]


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two `_rows_in_place` tensors of one dtype provably share no element.

    Different storages, or element ranges ``[offset, offset + (rows − 1)·stride + cols)`` that do
    not meet, are disjoint. Otherwise (the halves of one fused ``gate_up_proj`` output interleave
    row by row) both must have one row stride ``S`` with ``cols ≤ S``: row ``r`` of a tensor is
    ``offset + r·S + [0, cols)``, so its elements cover the residues ``offset + [0, cols)`` modulo
    ``S``, and two such arcs of the circle ℤ/S that do not meet mean no shared element. Anything
    else counts as overlapping (the allocating backward runs).
    """
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    (oa, sa, na, ra), (ob, sb, nb, rb) = _row_layout(a), _row_layout(b)
    if oa + (ra - 1) * sa + na <= ob or ob + (rb - 1) * sb + nb <= oa:
        return True
    if sa != sb or na > sa or nb > sb:
        return False
    gap = (ob - oa) % sa  # where b's arc starts, measured from the start of a's
    return gap >= na and gap + nb <= sa


def _gated_act_setup(ctx, inputs, output):
    gate, up, activation, inplace_backward = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation
    # The backward may overwrite gate and up only when they are provably private temporaries:
    # memory of autograd intermediates (never a leaf or a view of one: parameters, user inputs),
    # viewed without a copy (else the gradients would land in `_as_rows`'s copies), and disjoint
    # (one buffer, or overlapping views, cannot hold both gradients). Evaluated in eager mode only:
    # under compile `inplace_backward` is False and the short-circuit skips the address checks.
    ctx.inplace = (
        inplace_backward
        and _owns_its_memory(gate)
        and _owns_its_memory(up)
        and _rows_in_place(gate)
        and _rows_in_place(up)
        and _disjoint(gate, up)
    )


def _gated_act_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    if ctx.inplace:
        _gated_act_bwd_(dout, gate, up, ctx.activation)
        return gate, up, None, None
    dgate, dup = _gated_act_bwd(dout, gate, up, ctx.activation)
    return dgate, dup, None, None


_gated_act_fwd.register_autograd(_gated_act_backward, setup_context=_gated_act_setup)


def _canonical_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"unsupported gated activation {activation!r}; supported: {sorted(ACTIVATIONS)} "
            "(tanh-approximated GELU only: 'gelu' with erf is not implemented)"
        )
    return ACTIVATIONS[activation]


def gated_act(
    gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", inplace_backward: bool = False
) -> torch.Tensor:
    """``act(gate) * up`` for ``activation`` in `ACTIVATIONS` (HF ``hidden_act`` names accepted).

    The piece to swap into an existing HF MLP (``act_fn(gate_proj(x)) * up_proj(x)``) without
    touching its Linear layers. gate and up: same shape, dtype and device, any leading dims;
    the result is contiguous with that shape and dtype. ``inplace_backward=True`` lets the
    backward overwrite gate and up with their gradients (module docstring). Triton on CUDA or
    under ``TRITON_INTERPRET=1``, otherwise the PyTorch reference.
    """
    canonical = _canonical_activation(activation)
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype or not gate.is_floating_point():
        raise ValueError(f"gate and up must share one floating dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on one device, got {gate.device} and {up.device}")
    if not use_triton(gate, up):
        return _REFERENCES[canonical](gate, up)
    # Under torch.compile the backward never overwrites gate and up: the graph owns its buffers.
    inplace_backward = inplace_backward and not torch.compiler.is_compiling()
    return _gated_act_fwd(gate, up, canonical, inplace_backward)


def swiglu(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (Llama, Qwen, Mistral MLPs). See `gated_act`."""
    return gated_act(gate, up, "silu", inplace_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma MLPs; HF ``gelu_pytorch_tanh``). See `gated_act`."""
    return gated_act(gate, up, "gelu_tanh", inplace_backward)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch SwiGLU, fp32 (or wider) math, result in gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch GeGLU with tanh-approximated GELU, fp32 (or wider) math, result in gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.gelu(gate.to(compute), approximate="tanh") * up.to(compute)).to(gate.dtype)


_REFERENCES = {"silu": swiglu_reference, "gelu_tanh": geglu_reference}


class GatedMLP(nn.Module):
    """``down_proj(act(gate) * up)``, the gated MLP of Llama-family models, on the fused kernel.

    Parameter names match Hugging Face so state_dicts load both ways: ``gate_proj``, ``up_proj``,
    ``down_proj`` (Llama, Qwen, Mistral, Gemma), or with ``fused_gate_up=True`` ``gate_up_proj``
    (output ``[gate | up]`` along the last dim, as Phi3MLP splits it with ``chunk(2, -1)``) and
    ``down_proj``. The activation's backward writes its gradients over the gate/up
    intermediates (``inplace_backward``), which only this module sees.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        fused_gate_up: bool = False,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        _canonical_activation(activation)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.fused_gate_up = fused_gate_up
        factory = {"bias": bias, "dtype": dtype, "device": device}
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **factory)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, **factory)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gated_act(gate, up, self.activation, inplace_backward=True))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, fused_gate_up={self.fused_gate_up}"
