"""RMSNorm and fused add+RMSNorm kernels vs float64 references and Hugging Face's modules.

Forward and backward (dx, dw, dresidual) on fresh random inputs and random weights; odd hidden
sizes, one row, more row blocks than backward programs, [B, S, heads, head_dim] inputs, strided
inputs and gradients, weight=None, offset=1.0, both casting modes, in-place dx, fp32 and bf16.
Every tensor the op allocates starts as NaN (`poisoned_allocations`), so a missed element shows.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from ligertune.kernels import rms_norm as rms_module
from ligertune.kernels._utils import offsets_need_int64, sm_count
from ligertune.kernels.rms_norm import (
    RMSNorm,
    add_rms_norm,
    rms_norm,
    rms_norm_reference,
)
from tests.kernels.helpers import (
    assert_close,
    fresh_randn,
    poisoned_allocations_fixture,  # noqa: F401 (fixture)
    rel_err,
    ulp,
)

EPS = 1e-6
MODES = [("llama", 0.0), ("gemma", 1.0)]
DTYPES = [torch.float32, torch.bfloat16]


def ste_round(t, dtype):
    """`t` rounded to `dtype` in value, with the gradient passing straight through (as `.to()`)."""
    return t + (t.to(dtype).double() - t).detach()


def rms64(x, weight, eps, offset, round_to=None):
    """The RMSNorm math in float64: x / sqrt(mean(x²) + eps) · (offset + w).

    ``round_to`` models the "llama" casting mode's specification: the normalised row is rounded
    to the input dtype before the weight multiplies it (so dw = Σ dy · rounded n, the gradient of
    the function actually computed).
    """
    x = x.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if round_to is not None:
        n = ste_round(n, round_to)
    return n if weight is None else n * (offset + weight.double())


def llama_rounding_tol(x, weight, offset, mode, dtype):
    """The extra forward error "llama" casting allows, derived (None where there is none).

    The op rounds ``n = x·rstd`` to x's dtype before multiplying by ``g = offset + w``. Our fp32
    rstd and the float64 one differ by ~1e-6 relative, far below a bf16/fp16 step, so wherever
    ``x·rstd`` lies that close to a rounding boundary the two round to neighbouring values, one
    ulp(n) apart: the product then differs by ``|g|·ulp(n)`` on top of the output's own rounding
    (which the 2-ulp bound covers). Near ``n = 4`` with ``g = 1`` that is 2**-5 + half an output
    ulp 2**-6 > 2 ulps · (|y| + mean|y|) — the 1-in-134M element seen at 16384×8192 on the H200.
    fp32 inputs round n at fp32 precision, which their norm-relative bound already covers.
    ``x`` holds the input's values (any precision); ``dtype`` is the op's input dtype.
    """
    if mode != "llama" or dtype == torch.float32:
        return None
    n = rms64(x.detach(), None, EPS, 0.0, dtype)
    gain = 1.0 if weight is None else (offset + weight.detach().double()).abs()
    return gain * ulp(n, dtype)


def leaf64(t):
    return None if t is None else t.detach().double().requires_grad_()


def grads(outputs, inputs, grad_outputs):
    """Gradients for the inputs that require one (None for the others)."""
    wanted = [t is not None and t.requires_grad for t in inputs]
    chosen = [t for t, w in zip(inputs, wanted, strict=True) if w]
    # An input the outputs do not depend on (the weight when only new_residual is used) gets zeros.
    got = iter(torch.autograd.grad(outputs, chosen, grad_outputs, allow_unused=True, materialize_grads=True))
    return [next(got) if w else None for w in wanted]


def make_weight(hidden, offset, dtype, device):
    # Random gains around the effective value 1 (not ones: a wrong weight index must show).
    return (1.0 - offset + 0.5 * fresh_randn(hidden, device=device)).to(dtype).requires_grad_()


def check_rms_norm(x, weight, mode, offset, dy=None, in_place=False, tol_dtype=None):
    """Ours vs `rms64` in forward and backward; returns our (y, dx, dw)."""
    tol_dtype = tol_dtype or x.dtype
    y = rms_norm(x, weight, EPS, offset, mode, in_place)
    x64, w64 = leaf64(x), leaf64(weight)
    y64 = rms64(x64, w64, EPS, offset, x.dtype if mode == "llama" else None)
    expected_dtype = (
        torch.promote_types(x.dtype, weight.dtype) if mode == "llama" and weight is not None else x.dtype
    )
    assert y.dtype == expected_dtype and y.shape == x.shape
    assert_close(y, y64, tol_dtype, f"{mode} y", llama_rounding_tol(x, weight, offset, mode, x.dtype))

    if dy is None:
        dy = fresh_randn(*y.shape, dtype=y.dtype, device=x.device)
    dy_copy = dy.detach().clone()  # in_place may overwrite dy
    dx, dw = grads(y, [x, weight], dy)
    dx64, dw64 = grads(y64, [x64, w64], dy_copy.double())
    assert dx.dtype == x.dtype
    assert_close(dx, dx64, tol_dtype, f"{mode} dx")
    if weight is not None and weight.requires_grad:
        assert dw.dtype == weight.dtype
        assert_close(dw, dw64, tol_dtype, f"{mode} dw")
    return y, dx, dw


SHAPES = [
    (1, 1000),  # one row
    (64, 1000),  # more row blocks than backward programs (see test_shapes_exercise_persistent_loop)
    (2, 3, 2304),  # leading [2, 3], Gemma-2B hidden
    (5, 3072),
    (3, 5120),  # block of 8192 columns, one row per block
    (2, 5, 4, 128),  # q_norm/k_norm: [B, S, heads, head_dim], norm over head_dim
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_float64(shape, mode, offset, dtype, poisoned_allocations, device):
    x = fresh_randn(*shape, dtype=dtype, requires_grad=True, device=device)
    check_rms_norm(x, make_weight(shape[-1], offset, dtype, x.device), mode, offset)


def test_shapes_exercise_persistent_loop():
    """The (64, 1000) case above must give the backward more row blocks than programs (the
    interpreter runs one program per stand-in SM)."""
    blocks = 64 // rms_module._default_config(True, 1000, "cpu").block_m
    assert sm_count(torch.device("cpu")) < blocks


def test_llama_rounding_tol_is_needed_and_sufficient():
    """`llama_rounding_tol`'s derivation on values placed where the double rounding flips.

    n values half-way between bf16 neighbours in [4, 4.5) (ulp 2**-5), nudged by ∓1e-7 relative
    (an rstd last-bit difference): the reference rounds n down, "ours" rounds it up, then both
    are multiplied by a gain near 1 and ours is rounded to bf16. Among typical values (|y| ~ 0.8
    on average) the 2-ulp bound alone rejects some of these; with |g|·ulp(n) added all pass.
    """
    mid = 4.0 + (torch.randint(0, 16, (4096,)).double() + 0.5) * 2.0**-5
    n_ref = (mid * (1 - 1e-7)).to(torch.bfloat16).double()
    n_ours = (mid * (1 + 1e-7)).to(torch.bfloat16).double()
    assert torch.equal(n_ours - n_ref, ulp(n_ref, torch.bfloat16))  # exactly one step apart
    gain = (1.0 + 0.05 * torch.randn(4096)).to(torch.bfloat16).double()
    typical = torch.randn(60000).to(torch.bfloat16).double()  # same n, same gain 1: only rounding
    ref = torch.cat([gain * n_ref, typical])
    ours = torch.cat([(gain * n_ours).float().to(torch.bfloat16), typical.to(torch.bfloat16)])
    extra = torch.cat([gain.abs() * ulp(n_ref, torch.bfloat16), torch.zeros(60000, dtype=torch.float64)])
    with pytest.raises(AssertionError, match="outside 2 bf16 ulps"):
        assert_close(ours, ref, torch.bfloat16, "2-ulp bound alone")
    assert_close(ours, ref, torch.bfloat16, "with the double-rounding term", extra)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["llama", "gemma"])
def test_rms_norm_without_weight(mode, dtype, poisoned_allocations, device):
    x = fresh_randn(13, 1000, dtype=dtype, requires_grad=True, device=device)
    check_rms_norm(x, None, mode, 0.0)


def test_one_row_per_block_config(monkeypatch, poisoned_allocations, device):
    """One row per block, a pipelined loop and a persistent grid of one program per (stand-in)
    SM over 13 rows (uneven iterations), as on a GPU."""
    config = rms_module._RowNormConfig(block_m=1, num_warps=4, num_stages=2, programs_per_sm=1)
    monkeypatch.setattr(rms_module, "_default_config", lambda *a: config)
    for mode, offset in MODES:
        x = fresh_randn(13, 1000, dtype=torch.bfloat16, requires_grad=True, device=device)
        check_rms_norm(x, make_weight(1000, offset, torch.bfloat16, x.device), mode, offset)


def test_int64_offsets_path(monkeypatch, poisoned_allocations, device):
    """The int64-offset variant computes the same thing (real > 2**31 sizes run in the GPU test)."""
    monkeypatch.setattr(rms_module, "offsets_need_int64", lambda *ts: True)
    for mode, offset in MODES:
        x = fresh_randn(9, 1000, dtype=torch.float32, requires_grad=True, device=device)
        check_rms_norm(x, make_weight(1000, offset, torch.float32, x.device), mode, offset)
        r = fresh_randn(9, 1000, requires_grad=True, device=device)
        check_add_rms_norm(x, r, make_weight(1000, offset, torch.float32, x.device), mode, offset)


def test_offsets_need_int64_is_stride_aware():
    big = torch.empty((3, 2**30 + 8), device="meta")
    assert offsets_need_int64(big[:, :8])  # 24 elements, last offset past 2**31
    assert not offsets_need_int64(big[:2, :8])
    assert not offsets_need_int64(torch.empty((4, 8), device="meta"), None)
    # One kv head of an HF-layout [B, S, H, D] buffer seen as [B, H, S, D]: 2**22 elements.
    heads = torch.empty((2, 2**20, 64, 32), device="meta").transpose(1, 2)[:, :1]
    assert offsets_need_int64(heads) and not offsets_need_int64(heads[:1])
    assert not offsets_need_int64(torch.empty((0, 2**31), device="meta"))


@pytest.mark.parametrize("mode,offset", MODES)
def test_non_contiguous_inputs_and_grads(mode, offset, poisoned_allocations, device):
    # Row-strided view (no copy needed): every other row of a [2·R, H] buffer.
    base = fresh_randn(2 * 11, 1000, dtype=torch.bfloat16, device=device)
    x = base[::2].detach().requires_grad_()
    assert not x.is_contiguous()
    w = make_weight(1000, offset, torch.bfloat16, x.device)
    dy = fresh_randn(1000, 2 * 11, dtype=torch.bfloat16, device=device).t()[
        ::2
    ]  # [11, 1000], column stride 22
    check_rms_norm(x, w, mode, offset, dy=dy)
    # Transposed input: last-dim stride != 1, so the op copies.
    xt = (
        fresh_randn(1000, 2, 3, dtype=torch.float32, device=device).permute(1, 2, 0).detach().requires_grad_()
    )
    check_rms_norm(xt, make_weight(1000, offset, torch.float32, xt.device), mode, offset)


def test_broadcast_grad_output(poisoned_allocations, device):
    """dy with a zero row stride (an expanded gradient): read correctly, never written over."""
    x = fresh_randn(6, 1000, requires_grad=True, device=device)
    dy = fresh_randn(1, 1000, device=device).expand(6, 1000)
    check_rms_norm(x, make_weight(1000, 0.0, torch.float32, x.device), "llama", 0.0, dy=dy, in_place=True)


def test_float16(poisoned_allocations, device):
    x = fresh_randn(2, 7, 3072, dtype=torch.float16, requires_grad=True, device=device)
    for mode, offset in MODES:
        check_rms_norm(x, make_weight(3072, offset, torch.float16, x.device), mode, offset)


def test_fp32_weight_with_bf16_input_promotes_like_hf(poisoned_allocations, device):
    """Llama mode: bf16 x, fp32 weight → fp32 output (HF's `weight * n.to(bf16)` promotes)."""
    x = fresh_randn(7, 1000, dtype=torch.bfloat16, requires_grad=True, device=device)
    w = make_weight(1000, 0.0, torch.float32, x.device)
    check_rms_norm(x, w, "llama", 0.0, tol_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_dx_reuses_grad_buffer(dtype, poisoned_allocations, device):
    x = fresh_randn(2, 9, 2304, dtype=dtype, requires_grad=True, device=device)
    w = make_weight(2304, 0.0, dtype, x.device)
    dy = fresh_randn(2, 9, 2304, dtype=dtype, device=device)
    _, dx, _ = check_rms_norm(x, w, "llama", 0.0, dy=dy, in_place=True)
    assert dx.data_ptr() == dy.data_ptr(), "in_place=True should write dx over dy's buffer"


def test_in_place_falls_back_when_dtypes_differ(poisoned_allocations, device):
    x = fresh_randn(5, 1000, dtype=torch.bfloat16, requires_grad=True, device=device)
    w = make_weight(1000, 0.0, torch.float32, x.device)  # fp32 output → fp32 dy, bf16 dx
    dy = fresh_randn(5, 1000, device=device)
    _, dx, _ = check_rms_norm(x, w, "llama", 0.0, dy=dy, in_place=True, tol_dtype=torch.bfloat16)
    assert dx.data_ptr() != dy.data_ptr()


def test_frozen_weight_skips_dw(poisoned_allocations, device):
    x = fresh_randn(5, 1000, requires_grad=True, device=device)
    w = make_weight(1000, 0.0, torch.float32, x.device).detach()
    check_rms_norm(x, w, "llama", 0.0)


def test_zero_rows(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and torch.equal(w.grad, torch.zeros_like(w))


# ------------------------------------------------------------------------------ add + RMSNorm


def check_add_rms_norm(x, residual, weight, mode, offset, use=("normed", "residual")):
    normed, new_res = add_rms_norm(x, residual, weight, EPS, offset, mode)
    x64, r64, w64 = leaf64(x), leaf64(residual), leaf64(weight)
    # Specified: the sum is held in the input dtype (as the model's `hidden + residual`), and that
    # rounded value is normalised.
    s64 = ste_round(x64 + r64, x.dtype)
    normed64 = rms64(s64, w64, EPS, offset, x.dtype if mode == "llama" else None)
    assert new_res.dtype == x.dtype and new_res.shape == x.shape
    assert_close(new_res, s64, x.dtype, "new_residual")
    assert_close(
        normed, normed64, x.dtype, f"{mode} normed", llama_rounding_tol(s64, weight, offset, mode, x.dtype)
    )

    outs, outs64, gouts = [], [], []
    if "normed" in use:
        g = fresh_randn(*normed.shape, dtype=normed.dtype, device=x.device)
        outs, outs64, gouts = [normed], [normed64], [g]
    if "residual" in use:
        g = fresh_randn(*new_res.shape, dtype=new_res.dtype, device=x.device)
        outs, outs64, gouts = outs + [new_res], outs64 + [s64], gouts + [g]
    dx, dr, dw = grads(outs, [x, residual, weight], gouts)
    dx64, dr64, dw64 = grads(outs64, [x64, r64, w64], [g.double() for g in gouts])
    assert_close(dx, dx64, x.dtype, "dx")
    assert_close(dr, dr64, x.dtype, "dresidual")
    if weight is not None:
        assert_close(dw, dw64, x.dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("shape", [(1, 1000), (64, 1000), (2, 3, 3072), (2, 5, 4, 128)], ids=str)
def test_add_rms_norm_matches_float64(shape, mode, offset, dtype, poisoned_allocations, device):
    x = fresh_randn(*shape, dtype=dtype, requires_grad=True, device=device)
    r = fresh_randn(*shape, dtype=dtype, scale=3.0, requires_grad=True, device=device)
    check_add_rms_norm(x, r, make_weight(shape[-1], offset, dtype, x.device), mode, offset)


@pytest.mark.parametrize("use", [("normed",), ("residual",)], ids=str)
def test_add_rms_norm_one_output_used(use, poisoned_allocations, device):
    x = fresh_randn(6, 2304, requires_grad=True, device=device)
    r = fresh_randn(6, 2304, requires_grad=True, device=device)
    check_add_rms_norm(x, r, make_weight(2304, 0.0, torch.float32, x.device), "llama", 0.0, use=use)


def test_add_rms_norm_without_weight_and_strided(poisoned_allocations, device):
    x = fresh_randn(10, 2304, dtype=torch.bfloat16, device=device)[::2].detach().requires_grad_()
    r = fresh_randn(5, 2304, dtype=torch.bfloat16, requires_grad=True, device=device)
    check_add_rms_norm(x, r, None, "gemma", 0.0)


# ------------------------------------------------------------------------------ vs Hugging Face


def hf_pair(hf_cls, hidden, dtype, device, **ours_kw):
    """An HF norm with random weights and our RMSNorm loaded from its state_dict."""
    hf = hf_cls(hidden, eps=EPS).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(hf.weight + 0.5 * torch.randn_like(hf.weight, dtype=torch.float32).to(dtype))
    ours = RMSNorm(hidden, eps=EPS, dtype=dtype, device=device, **ours_kw)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


# (HF class, our RMSNorm kwargs, CPU shape, GPU shape)
HF_CASES = [
    (LlamaRMSNorm, {}, (3, 7, 1000), (8, 2048, 4096)),
    (Qwen3RMSNorm, {}, (2, 5, 6, 128), (8, 2048, 32, 128)),  # q_norm over head_dim
    (GemmaRMSNorm, {"offset": 1.0, "casting_mode": "gemma"}, (3, 7, 2304), (8, 2048, 2304)),
    (Gemma3RMSNorm, {"offset": 1.0, "casting_mode": "gemma"}, (2, 5, 4, 256), (8, 2048, 8, 256)),
]


def check_vs_hf(hf_cls, ours_kw, shape, dtype, device, min_bit_equal=None):
    """Ours vs the HF module: forward within tolerance (and optionally mostly bit-identical);
    gradients no less accurate than HF's own against float64. Returns the bit-equal fractions."""
    hf, ours = hf_pair(hf_cls, shape[-1], dtype, device, **ours_kw)
    x = fresh_randn(*shape, dtype=dtype, device=device, requires_grad=True)
    y = ours(x)
    y_hf = hf(x)
    assert y.dtype == y_hf.dtype
    offset, mode = ours_kw.get("offset", 0.0), ours_kw.get("casting_mode", "llama")
    # HF rounds x·rstd too, from its own rstd: ours and HF's may sit on either side of a boundary.
    rounding_tol = llama_rounding_tol(x, hf.weight, offset, mode, dtype)
    assert_close(y, y_hf, dtype, f"{hf_cls.__name__} forward", rounding_tol)
    # The CPU fallback reproduces HF exactly.
    assert torch.equal(rms_norm_reference(x, hf.weight, EPS, offset, mode), y_hf)
    fwd_equal = (y == y_hf).float().mean().item()
    if min_bit_equal is not None:
        assert fwd_equal >= min_bit_equal, f"only {fwd_equal:.4f} of outputs bit-identical to HF"

    dy = fresh_randn(*y.shape, dtype=y.dtype, device=device)
    dx, dw = torch.autograd.grad(y, (x, ours.weight), dy)
    dx_hf, dw_hf = torch.autograd.grad(y_hf, (x, hf.weight), dy)
    x64, w64 = leaf64(x), leaf64(hf.weight)
    y64 = rms64(x64, w64, EPS, offset, dtype if mode == "llama" else None)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    for name, ours_g, hf_g, ref in (("dx", dx, dx_hf, dx64), ("dw", dw, dw_hf, dw64)):
        assert_close(ours_g, ref, dtype, f"{hf_cls.__name__} {name}")
        assert rel_err(ours_g, ref) <= 2 * rel_err(hf_g, ref) + 1e-6, (
            f"{hf_cls.__name__} {name}: ours {rel_err(ours_g, ref):.3g} vs HF {rel_err(hf_g, ref):.3g}"
        )
    return fwd_equal, (dx == dx_hf).float().mean().item(), (dw == dw_hf).float().mean().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hf_cls,ours_kw,shape,_", HF_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_matches_hf_modules(hf_cls, ours_kw, shape, _, dtype, device):
    # Measured on CPU: bf16 forward 100% bit-identical to HF (fp32 ~80-90%: last-bit rstd differences).
    check_vs_hf(hf_cls, ours_kw, shape, dtype, device, 0.99 if dtype == torch.bfloat16 else None)


def test_module_state_dict_and_init():
    llama = RMSNorm(48)
    assert torch.equal(llama.weight, torch.ones(48)) and llama.variance_epsilon == llama.eps == 1e-6
    gemma = RMSNorm(48, offset=1.0, casting_mode="gemma", dtype=torch.bfloat16)
    assert torch.equal(gemma.weight, torch.zeros(48, dtype=torch.bfloat16))
    assert set(llama.state_dict()) == set(LlamaRMSNorm(48).state_dict()) == {"weight"}
    assert set(gemma.state_dict()) == set(GemmaRMSNorm(48).state_dict())
    plain = RMSNorm(48, elementwise_affine=False)
    assert plain.weight is None and plain.state_dict() == {}
    assert "casting_mode='gemma'" in repr(gemma)


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Off the Triton path (plain CPU tensors, no interpreter) the reference runs, bit-identical to HF."""
    monkeypatch.setattr(rms_module, "use_triton", lambda *ts: False)
    hf, ours = hf_pair(LlamaRMSNorm, 64, torch.bfloat16, "cpu")
    x = fresh_randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(ours(x), hf(x))
    normed, s = add_rms_norm(x, x, ours.weight)
    assert torch.equal(s, x + x) and torch.equal(normed, hf(x + x))


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda d: rms_norm(torch.randn(2, 8, device=d), torch.ones(8, device=d), casting_mode="t5"),
            "casting_mode",
        ),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), torch.ones(7, device=d)), "last .* dimension is 8"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), torch.ones(2, 8, device=d)), "must be 1-D"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), None, offset=1.0), "weight is None"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), eps=-1.0), "eps"),
        (lambda d: rms_norm(torch.ones(2, 8, dtype=torch.int32, device=d)), "floating-point"),
        (
            lambda d: rms_norm(torch.randn(2, 8, dtype=torch.float64, device=d)),
            "float32, bfloat16 or float16",
        ),
        (lambda d: rms_norm(torch.randn(1, 65537, device=d)), "wider than"),
        (lambda d: add_rms_norm(torch.randn(2, 8, device=d), torch.randn(2, 9, device=d)), "residual"),
        (
            lambda d: add_rms_norm(
                torch.randn(2, 8, device=d), torch.randn(2, 8, dtype=torch.bfloat16, device=d)
            ),
            "residual",
        ),
        (lambda d: RMSNorm(8, casting_mode="gemma2"), "casting_mode"),
        (lambda d: RMSNorm(8, offset=1.0, elementwise_affine=False), "elementwise_affine"),
    ],
)
def test_bad_input_errors(call, match, device):
    with pytest.raises((ValueError, TypeError), match=match):
        call(device)


# ------------------------------------------------------------------------------ GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode,offset", MODES)
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_gpu_rms_norm_real_sizes(hidden, mode, offset, dtype, poisoned_allocations):
    x = fresh_randn(16384, hidden, dtype=dtype, device="cuda", requires_grad=True)
    check_rms_norm(x, make_weight(hidden, offset, dtype, x.device), mode, offset)
    r = fresh_randn(16384, hidden, dtype=dtype, device="cuda", requires_grad=True)
    check_add_rms_norm(x, r, make_weight(hidden, offset, dtype, x.device), mode, offset)


@pytest.mark.gpu
def test_gpu_head_dim_norm_and_in_place(poisoned_allocations):
    x = fresh_randn(4, 2048, 32, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = fresh_randn(4, 2048, 32, 128, dtype=torch.bfloat16, device="cuda")
    _, dx, _ = check_rms_norm(x, make_weight(128, 0.0, torch.bfloat16, x.device), "llama", 0.0, dy, True)
    assert dx.data_ptr() == dy.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hf_cls,ours_kw,_,shape", HF_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_gpu_matches_hf_modules(hf_cls, ours_kw, _, shape, dtype):
    # bf16 on the GPU rounds like torch, so outputs differ from HF only where a last-bit difference
    # in rstd (summation order, rsqrt) flips a bf16 rounding: expect almost all bits identical.
    fractions = check_vs_hf(hf_cls, ours_kw, shape, dtype, "cuda", 0.99 if dtype == torch.bfloat16 else None)
    print(f"{hf_cls.__name__} {dtype}: bit-identical fraction fwd/dx/dw = {fractions}")


@pytest.mark.gpu
def test_gpu_persistent_grid_from_occupancy():
    """A config with programs_per_sm=0 (what the tuning sweep tries) sizes the backward grid
    from the compiled kernel's registers: 1..8 programs per SM, and the result stays correct."""
    x = fresh_randn(16384, 4096, dtype=torch.bfloat16, device="cuda")
    w = make_weight(4096, 0.0, torch.bfloat16, x.device)
    y, _, _, mean, rstd = rms_module._row_norm_forward(x, None, w, None, EPS, 0.0, False, True, x.dtype)
    dy = torch.randn_like(y)
    occupancy = rms_module._RowNormConfig(block_m=2, num_warps=16, num_stages=3, programs_per_sm=0)
    dx, dw, _ = rms_module._row_norm_backward(dy, x, w, mean, rstd, 0.0, True, True, False, config=occupancy)
    dx_default, dw_default, _ = rms_module._row_norm_backward(dy, x, w, mean, rstd, 0.0, True, True, False)
    torch.testing.assert_close(dx, dx_default, rtol=0, atol=0)
    torch.testing.assert_close(dw.float(), dw_default.float(), rtol=1e-2, atol=1e-2)
    per_sm = list(rms_module._programs_per_sm.values())
    print(f"backward programs per SM: {per_sm}")
    assert per_sm and all(1 <= n <= 8 for n in per_sm)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """A bf16 input of more than 2**31 elements (4.3 GB); check rows at both ends."""
    rows, hidden = 2**31 // 4096 + 3, 4096
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    assert offsets_need_int64(x)
    w = make_weight(hidden, 0.0, torch.bfloat16, x.device)
    y = rms_norm(x, w)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    for sl in (slice(0, 4), slice(rows - 4, rows)):
        x64, w64 = leaf64(x[sl]), leaf64(w)
        y64 = rms64(x64, w64, EPS, 0.0, torch.bfloat16)
        assert_close(y[sl], y64, torch.bfloat16, f"y rows {sl}")
        (dx64,) = torch.autograd.grad(y64, x64, dy[sl].double())
        assert_close(dx[sl], dx64, torch.bfloat16, f"dx rows {sl}")
    # dw = Σ dy ⊙ bf16(n) over all rows, in float64 chunks.
    dw64 = torch.zeros(hidden, dtype=torch.float64, device="cuda")
    for start in range(0, rows, 65536):
        x64 = x[start : start + 65536].detach().double()
        dw64 += (dy[start : start + 65536].double() * rms64(x64, None, EPS, 0.0, torch.bfloat16)).sum(0)
    assert_close(dw, dw64, torch.bfloat16, "dw")
