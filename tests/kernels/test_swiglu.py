"""SwiGLU / GeGLU kernels and GatedMLP vs float64 references (torch and transformers).

Forward and backward on fresh random inputs of odd sizes, fp32 and bf16; the activations
against HF's ACT2FN["silu"] / ACT2FN["gelu_pytorch_tanh"]; GatedMLP against LlamaMLP and
Phi3MLP with the same weights. Tensors the ops allocate start as NaN (`poisoned_allocations`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Phi3Config
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from ligertune.kernels import swiglu as swiglu_module
from ligertune.kernels.swiglu import (
    GatedMLP,
    gated_act,
    geglu,
    geglu_reference,
    swiglu,
    swiglu_reference,
)
from tests.kernels.helpers import (
    assert_close,
    fresh_randn,
    poisoned_allocations_fixture,  # noqa: F401 (fixture)
    rel_err,
)

# ours, HF activation name, our reference
OPS = {
    "swiglu": (swiglu, "silu", swiglu_reference),
    "geglu": (geglu, "gelu_pytorch_tanh", geglu_reference),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Under the interpreter tl.sigmoid's exp(-x) overflows to inf for very negative x (numpy warns);
# 1 / (1 + inf) = 0 is the right limit, and the values are checked.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def hf_gated(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return ACT2FN[activation](gate) * up


def check_gated(op, hf_act, gate, up, **kwargs):
    """Forward and backward of `op` vs HF's activation in float64 on the same rounded inputs.

    gate and up go in with their strides as given (detach() keeps them; clone() would not).
    """
    gate_in = gate.detach().requires_grad_()
    up_in = up.detach().requires_grad_()
    out = op(gate_in, up_in, **kwargs)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = hf_gated(hf_act, g64, u64)
    assert out.dtype == gate.dtype
    assert_close(out, ref, gate.dtype, "out")
    dout = fresh_randn(*out.shape, dtype=gate.dtype, device=gate.device)
    dgate, dup = torch.autograd.grad(out, (gate_in, up_in), dout)
    dgate_ref, dup_ref = torch.autograd.grad(ref, (g64, u64), dout.double())
    assert_close(dgate, dgate_ref, gate.dtype, "dgate")
    assert_close(dup, dup_ref, gate.dtype, "dup")


@pytest.mark.parametrize("shape", [(3, 1000), (7, 2304), (1, 5120), (2, 3, 700), (5,)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op_name", OPS)
def test_contiguous(op_name, dtype, shape, device, poisoned_allocations):
    op, hf_act, _ = OPS[op_name]
    gate = fresh_randn(*shape, dtype=dtype, device=device, scale=3.0)
    check_gated(op, hf_act, gate, fresh_randn(*shape, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op_name", OPS)
def test_halves_of_fused_projection(op_name, dtype, device, poisoned_allocations):
    """gate/up as the two chunk() halves of one [B, S, 2I] tensor: row-strided, not copied."""
    op, hf_act, _ = OPS[op_name]
    gate, up = fresh_randn(2, 5, 2 * 1100, dtype=dtype, device=device, scale=3.0).chunk(2, dim=-1)
    check_gated(op, hf_act, gate, up)


@pytest.mark.parametrize("op_name", OPS)
def test_mixed_layouts(op_name, device, poisoned_allocations):
    """gate and up with different row strides; a transposed gate (its rows do not merge: copied)."""
    op, hf_act, _ = OPS[op_name]
    d = device
    check_gated(
        op, hf_act, fresh_randn(5, 1400, device=d, scale=3.0)[:, 300:1000], fresh_randn(5, 700, device=d)
    )
    check_gated(op, hf_act, fresh_randn(300, 6, device=d, scale=3.0).t(), fresh_randn(6, 300, device=d))


@pytest.mark.parametrize("op_name", OPS)
def test_large_magnitudes(op_name, device):
    """Saturated sigmoids (|gate| up to ~40): no inf/NaN, values still match."""
    op, hf_act, _ = OPS[op_name]
    check_gated(
        op, hf_act, fresh_randn(4, 777, device=device, scale=15.0), fresh_randn(4, 777, device=device)
    )


@pytest.mark.parametrize("op_name", OPS)
def test_inplace_backward(op_name, device, poisoned_allocations):
    """inplace_backward on intermediates: right gradients, written over gate/up's memory."""
    op, hf_act, _ = OPS[op_name]
    x = fresh_randn(6, 900, device=device, requires_grad=True)
    gate_in, up_in = (x * 3.0).chunk(2, dim=-1)  # non-leaf intermediates, like an MLP's
    out = op(gate_in, up_in, inplace_backward=True)
    dout = fresh_randn(*out.shape, device=device)
    out.backward(dout)

    x64 = x.detach().double().requires_grad_()
    g64, u64 = (x64 * 3.0).chunk(2, dim=-1)
    hf_gated(hf_act, g64, u64).backward(dout.double())
    assert_close(x.grad, x64.grad, torch.float32, "dx through in-place gate/up grads")
    # The gradient now lives where gate/up were (the memory the in-place option saves).
    gate_grad = x64.grad[:, :450] / 3.0
    assert_close(gate_in.detach(), gate_grad, torch.float32, "dgate stored over gate")


