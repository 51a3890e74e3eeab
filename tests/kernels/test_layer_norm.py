"""LayerNorm kernel vs a float64 reference and torch.nn.LayerNorm.

Forward and backward (dx, dw, db) on fresh random inputs, weights and biases; odd hidden sizes,
one row, more row blocks than backward programs, [B, S, heads, head_dim] inputs, strided inputs,
weight/bias None, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from ligertune.kernels import rms_norm as rms_module
from ligertune.kernels.layer_norm import LayerNorm, layer_norm, layer_norm_reference
from tests.kernels.helpers import (
    assert_close,
    fresh_randn,
    poisoned_allocations_fixture,  # noqa: F401 (fixture)
    rel_err,
)
from tests.kernels.test_rms_norm import grads, leaf64

# Every tensor the op allocates (outputs, mean/rstd, dx, dw/db partials) starts as NaN.
pytestmark = pytest.mark.usefixtures("poisoned_allocations")

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]


def ln64(x, weight, bias, eps):
    """LayerNorm in float64, written out: (x − mean) / sqrt(var + eps) · w + b (biased variance)."""
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    y = xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def check_layer_norm(x, weight, bias, dy=None):
    y = layer_norm(x, weight, bias, EPS)
    x64, w64, b64 = leaf64(x), leaf64(weight), leaf64(bias)
    y64 = ln64(x64, w64, b64, EPS)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, y64, x.dtype, "y")

    if dy is None:
        dy = fresh_randn(*y.shape, dtype=y.dtype, device=x.device)
    ours = grads(y, [x, weight, bias], dy)
    ref = grads(y64, [x64, w64, b64], dy.double())
    for name, t, g, g64 in zip(("dx", "dw", "db"), (x, weight, bias), ours, ref, strict=True):
        if g is not None:
            assert g.dtype == t.dtype
            assert_close(g, g64, x.dtype, name)
    return y, ours


SHAPES = [(1, 1000), (64, 1000), (2, 3, 2304), (5, 3072), (3, 5120), (2, 5, 4, 128)]


def make_params(hidden, dtype, device, weight=True, bias=True):
    w = (1.0 + 0.5 * fresh_randn(hidden, device=device)).to(dtype).requires_grad_() if weight else None
    b = fresh_randn(hidden, dtype=dtype, device=device, requires_grad=True) if bias else None
    return w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_matches_float64(shape, dtype, device):
    # A non-zero mean (offset 3) so a missing centring term shows.
    x = (fresh_randn(*shape, device=device) + 3.0).to(dtype).requires_grad_()
    check_layer_norm(x, *make_params(shape[-1], dtype, x.device))


@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
def test_optional_weight_and_bias(weight, bias, device):
    x = fresh_randn(13, 1000, dtype=torch.bfloat16, requires_grad=True, device=device)
    check_layer_norm(x, *make_params(1000, torch.bfloat16, x.device, weight, bias))


def test_strided_input_and_grad(device):
    x = fresh_randn(22, 1000, device=device)[::2].detach().requires_grad_()  # row stride 2000
    dy = fresh_randn(1000, 11, device=device).t()  # column stride 11
    check_layer_norm(x, *make_params(1000, torch.float32, x.device), dy=dy)
    xt = fresh_randn(1000, 6, dtype=torch.bfloat16, device=device).t().detach().requires_grad_()  # copied
    check_layer_norm(xt, *make_params(1000, torch.bfloat16, xt.device))


def test_one_row_per_block_config_and_int64_path(monkeypatch, device):
    """One row per block, a pipelined persistent loop of one program per (stand-in) SM over 13
    rows, int64 offsets forced."""
    config = rms_module._RowNormConfig(block_m=1, num_warps=4, num_stages=2, programs_per_sm=1)
    monkeypatch.setattr(rms_module, "_default_config", lambda *a: config)
    monkeypatch.setattr(rms_module, "offsets_need_int64", lambda *ts: True)
    x = fresh_randn(13, 1000, requires_grad=True, device=device)
    check_layer_norm(x, *make_params(1000, torch.float32, x.device))


def test_frozen_params(device):
    x = fresh_randn(5, 1000, requires_grad=True, device=device)
    w, b = make_params(1000, torch.float32, x.device)
    check_layer_norm(x, w.detach(), b.detach())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_torch_layer_norm_module(dtype, device):
    """Against torch.nn.LayerNorm loaded with the same state_dict: forward and gradients."""
    hidden = 2304
    ref = torch.nn.LayerNorm(hidden, eps=EPS, device=device, dtype=dtype)
    with torch.no_grad():
        ref.weight.add_(0.5 * torch.randn_like(ref.weight))
        ref.bias.add_(torch.randn_like(ref.bias))
    ours = LayerNorm(hidden, eps=EPS, device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = (fresh_randn(3, 7, hidden, device=device) * 2 + 1).to(dtype).requires_grad_()
    y, y_ref = ours(x), ref(x)
    assert_close(y, y_ref, dtype, "forward vs nn.LayerNorm")
    # The CPU fallback is torch's own kernel run in fp32: identical in fp32; in bf16 torch's
    # mixed-precision kernel differs in the last bit on a few elements (measured: 0.006%).
    assert_close(layer_norm_reference(x, ref.weight, ref.bias, EPS), y_ref, dtype, "fallback")
    if dtype == torch.float32:
        assert torch.equal(layer_norm_reference(x, ref.weight, ref.bias, EPS), y_ref)

    dy = fresh_randn(*y.shape, dtype=dtype, device=device)
    ours_g = torch.autograd.grad(y, (x, ours.weight, ours.bias), dy)
    torch_g = torch.autograd.grad(y_ref, (x, ref.weight, ref.bias), dy)
    x64, w64, b64 = leaf64(x), leaf64(ref.weight), leaf64(ref.bias)
    ref_g = torch.autograd.grad(ln64(x64, w64, b64, EPS), (x64, w64, b64), dy.double())
    for name, g, gt, g64 in zip(("dx", "dw", "db"), ours_g, torch_g, ref_g, strict=True):
        assert_close(g, g64, dtype, name)
        assert rel_err(g, g64) <= 2 * rel_err(gt, g64) + 1e-6, f"{name}: less accurate than torch's"


def test_module_state_dict_and_init():
    ours, ref = LayerNorm(48), torch.nn.LayerNorm(48)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert ours.normalized_shape == ref.normalized_shape and ours.eps == ref.eps
    assert LayerNorm(48, bias=False).bias is None
    plain = LayerNorm(48, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and plain.state_dict() == {}


def test_cpu_fallback_without_interpreter(monkeypatch):
    import ligertune.kernels.layer_norm as ln_module

    monkeypatch.setattr(ln_module, "use_triton", lambda *ts: False)
    x = fresh_randn(3, 64, dtype=torch.bfloat16)
    w, b = make_params(64, torch.bfloat16, x.device)
    assert torch.equal(layer_norm(x, w, b), torch.nn.functional.layer_norm(x, (64,), w, b))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda d: layer_norm(torch.randn(2, 8, device=d), torch.ones(7, device=d)), "weight has shape"),
        (
            lambda d: layer_norm(torch.randn(2, 8, device=d), None, torch.ones(2, 8, device=d)),
            "bias has shape",
        ),
        (lambda d: layer_norm(torch.randn(2, 8, device=d), eps=-1.0), "eps"),
        (lambda d: layer_norm(torch.ones(2, 8, dtype=torch.int64, device=d)), "floating-point"),
        (lambda d: layer_norm(torch.randn(1, 65537, device=d)), "wider than"),
    ],
)
def test_bad_input_errors(call, match, device):
    with pytest.raises((ValueError, TypeError), match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_gpu_layer_norm_real_sizes(hidden, dtype):
    x = (fresh_randn(16384, hidden, device="cuda") + 3.0).to(dtype).requires_grad_()
    check_layer_norm(x, *make_params(hidden, dtype, x.device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_matches_torch_layer_norm_module(dtype):
    test_matches_torch_layer_norm_module(dtype, torch.device("cuda"))
