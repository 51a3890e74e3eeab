"""Rotary position embedding (RoPE) for q and k in one Triton launch, Hugging Face convention.

Math (the "rotate-half" layout used by Llama, Qwen, Mistral, Gemma, Phi3, ...). For one head
vector ``x`` of size ``D`` and cos/sin rows ``c``, ``s`` of size ``R`` (the rotary dim, ``R ≤ D``,
``R`` even, ``h = R / 2``), split the rotated part into halves ``x₁ = x[:h]``, ``x₂ = x[h:R]``
and likewise ``c = [c₁ | c₂]``, ``s = [s₁ | s₂]``::

    y₁ = c₁·x₁ − s₁·x₂
    y₂ = c₂·x₂ + s₂·x₁          (HF: x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂ | x₁])
    y[R:] = x[R:]               (partial rotary, e.g. Phi3: the tail passes through)

Element ``i`` of each half forms a pair ``(x₁ᵢ, x₂ᵢ)`` that is multiplied by the 2×2 matrix
``M = [[c₁ᵢ, −s₁ᵢ], [s₂ᵢ, c₂ᵢ]]``. The model's rotary module builds ``c₁ = c₂ = cos θ`` and
``s₁ = s₂ = sin θ``, so ``M`` is a rotation by ``θ``.

Backward. ``y = M x`` is linear in ``x``, so ``∂L/∂x = Mᵀ ∂L/∂y``::

    dx₁ = c₁·dy₁ + s₂·dy₂
    dx₂ = c₂·dy₂ − s₁·dy₁
    dx[R:] = dy[R:]

which is the forward map with ``(s₁, s₂)`` replaced by ``(−s₂, −s₁)``. With the model's cos/sin
that is ``sin(−θ)``: the backward pass is the inverse rotation, and the kernel runs the same code
with a compile-time flag that swaps and negates the sine halves. cos/sin get no gradient (they
come from a buffer, ``inv_freq``, in every HF model); asking for one is an error.

Design (memory bound: it reads q, k, cos, sin once and writes q and k once). Each program
rotates one tile ``[BLOCK_S positions, BLOCK_H heads, half-dim]`` of q or of k (GQA: different
head counts, one launch); the programs of a position block run next to each other, so that
block's cos/sin rows, read by each of them, come from L2 after the first. Any strides are
accepted (HF's ``view(B, S, H, D).transpose(1, 2)``, contiguous ``[B, H, S, D]``, slices of a
fused qkv projection, ``[B, S, H, D]`` with ``unsqueeze_dim=2``) and used as they are, without a
copy; outputs keep the input's memory layout. The arithmetic is fp32 whatever the storage dtype;
outputs have q's and k's dtypes.

The tile follows the memory layout (`_default_config`): where a position's heads are adjacent
(HF's q, ``[B, S, H, D]`` in memory) a tile is all heads of one position, one contiguous run of
``H·D`` elements; where a head's positions are adjacent (contiguous ``[B, H, S, D]``, which is
how gradients arriving from attention or a benchmark may be laid out) a tile is many positions
of one head, again one contiguous run. v1 used the first shape for both and its backward on
``[B, H, S, D]`` gradients ran at a third of the forward's speed: every program then touched 40
runs of 256 B, each 512 KiB apart.

``in_place=True`` writes the backward's dq/dk over the incoming gradients (no allocation; only
for callers whose gradients nobody else reads, e.g. an attention block's q/k). The forward is
never in place: its q/k are views into projection outputs, and autograd's bookkeeping for an
in-place change to a view (CopySlices) would copy the whole projection gradient in backward,
costing more traffic than the 160 MiB it saves (at the benchmark shape) is worth.

torch.compile. The launches are ``torch.library`` custom ops (``ligertune::rope_fwd``,
``rope_bwd``, and ``rope_bwd_`` for the in-place backward, which declares that it mutates the
gradients) with fake implementations and an autograd formula: dynamo records one node per call
and never traces the launch code. Under compile ``in_place`` is ignored (the compiled graph
owns its buffers, and the fake tensors it traces with have no addresses to check for aliasing).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import triton
import triton.language as tl

from ._utils import next_power_of_2, offsets_need_int64, use_triton

# Elements of one tile per half (per x₁ or x₂): 2048 = 32 heads × 64 or 32 positions × 64 at
# head_dim 128, 16 fp32 values per thread per half with 4 warps.
_MAX_TILE = 2048
_NUM_WARPS = 4


@triton.jit
def _rotate_tile(
    x_ptr,
    out_ptr,
    b,
    pos,
    pos_mask,
    head0,
    x_sb,
    x_sh,
    x_ss,
    x_sd,
    o_sb,
    o_sh,
    o_ss,
    o_sd,
    c1,
    c2,
    s1,
    s2,
    N_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    COPY_PASS: tl.constexpr,
    INT64: tl.constexpr,
):
    """Rotate heads ``head0 .. head0 + BLOCK_H`` of x at positions `pos` (``[BLOCK_S, 1, 1]``) into out."""
    h = head0 + tl.arange(0, BLOCK_H)[None, :, None]
    if INT64:
        h = h.to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    row_mask = pos_mask & (h < N_HEADS)
    mask = row_mask & (d < HALF)
    x_row = x_ptr + b * x_sb + pos * x_ss + h * x_sh
    o_row = out_ptr + b * o_sb + pos * o_ss + h * o_sh
    x1 = tl.load(x_row + d * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (d + HALF) * x_sd, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_row + d * o_sd, (c1 * x1 - s1 * x2).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + (d + HALF) * o_sd, (c2 * x2 + s2 * x1).to(out_ptr.dtype.element_ty), mask=mask)
    if COPY_PASS:  # partial rotary: the tail passes through (already in place when out is x)
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
        pass_mask = row_mask & (p < 2 * HALF + PASS)
        tail = tl.load(x_row + p * x_sd, mask=pass_mask, other=0.0)
        tl.store(o_row + p * o_sd, tail.to(out_ptr.dtype.element_ty), mask=pass_mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    seq_len,
    s_blocks,
    q_sb,
    q_sh,
    q_ss,
    q_sd,
    k_sb,
    k_sh,
    k_ss,
    k_sd,
    qo_sb,
    qo_sh,
    qo_ss,
    qo_sd,
    ko_sb,
    ko_sh,
    ko_ss,
    ko_sd,
    cos_sb,
    cos_ss,
    cos_sd,
    sin_sb,
    sin_ss,
    sin_sd,
    N_Q_HEADS: tl.constexpr,
    N_K_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    Q_TILES: tl.constexpr,
    K_TILES: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    COPY_PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
    INT64: tl.constexpr,
):
    # Program order: (batch, position block) outer, head tile inner, so the tiles sharing a
    # position block's cos/sin run together.
    pid = tl.program_id(0)
    tile = pid % (Q_TILES + K_TILES)
    pos_block = pid // (Q_TILES + K_TILES)
    b = pos_block // s_blocks
    pos = (pos_block % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos_mask = pos < seq_len
    if INT64:
        b = b.to(tl.int64)
        pos = pos.to(tl.int64)

    # cos/sin of these positions, loaded once for all heads of the tile. A batch of 1 broadcasts
    # through a zero batch stride.
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = pos_mask[:, None] & (d < HALF)
    cos_row = cos_ptr + b * cos_sb + pos[:, None] * cos_ss
    sin_row = sin_ptr + b * sin_sb + pos[:, None] * sin_ss
    c1 = tl.load(cos_row + d * cos_sd, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(cos_row + (d + HALF) * cos_sd, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(sin_row + d * sin_sd, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(sin_row + (d + HALF) * sin_sd, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    if BACKWARD:
        # Transposed map (module docstring): (s1, s2) -> (-s2, -s1).
        s1, s2 = -s2, -s1

    pos3, pos_mask3 = pos[:, None, None], pos_mask[:, None, None]
    if tile < Q_TILES:
        _rotate_tile(
            q_ptr, q_out_ptr, b, pos3, pos_mask3, tile * BLOCK_HQ,
            q_sb, q_sh, q_ss, q_sd, qo_sb, qo_sh, qo_ss, qo_sd, c1, c2, s1, s2,
            N_Q_HEADS, BLOCK_HQ, HALF, BLOCK_HALF, PASS, BLOCK_PASS, COPY_PASS, INT64,
        )  # fmt: skip
    else:
        _rotate_tile(
            k_ptr, k_out_ptr, b, pos3, pos_mask3, (tile - Q_TILES) * BLOCK_HK,
            k_sb, k_sh, k_ss, k_sd, ko_sb, ko_sh, ko_ss, ko_sd, c1, c2, s1, s2,
            N_K_HEADS, BLOCK_HK, HALF, BLOCK_HALF, PASS, BLOCK_PASS, COPY_PASS, INT64,
        )  # fmt: skip


@dataclass(frozen=True)
class _RopeConfig:
    """How `_rope_kernel` is launched: tiles of ``block_s`` positions × ``block_h`` heads (capped
    per tensor at its head count) and ``num_warps`` warps. `_default_config` picks one; the
    launcher takes ``config=`` so that ``scripts/tune_kernels.py`` can time others."""

    block_s: int
    block_h: int
    num_warps: int = _NUM_WARPS


def _default_config(x: torch.Tensor, heads_dim: int, half: int) -> _RopeConfig:
    """A `_MAX_TILE`-element tile grown first along the axis that is adjacent in memory.

    Position-major memory (a position's heads adjacent, HF's q): all heads of one position, up to
    the budget; each tile is one contiguous run. Head-major (a head's positions adjacent,
    contiguous ``[B, H, S, D]``): runs of positions of a few heads, at most half the budget in
    positions, because the cos/sin tile grows with the positions (at 32 positions it is as
    large as the q tile: 94 registers per thread on sm_90, 68 at 16 positions × 2 heads).
    """
    budget = max(1, _MAX_TILE // next_power_of_2(half))
    n_heads, seq_len = x.shape[heads_dim], x.shape[3 - heads_dim]
    if x.stride(heads_dim) <= x.stride(3 - heads_dim):
        # Measured on the H200 (scripts/tune_kernels.py, docs/perf-notes.md v2): 16 positions × 4
        # heads (twice the budget) beat one position × all heads by 1.12× on HF's q layout —
        # more independent rows in flight per program; the cos/sin tile stays small at 4 heads.
        block_h = min(next_power_of_2(n_heads), 4)
        return _RopeConfig(block_s=min(2 * budget // block_h, next_power_of_2(seq_len)), block_h=block_h)
    block_s = min(next_power_of_2(seq_len), max(1, budget // 2))
    return _RopeConfig(block_s=block_s, block_h=max(1, budget // block_s))


def _canonical_strides(t: torch.Tensor, heads_dim: int) -> tuple[int, int, int, int]:
    """Strides of a q/k-shaped tensor in (batch, head, seq, dim) order."""
    seq_dim = 3 - heads_dim  # heads at 1 -> seq at 2; heads at 2 -> seq at 1
    return t.stride(0), t.stride(heads_dim), t.stride(seq_dim), t.stride(3)


def _cos_strides(t: torch.Tensor) -> tuple[int, int, int]:
    # A batch of 1 broadcasts over the batch: stride 0 reads row 0 for every batch index.
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1), t.stride(2)


def _rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads_dim: int,
    backward: bool,
    in_place: bool = False,
    config: _RopeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (or, with `backward`, their gradients) by cos/sin. Results go to new
    tensors of the same layout, or over q and k themselves with `in_place`."""
    q_out, k_out = (q, k) if in_place else (torch.empty_like(q), torch.empty_like(k))
    batch, seq_len, head_dim = q.shape[0], q.shape[3 - heads_dim], q.shape[3]
    n_q_heads, n_k_heads = q.shape[heads_dim], k.shape[heads_dim]
    if batch * seq_len == 0:
        return q_out, k_out
    half = cos.shape[-1] // 2
    n_pass = head_dim - 2 * half
    cfg = config or _default_config(q, heads_dim, half)
    block_s = min(cfg.block_s, next_power_of_2(seq_len))
    block_hq = min(cfg.block_h, next_power_of_2(n_q_heads))
    block_hk = min(cfg.block_h, next_power_of_2(n_k_heads))
    q_tiles, k_tiles = triton.cdiv(n_q_heads, block_hq), triton.cdiv(n_k_heads, block_hk)
    s_blocks = triton.cdiv(seq_len, block_s)
    _rope_kernel[(batch * s_blocks * (q_tiles + k_tiles),)](
        q, k, q_out, k_out, cos, sin, seq_len, s_blocks,
        *_canonical_strides(q, heads_dim), *_canonical_strides(k, heads_dim),
        *_canonical_strides(q_out, heads_dim), *_canonical_strides(k_out, heads_dim),
        *_cos_strides(cos), *_cos_strides(sin),
        N_Q_HEADS=n_q_heads, N_K_HEADS=n_k_heads,
        BLOCK_S=block_s, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, Q_TILES=q_tiles, K_TILES=k_tiles,
        HALF=half, BLOCK_HALF=next_power_of_2(half),
        PASS=n_pass, BLOCK_PASS=next_power_of_2(max(n_pass, 1)), COPY_PASS=n_pass > 0 and not in_place,
        BACKWARD=backward, INT64=offsets_need_int64(q, k, q_out, k_out, cos, sin),
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return q_out, k_out


def _overwritable(*tensors: torch.Tensor) -> bool:
    """Whether results can be written over `tensors` element for element: no tensor's elements
    alias each other (a broadcast gradient has zero strides) and their memory ranges are disjoint."""
    spans = []
    for t in tensors:
        reach = 1  # elements spanned by the dimensions checked so far, by increasing stride
        for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1):
            if stride < reach:
                return False
            reach = stride * (size - 1) + reach
        start = t.data_ptr()
        spans.append((start, start + reach * t.element_size()))
    spans.sort()
    return all(end <= next_start for (_, end), (next_start, _) in pairwise(spans))