def test_inplace_backward_spares_leaves(device):
    """With leaf inputs the in-place option is ignored: the user's tensors are untouched."""
    gate = fresh_randn(3, 500, device=device, requires_grad=True)
    up = fresh_randn(3, 500, device=device, requires_grad=True)
    gate_before, up_before = gate.detach().clone(), up.detach().clone()
    swiglu(gate, up, inplace_backward=True).backward(fresh_randn(3, 500, device=device))
    assert torch.equal(gate.detach(), gate_before) and torch.equal(up.detach(), up_before)


# Views of a leaf parameter (each a non-leaf whose ``_base`` is the leaf), as (gate, up) pairs.
LEAF_VIEWS = {
    "chunk": lambda p: p.chunk(2, dim=-1),
    "slices": lambda p: (p[:, :250], p[:, 250:]),
    "view_of_view": lambda p: p.view(2, 3, 500).unbind(0),
    "transposed": lambda p: (p[:, :250].t(), p[:, 250:].t()),
}


@pytest.mark.parametrize("views", LEAF_VIEWS)
@pytest.mark.parametrize("op_name", OPS)
def test_inplace_backward_spares_views_of_a_leaf(op_name, views, device):
    """gate/up split off a parameter (``p.chunk(2, -1)``) are non-leaf views of it: the backward
    must not write their gradients into ``p``; ``p.grad`` is the float64 reference gradient."""
    op, hf_act, _ = OPS[op_name]
    p = nn.Parameter(fresh_randn(6, 500, device=device, scale=3.0))
    before = p.detach().clone()
    gate, up = LEAF_VIEWS[views](p)
    out = op(gate, up, inplace_backward=True)
    dout = fresh_randn(*out.shape, device=device)
    out.backward(dout)

    p64 = before.double().requires_grad_()
    hf_gated(hf_act, *LEAF_VIEWS[views](p64)).backward(dout.double())
    assert torch.equal(p.detach(), before), "the parameter was overwritten by the in-place backward"
    assert_close(p.grad, p64.grad, torch.float32, "p.grad")


# (gate, up) views of one [6, 602] intermediate, and whether they may take the in-place backward.
INTERMEDIATE_SPLITS = {
    "shifted_by_one": (lambda h: (h[:, :300], h[:, 1:301]), False),
    "same_tensor": (lambda h: (h[:, :300], h[:, :300]), False),
    "overlapping_row_blocks": (lambda h: (h[:3, :300], h[2:5, 1:301]), False),
    "fused_halves": (lambda h: h.chunk(2, dim=-1), True),
    "alternate_rows": (lambda h: (h[::2, :300], h[1::2, 1:301]), True),
    "row_blocks": (lambda h: (h[:3, 2:302], h[3:, :300]), True),
}


@pytest.mark.parametrize("split", INTERMEDIATE_SPLITS)
def test_inplace_backward_on_views_of_one_intermediate(split, device):
    """Views of one intermediate that share elements cannot hold both gradients: the allocating
    backward runs (gate keeps its values). Provably disjoint views (the halves of a fused
    projection, alternate rows, separate row blocks) take the in-place backward. Gradients right
    either way."""
    fn, in_place = INTERMEDIATE_SPLITS[split]
    x = fresh_randn(6, 602, device=device, requires_grad=True)
    gate, up = fn(x * 3.0)
    gate_before = gate.detach().clone()
    out = swiglu(gate, up, inplace_backward=True)
    dout = fresh_randn(*out.shape, device=device)
    out.backward(dout)

    x64 = x.detach().double().requires_grad_()
    g64, u64 = fn(x64 * 3.0)
    dgate64 = torch.autograd.grad(hf_gated("silu", g64, u64), g64, dout.double(), retain_graph=True)[0]
    hf_gated("silu", g64, u64).backward(dout.double())
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    if in_place:
        assert_close(gate.detach(), dgate64, torch.float32, "dgate stored over gate")
    else:
        assert torch.equal(gate.detach(), gate_before), "overlapping views were overwritten"


