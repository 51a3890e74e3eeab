"""RMSNorm and fused residual-add + RMSNorm: Triton forward and backward.

Math (per row of ``H`` elements; ``g = offset + w`` is the effective gain)::

    r = 1 / sqrt(mean(x²) + eps)          rstd, one fp32 number per row, saved for backward
    n = x · r                              the normalised row
    y = g ⊙ n

Backward. With ``dn = dy ⊙ g`` (the gradient reaching ``n``) and ``∂r/∂x_j = −r³ x_j / H``::

    dx_j = r · dn_j − (r³ / H) · x_j · Σ_i dn_i x_i
         = r · (dn_j − n_j · c),           c = mean(dn ⊙ n)   (one dot product per row)
    dw   = Σ_rows dy ⊙ n

The fused residual variant computes ``s = x + residual`` (rounded to the input dtype, as the
model's own ``hidden + residual`` would be), returns ``(rms_norm(s), s)`` and, since both outputs
depend on ``s`` only, ``dx = dresidual = ds = (the RMSNorm dx above, taken at s) + d(new_residual)``.

LayerNorm (``kernels/layer_norm.py``) is the same row kernel with the mean removed first and a
bias added; the kernels below carry it behind the ``CENTER`` flag so the launch, persistence and
dW-reduction logic exist once. Its extra terms are derived there.

Casting modes (so the result equals Hugging Face's modules wherever fp32 arithmetic allows):

* ``"llama"`` (LlamaRMSNorm, Qwen3RMSNorm, Mistral, ...): ``r`` in fp32, ``n`` rounded to the
  input dtype, *then* multiplied by the weight; the output dtype is the promotion of the input's
  and the weight's (a bf16 input with an fp32 weight gives fp32, as in HF). ``dw`` uses the rounded
  ``n`` because that is what the forward multiplied by.
* ``"gemma"`` (GemmaRMSNorm, Gemma3RMSNorm): everything in fp32, ``(x·r)·(offset + w)``, one
  rounding to the input dtype at the end. Gemma stores ``w`` with the ``+1`` outside: use
  ``offset=1.0``.

Performance design (bf16 16384×4096 on an H200: speed of light 0.16 ms for forward + backward,
i.e. read x, write y; read x and dy, write dx):

* Each program handles a block of ``BLOCK_M`` full rows ``[BLOCK_M, next_pow2(H)]`` held in
  registers: every input element is loaded once, the reductions are in-register, and no row is
  re-read. Small hidden sizes (q_norm/k_norm over head_dim 128) get many rows per block.
* Forward: one block per program (plenty of programs to hide latency).
* Backward: a persistent grid (as many programs as fit on the device at once, from the compiled
  kernel's registers, shared memory and threads) striding over row blocks. Each program
  accumulates its share of ``dw`` (and ``db``) in fp32 registers and writes one partial row; a
  single ``sum(0)`` over the ``[n_programs, H]`` partials finishes the reduction. No atomics.
  The loop is software-pipelined (``num_stages=2``: the next block's x and dy stream into
  shared memory while the current block is reduced). v1 was not, and with 2 programs of 256
  threads per SM an SM stopped loading during every reduction: 40 % of speed of light at H 4096.
  Each thread holds 8 elements per row tensor (~64 registers on sm_90), so an SM holds 32 warps.
  The partials cost little: at 16384×4096, 264 × 4096 fp32 = 4.3 MB written and read back,
  ≈ 2 % of the backward's 403 MB.
* Launch parameters come from `_default_config`; the internal launchers take ``config=`` (a
  `_RowNormConfig`) so ``scripts/tune_kernels.py`` can sweep them on a GPU.
* rstd (and mean for LayerNorm) are saved from the forward as ``[rows]`` fp32.
* Optional in-place ``dx`` written over ``dy``'s buffer (saves an allocation). Only safe when
  nothing else reads that ``dy`` afterwards; it falls back to a fresh buffer when ``dy`` is not a
  plain contiguous tensor of ``x``'s dtype, and under torch.compile (see "Custom ops" below).
* Offsets switch to int64 when an offset can pass 2³¹ − 1. No host synchronisation.

Custom ops. The launches are registered as ``torch.library`` custom ops (``ligertune::rms_norm_fwd``,
``add_rms_norm_fwd``, ``row_norm_bwd``, ``rms_norm_bwd_``; LayerNorm adds ``layer_norm_fwd``)
with fake implementations and autograd formulas, so torch.compile treats each as one node and
never traces the launch code (lru-cached configs, device queries, Triton's launcher). The
functional API around them is plain Python on shapes and dtypes, which dynamo traces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from ._utils import INTERPRET, MAX_FUSED_SIZE, next_power_of_2, offsets_need_int64, sm_count, use_triton

CASTING_MODES = ("llama", "gemma")

# Smallest block (elements) a program handles: rows narrower than this are grouped into one block
# (32 rows of head_dim 64, 16 of 128), wider rows get one row per block. The interpreter pays per
# program and per loop iteration, not per element, so it takes bigger blocks.
_GPU_BLOCK_ELEMS = 2048
_INTERPRET_BLOCK_ELEMS = 8192
# 32-bit registers per SM on every NVIDIA GPU since Maxwell (used if torch does not report it).
_REGISTERS_PER_SM = 65536


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to nearest (ties to even) in `dtype`, as a GPU's conversion does.

    Triton's CPU interpreter truncates fp32 → bf16; there we round the bits ourselves (add half an
    ulp of bf16, plus one if the kept last bit is odd, then clear the 16 low bits) so CPU tests see
    the GPU's numerics and can compare bit for bit with PyTorch. Compiled kernels skip this branch.
    """
    if _INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN's payload could carry
    return x.to(dtype)