# Custom ops (torch.compile sees each as one node with a fake implementation; see the module
# docstring). Ops never return an alias of an input: the in-place backward is its own op that
# declares the gradients it overwrites, and runs in eager mode only.


@torch.library.custom_op("ligertune::rope_fwd", mutates_args=())
def _rope_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_embed, k_embed)``. ``in_place`` is not used here: it is an input so that the autograd
    formula (which sees the op's inputs) knows whether the backward may overwrite the gradients."""
    return _rope_launch(q, k, cos, sin, heads_dim, backward=False)


@_rope_fwd.register_fake
def _(q, k, cos, sin, heads_dim, in_place):
    return torch.empty_like(q), torch.empty_like(k)  # as `_rope_launch` allocates them


@torch.library.custom_op("ligertune::rope_bwd", mutates_args=())
def _rope_bwd(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_launch(dq, dk, cos, sin, heads_dim, backward=True)


@_rope_bwd.register_fake
def _(dq, dk, cos, sin, heads_dim):
    return torch.empty_like(dq), torch.empty_like(dk)


@torch.library.custom_op("ligertune::rope_bwd_", mutates_args=("dq", "dk"))
def _rope_bwd_(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_dim: int
) -> None:
    """The backward rotation written over ``dq`` and ``dk`` (which must be `_overwritable`)."""
    _rope_launch(dq, dk, cos, sin, heads_dim, backward=True, in_place=True)


@_rope_bwd_.register_fake
def _(dq, dk, cos, sin, heads_dim):
    return None


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin, heads_dim, in_place = inputs
    ctx.save_for_backward(cos, sin)
    ctx.heads_dim, ctx.in_place = heads_dim, in_place


def _rope_backward(ctx, dq_embed, dk_embed):
    """Rotate the gradients by −θ (module docstring)."""
    cos, sin = ctx.saved_tensors
    if ctx.in_place and _overwritable(dq_embed, dk_embed):
        _rope_bwd_(dq_embed, dk_embed, cos, sin, ctx.heads_dim)
        dq, dk = dq_embed, dk_embed
    else:
        dq, dk = _rope_bwd(dq_embed, dk_embed, cos, sin, ctx.heads_dim)
    return dq, dk, None, None, None, None


_rope_fwd.register_autograd(_rope_backward, setup_context=_rope_setup)


def _check_inputs(q, k, cos, sin, unsqueeze_dim) -> int:
    """Validate shapes/devices/dtypes; return the heads dimension of q and k (1 or 2)."""
    if unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q/k laid out [B, H, S, D]) or 2 ([B, S, H, D]), got {unsqueeze_dim}"
        )
    layout = "[B, H, S, D]" if unsqueeze_dim == 1 else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4 or not t.is_floating_point():
            raise ValueError(
                f"{name} must be a 4-D floating tensor laid out {layout} (unsqueeze_dim={unsqueeze_dim}), "
                f"got shape {tuple(t.shape)} dtype {t.dtype}"
            )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or not t.is_floating_point():
            raise ValueError(
                f"{name} must be a 3-D floating tensor [B or 1, S, rotary_dim] as the model's rotary "
                f"embedding returns it, got shape {tuple(t.shape)} dtype {t.dtype}"
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) > 1:
        raise ValueError(f"q, k, cos and sin must be on one device, got {sorted(map(str, devices))}")

    heads_dim, seq_dim = unsqueeze_dim, 3 - unsqueeze_dim
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    if k.shape[0] != batch or k.shape[seq_dim] != seq_len or k.shape[3] != head_dim:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, sequence and head_dim "
            f"in the {layout} layout (only the head counts may differ); check unsqueeze_dim"
        )
    rot_dim = cos.shape[2]
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise ValueError(
            f"cos/sin shape {tuple(cos.shape)} does not match q {tuple(q.shape)}: expected "
            f"[{batch} or 1, {seq_len}, rotary_dim] for the {layout} layout (unsqueeze_dim={unsqueeze_dim})"
        )
    if rot_dim % 2 or rot_dim == 0 or rot_dim > head_dim:
        raise ValueError(
            f"rotary_dim (cos.shape[-1] = {rot_dim}) must be even, > 0 and <= head_dim {head_dim}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "cos/sin require grad, but this kernel returns gradients for q and k only (HF models build "
            "cos/sin from a buffer); detach them, or use rope_reference to differentiate through them"
        )
    return heads_dim


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb``: rotate q and k by cos/sin.

    q ``[B, Hq, S, D]`` and k ``[B, Hkv, S, D]`` (or ``[B, S, H, D]`` with ``unsqueeze_dim=2``),
    any strides; cos/sin ``[B or 1, S, R]`` with ``R ≤ D`` (only the first R dims rotate). Returns
    new tensors ``(q_embed, k_embed)`` with q's and k's layouts and dtypes (HF's eager code would
    promote to a wider cos/sin dtype; HF's rotary modules return cos/sin in q's dtype, so both
    agree in practice). Differentiable in q and k. Runs the Triton kernel on CUDA (or under
    ``TRITON_INTERPRET=1``), otherwise `rope_reference`.

    ``in_place=True`` writes dq/dk over the incoming gradients in backward (when they do not
    alias themselves or each other). Use it only where nothing else reads those gradients, as in
    an attention block whose q_embed/k_embed go only to the attention kernel.
    """
    heads_dim = _check_inputs(q, k, cos, sin, unsqueeze_dim)
    if not use_triton(q, k, cos, sin):
        return rope_reference(q, k, cos, sin, unsqueeze_dim)
    # Under torch.compile the backward never overwrites the gradients: the graph owns its buffers.
    in_place = in_place and not torch.compiler.is_compiling()
    return _rope_fwd(q, k, cos, sin, heads_dim, in_place)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch RoPE with the same contract as `apply_rotary_pos_emb` (fp32 or wider math)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    cos = cos.unsqueeze(unsqueeze_dim).to(compute)
    sin = sin.unsqueeze(unsqueeze_dim).to(compute)
    half = cos.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = x.to(compute)
        x1, x2, tail = xc[..., :half], xc[..., half : 2 * half], xc[..., 2 * half :]
        y1 = cos[..., :half] * x1 - sin[..., :half] * x2
        y2 = cos[..., half:] * x2 + sin[..., half:] * x1
        return torch.cat([y1, y2, tail], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