def test_inplace_backward_under_another_reader_fails_loudly(device):
    """A graph node that saved gate/up's buffer and runs its backward after ours would read
    gradients instead of activations: the in-place op bumps the version counter, so autograd
    refuses instead of computing a silently wrong gradient."""
    x = fresh_randn(4, 80, device=device, requires_grad=True)
    h = x * 2.0
    other = (h * x).sum()  # saves h; recorded before the swiglu, so its backward runs after
    out = swiglu(*h.chunk(2, dim=-1), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + other).backward()


@pytest.mark.parametrize("op_name", OPS)
def test_reference_matches_hf(op_name):
    """The pure-PyTorch references (the CPU fallback) against HF's activations."""
    _, hf_act, reference = OPS[op_name]
    gate, up = fresh_randn(4, 333, dtype=torch.float64, scale=3.0), fresh_randn(4, 333, dtype=torch.float64)
    assert_close(reference(gate, up), hf_gated(hf_act, gate, up), torch.float32, "reference")


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Off the Triton path (plain CPU tensors, no interpreter) the references run, autograd included."""
    monkeypatch.setattr(swiglu_module, "use_triton", lambda *ts: False)
    for op, hf_act, _ in OPS.values():
        check_gated(op, hf_act, fresh_randn(3, 100, scale=3.0), fresh_randn(3, 100))


def test_int64_offset_path(monkeypatch, device, poisoned_allocations):
    """The int64 index path (taken past 2**31 elements) computes the same values."""
    monkeypatch.setattr(swiglu_module, "_needs_int64", lambda rows, block: True)
    gate, up = fresh_randn(3, 1000, device=device, scale=3.0), fresh_randn(3, 1000, device=device)
    check_gated(geglu, "gelu_pytorch_tanh", gate, up)
    gate, up = fresh_randn(2, 2 * 600, device=device, scale=3.0).chunk(2, dim=-1)
    check_gated(swiglu, "silu", gate, up)


def test_empty_input(device):
    gate = fresh_randn(0, 64, device=device, requires_grad=True)
    up = fresh_randn(0, 64, device=device, requires_grad=True)
    out = swiglu(gate, up)
    out.sum().backward()
    assert out.shape == (0, 64) and gate.grad.shape == (0, 64)


@pytest.mark.parametrize(
    "gate_shape, up_shape, dtypes, activation, match",
    [
        ((3, 8), (3, 9), (torch.float32, torch.float32), "silu", "same shape"),
        ((3, 8), (3, 8), (torch.float32, torch.bfloat16), "silu", "one floating dtype"),
        ((3, 8), (3, 8), (torch.int32, torch.int32), "silu", "one floating dtype"),
        ((3, 8), (3, 8), (torch.float32, torch.float32), "gelu", "unsupported gated activation 'gelu'"),
        ((3, 8), (3, 8), (torch.float32, torch.float32), "relu", "supported: "),
    ],
)
def test_bad_inputs_raise(gate_shape, up_shape, dtypes, activation, match, device):
    gate = torch.ones(gate_shape, dtype=dtypes[0], device=device)
    up = torch.ones(up_shape, dtype=dtypes[1], device=device)
    with pytest.raises(ValueError, match=match):
        gated_act(gate, up, activation)


def test_mlp_rejects_unknown_activation():
    with pytest.raises(ValueError, match="unsupported gated activation"):
        GatedMLP(16, 32, activation="gelu")


# ------------------------------------------------------------------------------- GatedMLP


def hf_mlp(kind: str, hidden: int, inter: int, activation: str, bias: bool):
    if kind == "llama":
        config = LlamaConfig(
            hidden_size=hidden, intermediate_size=inter, hidden_act=activation, mlp_bias=bias
        )
        return LlamaMLP(config)
    return Phi3MLP(Phi3Config(hidden_size=hidden, intermediate_size=inter, hidden_act=activation))


# A bf16 MLP rounds gate, up, act·up and every matmul output to bf16: a chain of three matmuls
# does not meet the per-element 2-ulp bound of `assert_close`, and HF's own bf16 MLP misses it
# on every draw. So in bf16 the bound is HF's bf16 module on the same inputs and weights: our
# relative error vs float64 may be at most this factor above its (the CPU interpreter truncates
# fp32->bf16 instead of rounding, which costs ours ~10%). A wiring bug (wrong split, missing
# bias, swapped gate/up) gives errors of order 1, far outside.
BF16_MLP_FACTOR = 1.5


def assert_mlp_close(out, ref, hf_bf16_out, dtype, what):
    if dtype == torch.float32:
        assert_close(out, ref, dtype, what)
        return
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    ours, theirs = rel_err(out, ref), rel_err(hf_bf16_out, ref)
    assert ours <= BF16_MLP_FACTOR * theirs, f"{what}: relative error {ours:.3g} vs HF bf16's {theirs:.3g}"


def check_mlp(kind, activation, dtype, bias, device, batch=(3, 5), hidden=96, inter=200):
    """Our GatedMLP loaded from an HF MLP's state_dict vs that MLP in float64 (and in `dtype`)."""
    ours_act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[activation]
    hf = hf_mlp(kind, hidden, inter, activation, bias).to(device)
    for p in hf.parameters():  # fresh values everywhere, biases included
        p.data.copy_(fresh_randn(*p.shape, scale=p.shape[-1] ** -0.5))
    ours = GatedMLP(
        hidden, inter, ours_act, fused_gate_up=kind == "phi3", bias=bias, dtype=dtype, device=device
    )
    ours.load_state_dict(hf.state_dict())  # strict: every key must match both ways
    hf_same_dtype = copy.deepcopy(hf).to(dtype)
    hf = hf.double()

    x = fresh_randn(*batch, hidden, dtype=dtype, device=device, requires_grad=True)
    x_hf = x.detach().clone().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    outs = ours(x), hf_same_dtype(x_hf), hf(x64)
    assert_mlp_close(*outs, dtype, f"{kind} MLP output")
    dout = fresh_randn(*outs[0].shape, dtype=dtype, device=device)
    for out in outs:
        out.backward(dout.to(out.dtype))
    assert_mlp_close(x.grad, x64.grad, x_hf.grad, dtype, "dx")
    hf_params, hf_same_params = dict(hf.named_parameters()), dict(hf_same_dtype.named_parameters())
    for name, p in ours.named_parameters():
        assert_mlp_close(p.grad, hf_params[name].grad, hf_same_params[name].grad, dtype, f"d{name}")