@triton.jit
def _row_norm_fwd_kernel(
    X,
    RES,
    S,
    Y,
    W,
    B,
    MEAN,
    RSTD,
    stride_x,
    stride_res,
    stride_s,
    stride_y,
    n_rows,
    n_cols,
    eps,
    offset,
    CENTER: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    if INT64:
        rows = rows.to(tl.int64)

    # Upcast right after every load: fp32 accumulation (and the interpreter cannot do bf16 math).
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # The model would hold the sum in its own dtype; normalise exactly that rounded value.
        s = _round_to(x, S.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    if CENTER:
        mean = tl.sum(x, axis=1) / n_cols
        x = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_mask)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = x * rstd[:, None]
    if LLAMA_CAST:
        y = _round_to(y, X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        y = y * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], _round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_norm_bwd_kernel(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DRES,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    stride_dy,
    stride_x,
    stride_dres,
    stride_dx,
    n_rows,
    n_cols,
    offset,
    CENTER: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DRES: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    # Per-program partial sums stay in registers for the whole loop; reduced over rows once.
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    # NUM_STAGES > 1 lets the compiler prefetch the next block's x and dy (through shared memory)
    # while this one is reduced: without it a program stops loading during every reduction.
    for block in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        if INT64:
            rows = rows.to(tl.int64)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if CENTER:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            x = tl.where(mask, x - mean[:, None], 0.0)
        n = x * rstd[:, None]

        dn = dy
        if HAS_WEIGHT:
            dn = dy * w[None, :]
        c = tl.sum(dn * n, axis=1) / n_cols
        if CENTER:
            dx = (dn - tl.sum(dn, axis=1)[:, None] / n_cols - n * c[:, None]) * rstd[:, None]
        else:
            dx = (dn - n * c[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], _round_to(dx, DX.dtype.element_ty), mask=mask
        )

        if COMPUTE_DW:
            if LLAMA_CAST:
                n = _round_to(n, X.dtype.element_ty).to(tl.float32)
            dw_acc += dy * n
        if COMPUTE_DB:
            db_acc += dy

    # Every program writes its whole partial row (zeros if it had no block), so the buffers can
    # be allocated uninitialised.
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PARTIAL + pid * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration and helpers (shared with layer_norm.py)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RowNormConfig:
    """How a row-norm kernel is launched; its block is ``[block_m, next_pow2(H)]`` elements.

    * ``block_m``: rows per block (a power of two; capped at the row count when launched).
    * ``num_warps``: warps per program.
    * ``num_stages`` (backward only): software-pipelining depth of the persistent loop over
      blocks. 2 loads the next block's x and dy into shared memory while the current block is
      reduced; 1 loads only after the previous block is done.
    * ``programs_per_sm`` (backward only): persistent programs per SM; 0 means as many as can be
      resident at once (from the compiled kernel's registers, shared memory and threads).

    `_default_config` picks one per hidden size. The internal launchers take ``config=`` so that
    ``scripts/tune_kernels.py`` can time others without touching the public API.
    """

    block_m: int
    num_warps: int
    num_stages: int = 1
    programs_per_sm: int = 0


def _block_n(n_cols: int) -> int:
    block_n = next_power_of_2(n_cols)
    if block_n > MAX_FUSED_SIZE:
        raise ValueError(
            f"hidden size {n_cols} is wider than the {MAX_FUSED_SIZE} elements a row-norm kernel keeps in "
            "registers; use the PyTorch module for this layer (disable kernels.rms_norm/layer_norm)"
        )
    return block_n


@functools.lru_cache(maxsize=256)
def _default_config(backward: bool, n_cols: int, device_type: str) -> _RowNormConfig:
    """The launch configuration used unless a caller passes one.

    GPU: blocks of at least `_GPU_BLOCK_ELEMS` elements (whole rows; several rows per block for
    head_dim-sized norms). The forward gives each thread 16 elements per row-sized tensor (two
    16-byte bf16 loads; ~32 registers on sm_90, so occupancy is not the limit). The backward
    uses the winners of the H200 sweep (see below); ``programs_per_sm=0`` (size the persistent
    grid from the compiled kernel's occupancy) remains for configs the sweep tries.
    Interpreter: it pays per program and loop iteration, not per element, so blocks are large.
    """
    block_n = _block_n(n_cols)
    if device_type != "cuda":
        return _RowNormConfig(block_m=max(1, _INTERPRET_BLOCK_ELEMS // block_n), num_warps=4)
    block_m = max(1, _GPU_BLOCK_ELEMS // block_n)
    if not backward:
        return _RowNormConfig(block_m, min(32, max(4, block_m * block_n // (32 * 16))))
    # Backward, from the H200 sweep (scripts/tune_kernels.py; docs/perf-notes.md v2): two rows
    # per block up to H 4096, 16 elements per thread, a three-deep pipeline, and one or two
    # programs per SM gave 1.1-1.6x over the occupancy-derived grid at every benchmark size.
    if block_n <= 4096:
        block_m *= 2
    elems = block_m * block_n
    num_warps = min(32, max(4, elems // (32 * 16)))
    return _RowNormConfig(block_m, num_warps, num_stages=3, programs_per_sm=2 if elems <= 4096 else 1)


# Persistent programs per SM, per compiled backward specialisation (read by a GPU test).
_programs_per_sm: dict[tuple, int] = {}


def _resident_programs_per_sm(spec_args: tuple, flags: dict, device: torch.device) -> int:
    """How many backward programs of this specialisation one SM holds at once.

    The method of Triton's fused-softmax tutorial: compile (cached by Triton), then divide the
    SM's registers (allocated per thread in steps of 8), shared memory (the pipeline's buffers)
    and thread slots by what one program uses. ``spec_args`` carry dtypes in place of the
    partial-sum buffers, which do not exist before the grid is known.
    """
    compiled = _row_norm_bwd_kernel.warmup(*spec_args, grid=(1,), **flags)
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    threads = compiled.metadata.num_warps * 32
    regs = -(-max(compiled.n_regs, 1) // 8) * 8
    fits = [
        props.max_threads_per_multi_processor // threads,
        getattr(props, "regs_per_multiprocessor", _REGISTERS_PER_SM) // (regs * threads),
    ]
    shared, shared_per_sm = compiled.metadata.shared, getattr(props, "shared_memory_per_multiprocessor", 0)
    if shared and shared_per_sm:
        fits.append(shared_per_sm // shared)
    return max(1, min(fits))


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """View `t` as [rows, n_cols] with unit column stride (copies only when no such view exists)."""
    t2d = t.reshape(-1, n_cols)
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def _check_triton_dtype(name: str, t: torch.Tensor | None) -> None:
    if t is not None and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"{name} has dtype {t.dtype}; the Triton norm kernels take float32, bfloat16 or float16 "
            f"(cast it, e.g. {name}.float())"
        )


def _row_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
    center: bool,
    llama_cast: bool,
    out_dtype: torch.dtype,
    config: _RowNormConfig | None = None,
):
    """Launch the forward kernel on [..., H] inputs.

    Returns ``(y, s, x_saved, mean, rstd)``: ``y`` shaped like ``x``; ``s = x + residual`` (or None);
    ``x_saved`` the [rows, H] tensor the backward must read (``s`` when fused); ``mean`` (None
    unless ``center``) and ``rstd`` as [rows] fp32.
    """
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        _check_triton_dtype(name, t)
    n_cols = x.shape[-1]
    block_n = _block_n(n_cols)
    x2d = _as_rows(x, n_cols)
    res2d = _as_rows(residual, n_cols) if residual is not None else None
    n_rows = x2d.shape[0]
    # Outputs are allocated in x's shape (contiguous, row stride H): no view on the way out.
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device) if center else None
    if n_rows > 0:
        cfg = config or _default_config(False, n_cols, x.device.type)
        block_m = min(cfg.block_m, next_power_of_2(n_rows))
        _row_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
            x2d, res2d, s, y,
            weight.contiguous() if weight is not None else None,
            bias.contiguous() if bias is not None else None,
            mean, rstd,
            x2d.stride(0), res2d.stride(0) if res2d is not None else 0, n_cols, n_cols,
            n_rows, n_cols, eps, offset,
            CENTER=center, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None, LLAMA_CAST=llama_cast,
            INT64=offsets_need_int64(x2d, res2d, y),
            BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    x_saved = s.view(n_rows, n_cols) if s is not None else x2d
    return y, s, x_saved, mean, rstd


def _row_norm_backward(
    dy: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    llama_cast: bool,
    compute_dw: bool,
    compute_db: bool,
    dres: torch.Tensor | None = None,
    in_place: bool = False,
    config: _RowNormConfig | None = None,
):
    """Launch the backward kernel. Returns ``(dx [rows, H], dw or None, db or None)``: ``dw`` in
    the weight's dtype, ``db`` in fp32 (the caller knows the bias dtype).

    ``dres`` is an extra gradient added to ``dx`` (the fused residual's second output).
    """
    n_rows, n_cols = x2d.shape
    dy2d = _as_rows(dy, n_cols)
    dres2d = _as_rows(dres, n_cols) if dres is not None else None
    # dx may overwrite dy only when dy is a dense buffer of dx's dtype (a broadcast dy would make
    # rows alias each other). If _as_rows had to copy dy, the copy is ours to overwrite anyway.
    if in_place and dy2d.dtype == x2d.dtype and dy2d.is_contiguous():
        dx = dy2d
    else:
        dx = torch.empty_like(x2d, memory_format=torch.contiguous_format)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        db = torch.zeros(n_cols, dtype=torch.float32, device=x2d.device) if compute_db else None
        return dx, dw, db

    device = x2d.device
    cfg = config or _default_config(True, n_cols, device.type)
    block_m = min(cfg.block_m, next_power_of_2(n_rows))
    weight = weight.contiguous() if weight is not None else None
    flags = dict(
        CENTER=mean is not None, HAS_WEIGHT=weight is not None, HAS_DRES=dres is not None,
        COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, LLAMA_CAST=llama_cast,
        INT64=offsets_need_int64(dy2d, x2d, dres2d, dx),
        BLOCK_M=block_m, BLOCK_N=_block_n(n_cols), NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    tensors = (dy2d, x2d, weight, mean, rstd, dres2d, dx)
    scalars = (
        dy2d.stride(0), x2d.stride(0), dres2d.stride(0) if dres2d is not None else 0, dx.stride(0),
        n_rows, n_cols, offset,
    )  # fmt: skip

    per_sm = cfg.programs_per_sm
    if per_sm <= 0:
        if device.type != "cuda":
            per_sm = 1  # interpreter: one program per stand-in SM, so CPU tests loop
        else:
            key = (device, *flags.values(), *(t.dtype if t is not None else None for t in tensors))
            per_sm = _programs_per_sm.get(key)
            if per_sm is None:
                # Only the partial buffers' dtype matters to compile (Triton's warmup takes a
                # torch dtype in place of a tensor).
                partial_spec = tuple(torch.float32 if needed else None for needed in (compute_dw, compute_db))
                per_sm = _resident_programs_per_sm((*tensors, *partial_spec, *scalars), flags, device)
                _programs_per_sm[key] = per_sm
    n_programs = min(triton.cdiv(n_rows, block_m), sm_count(device) * per_sm)
    dw_partial, db_partial = (
        torch.empty((n_programs, n_cols), dtype=torch.float32, device=device) if needed else None
        for needed in (compute_dw, compute_db)
    )
    _row_norm_bwd_kernel[(n_programs,)](*tensors, dw_partial, db_partial, *scalars, **flags)
    # fp32 partial rows → one fp32 sum, then one rounding to the weight's dtype (no-op for fp32).
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else None
    db = db_partial.sum(0) if compute_db else None
    return dx, dw, db


# --------------------------------------------------------------------------------------------
# Input checks and output dtype (shared by the Triton path and the reference)
# --------------------------------------------------------------------------------------------


def check_norm_args(op: str, x: torch.Tensor, eps: float, **params: torch.Tensor | None) -> None:
    """The checks every row norm (``op``: "rms_norm", "layer_norm") makes of its input, its ``eps``
    and its per-feature parameters ``params`` (name → 1-D tensor of the hidden size, or None)."""
    if not x.is_floating_point():
        raise TypeError(f"{op} input must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{op} input must have at least one dimension (the hidden size is the last)")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    for name, p in params.items():
        if p is None:
            continue
        if p.dim() != 1 or p.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{name} has shape {tuple(p.shape)} but the input's last (normalised) dimension is "
                f"{x.shape[-1]}: the {name} must be 1-D of that size"
            )
        if p.device != x.device:
            raise ValueError(f"{name} is on {p.device} but the input is on {x.device}; move one of them")


def _check_args(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str
) -> None:
    if casting_mode not in CASTING_MODES:
        raise ValueError(
            f"casting_mode={casting_mode!r} is not one of {CASTING_MODES}: 'llama' for Llama/Qwen/Mistral "
            "norms (x·rstd rounded to the input dtype, then × weight), 'gemma' for Gemma (all fp32)"
        )
    check_norm_args("rms_norm", x, eps, weight=weight)
    if weight is None and offset != 0.0:
        raise ValueError(f"offset={offset} shifts the weight, but weight is None; pass a weight or offset=0")


def _output_dtype(x: torch.Tensor, weight: torch.Tensor | None, casting_mode: str) -> torch.dtype:
    # HF's Llama norm returns `weight * n.to(input_dtype)`, which type-promotes; Gemma's casts back.
    if casting_mode == "llama" and weight is not None:
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


# --------------------------------------------------------------------------------------------
# Custom ops and their autograd (shared with layer_norm.py)
# --------------------------------------------------------------------------------------------
# Each launch is a ``torch.library.custom_op`` in the ``ligertune`` namespace: torch.compile sees
# one opaque node with a fake implementation (shapes, dtypes, strides) and an autograd formula,
# never the launch code (whose cached configs and device queries dynamo cannot trace). Ops never
# return an alias of an input; the in-place backward is a separate op that declares the buffer
# it overwrites, and it is used in eager mode only (docs/perf-notes.md, "Custom ops").


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


@torch.library.custom_op("ligertune::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting_mode: str, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``. ``in_place`` is not used here: it is an input so that the autograd formula
    (which sees the op's inputs) knows whether the backward may overwrite dy."""
    out_dtype = _output_dtype(x, weight, casting_mode)
    y, _, _, _, rstd = _row_norm_forward(
        x, None, weight, None, eps, offset, False, casting_mode == "llama", out_dtype
    )
    return y, rstd


@_rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting_mode, in_place):
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, casting_mode))
    return y, x.new_empty(_rows(x), dtype=torch.float32)


@torch.library.custom_op("ligertune::add_rms_norm_fwd", mutates_args=())
def _add_rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, s, rstd)`` with ``s = x + residual``."""
    out_dtype = _output_dtype(x, weight, casting_mode)
    y, s, _, _, rstd = _row_norm_forward(
        x, residual, weight, None, eps, offset, False, casting_mode == "llama", out_dtype
    )
    return y, s, rstd


@_add_rms_norm_fwd.register_fake
def _(x, residual, weight, eps, offset, casting_mode):
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, casting_mode))
    return y, x.new_empty(x.shape), x.new_empty(_rows(x), dtype=torch.float32)


@torch.library.custom_op("ligertune::row_norm_bwd", mutates_args=())
def _row_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    dres: torch.Tensor | None,
    offset: float,
    llama_cast: bool,
    compute_dw: bool,
    compute_db: bool,
) -> list[torch.Tensor]:
    """``[dx (x's shape), dw if compute_dw, db (fp32) if compute_db]``: a list, because which
    gradients exist is known from the flags (the fake implementation returns the same ones)."""
    dx, dw, db = _row_norm_backward(
        dy, _as_rows(x, x.shape[-1]), weight, mean, rstd, offset, llama_cast, compute_dw, compute_db, dres
    )
    return [dx.view(x.shape), *(g for g in (dw, db) if g is not None)]


@_row_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, dres, offset, llama_cast, compute_dw, compute_db):
    grads = [x.new_empty(x.shape)]
    if compute_dw:
        grads.append(weight.new_empty(weight.shape))
    if compute_db:
        grads.append(x.new_empty(x.shape[-1], dtype=torch.float32))
    return grads


@torch.library.custom_op("ligertune::rms_norm_bwd_", mutates_args=("dy",))
def _rms_norm_bwd_(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    llama_cast: bool,
    compute_dw: bool,
) -> torch.Tensor:
    """RMSNorm backward writing dx over ``dy`` (contiguous, of x's dtype). Returns dw, or an empty
    tensor without ``compute_dw`` (functionalization, which AOTAutograd applies to mutating ops,
    takes no list outputs from them)."""
    _, dw, _ = _row_norm_backward(
        dy, _as_rows(x, x.shape[-1]), weight, None, rstd, offset, llama_cast, compute_dw, False, in_place=True
    )
    return dw if compute_dw else x.new_empty(0)


@_rms_norm_bwd_.register_fake
def _(dy, x, weight, rstd, offset, llama_cast, compute_dw):
    return weight.new_empty(weight.shape) if compute_dw else x.new_empty(0)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, offset, casting_mode, in_place = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset, ctx.llama_cast, ctx.in_place = offset, casting_mode == "llama", in_place


def _rms_norm_backward(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    # Overwriting dy needs a dense buffer of dx's dtype (a broadcast dy would make rows alias).
    if ctx.in_place and dy.dtype == x.dtype and dy.is_contiguous():
        dw = _rms_norm_bwd_(dy, x, weight, rstd, ctx.offset, ctx.llama_cast, compute_dw)
        dx = dy
    else:
        dx, *dw = _row_norm_bwd(
            dy, x, weight, None, rstd, None, ctx.offset, ctx.llama_cast, compute_dw, False
        )
        dw = dw[0] if compute_dw else None
    return dx, dw if compute_dw else None, None, None, None, None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _, offset, casting_mode = inputs
    _, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    # Unused outputs get None gradients instead of materialised zeros (no extra reads).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(s, weight, rstd)
    ctx.offset, ctx.llama_cast = offset, casting_mode == "llama"


def _add_rms_norm_backward(ctx, dy, ds, _):
    if dy is None:
        # Only new_residual was used: its gradient passes straight to both inputs; the weight
        # had no effect (None reads as zero).
        return ds, ds, None, None, None, None
    s, weight, rstd = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[2]
    dsum, *dw = _row_norm_bwd(dy, s, weight, None, rstd, ds, ctx.offset, ctx.llama_cast, compute_dw, False)
    # s = x + residual: both inputs receive the same gradient (autograd copies before any
    # in-place accumulation into a shared tensor).
    return dsum, dsum, dw[0] if compute_dw else None, None, None, None


_add_rms_norm_fwd.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)


# --------------------------------------------------------------------------------------------
# Pure-PyTorch references (CPU fallback and test oracle for the HF-matching semantics)
# --------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMSNorm in plain PyTorch, operation for operation as HF's Llama ("llama") or Gemma ("gemma")
    module. ``in_place`` is accepted for signature parity and has no effect (autograd owns dx)."""
    _check_args(x, weight, eps, offset, casting_mode)
    xf = x.to(torch.float32)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "llama":
        n = n.to(x.dtype)
        if weight is None:
            return n
        # LlamaRMSNorm's `weight * n` is evaluated by torch as an fp32 product rounded once to the
        # promoted dtype; this is the same product (identical bits for offset=0), with
        # (offset + weight) kept in fp32 like the kernel.
        return ((offset + weight.float()) * n.float()).to(_output_dtype(x, weight, casting_mode))
    if weight is not None:
        n = n * (offset + weight.float())
    return n.type_as(x)


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}, {residual.device}) must match x "
            f"({tuple(x.shape)}, {x.dtype}, {x.device}) in shape, dtype and device"
        )


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual; return rms_norm_reference(s, ...), s`` in plain PyTorch."""
    _check_residual(x, residual)
    s = x + residual
    return rms_norm_reference(s, weight, eps, offset, casting_mode), s


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape, e.g. [B, S, heads, head_dim]).

    ``y = (offset + weight) ⊙ x / sqrt(mean(x²) + eps)`` with the rounding of ``casting_mode``
    (see the module docstring). ``weight=None`` means no affine. ``in_place=True`` writes dx over
    the incoming gradient's buffer in backward: use it only when nothing else reads that gradient.
    """
    _check_args(x, weight, eps, offset, casting_mode)
    if not use_triton(x, *([weight] if weight is not None else [])):
        return rms_norm_reference(x, weight, eps, offset, casting_mode)
    # Under torch.compile the backward never overwrites dy: the compiled graph owns its buffers.
    in_place = in_place and not torch.compiler.is_compiling()
    return _rms_norm_fwd(x, weight, float(eps), float(offset), casting_mode, in_place)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``s = x + residual`` and RMSNorm in one pass. Returns ``(rms_norm(s), s)``.

    One read of each input and one write of each output in the forward; the backward reads the
    saved ``s`` and both incoming gradients once and returns the same gradient for ``x`` and
    ``residual``.
    """
    _check_residual(x, residual)
    _check_args(x, weight, eps, offset, casting_mode)
    if not use_triton(x, residual, *([weight] if weight is not None else [])):
        return add_rms_norm_reference(x, residual, weight, eps, offset, casting_mode)
    y, s, _ = _add_rms_norm_fwd(x, residual, weight, float(eps), float(offset), casting_mode)
    return y, s


class RMSNorm(nn.Module):
    """Drop-in for HF's RMSNorm modules (state_dict key ``weight``).

    The weight starts at ``1 - offset`` so the effective gain ``offset + weight`` starts at one:
    ones for Llama-style norms, zeros for Gemma (``offset=1.0``).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        in_place: bool = False,
        elementwise_affine: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"casting_mode={casting_mode!r} is not one of {CASTING_MODES}")
        if not elementwise_affine and offset != 0.0:
            raise ValueError("offset shifts the weight; it needs elementwise_affine=True")
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)

    @property
    def eps(self) -> float:
        """Gemma's modules call it ``eps``; Llama's ``variance_epsilon``. Both read the same value."""
        return self.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode, self.in_place
        )

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.variance_epsilon}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}, in_place={self.in_place}"
        )