@pytest.mark.parametrize("kind", ["llama", "phi3"])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_mlp_matches_hf(kind, activation, dtype, device, poisoned_allocations):
    check_mlp(kind, activation, dtype, bias=False, device=device)


def test_mlp_with_bias_matches_llama(device, poisoned_allocations):
    check_mlp("llama", "silu", torch.float32, bias=True, device=device)


def test_mlp_hf_activation_names_accepted():
    """A config's hidden_act can be passed straight through."""
    mlp = GatedMLP(8, 16, activation="gelu_pytorch_tanh", fused_gate_up=True)
    assert set(mlp.state_dict()) == {"gate_up_proj.weight", "down_proj.weight"}
    assert "gelu_pytorch_tanh" in repr(mlp)


# ---------------------------------------------------------------- GPU, benchmark shapes (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("op_name", OPS)
def test_gpu_benchmark_shape(op_name, dtype):
    """8192 × 14336 forward and backward against HF's activation in float64 on CUDA."""
    op, hf_act, _ = OPS[op_name]
    gate = fresh_randn(8192, 14336, dtype=dtype, device="cuda", scale=3.0, requires_grad=True)
    up = fresh_randn(8192, 14336, dtype=dtype, device="cuda", requires_grad=True)
    out = op(gate, up)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = hf_gated(hf_act, g64, u64)
    assert_close(out, ref, dtype, "out")
    dout = fresh_randn(*out.shape, dtype=dtype, device="cuda")
    out.backward(dout)
    ref.backward(dout.double())
    assert_close(gate.grad, g64.grad, dtype, "dgate")
    assert_close(up.grad, u64.grad, dtype, "dup")


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """More than 2**31 elements: the tail, where int32 offsets would wrap, is checked."""
    rows, cols = 2**31 // 16384 + 1, 16384
    gate = fresh_randn(rows, cols, dtype=torch.bfloat16, device="cuda", scale=3.0)
    up = fresh_randn(rows, cols, dtype=torch.bfloat16, device="cuda")
    out = swiglu(gate, up)
    tail = slice(rows - 64, rows)
    ref = hf_gated("silu", gate[tail].double(), up[tail].double())
    assert_close(out[tail], ref, torch.bfloat16, "out tail")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_gpu_mlp_matches_hf(kind):
    check_mlp(
        kind, "silu", torch.bfloat16, bias=False, device="cuda", batch=(4, 512), hidden=2048, inter=5632
    )
