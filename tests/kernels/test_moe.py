"""The MoE experts block vs float64 references: forward and every gradient, both layouts.

The oracle (`oracle`) is written here, apart from the product code: every expert runs on every
token in float64 and its output is scaled by the token's routing weight for that expert (zero
where the token did not pick it), so it shares no sorting, gathering or grouping with the kernel
path. HF's own ``Qwen3MoeExperts`` and ``GptOssExperts`` modules are a second, independent
check. Tensors the path allocates start as NaN (`poisoned_allocations`), and the Triton path
must be the one taken (the reference fallback raises in these tests).

bf16 tolerances. The inputs are the same bf16 values for both sides; what differs is that the
kernel path stores four intermediates in bf16 (the pre-activation, the activation, the down
projection, the combined output), each within ``u`` of its exact value relatively, with
``u = 2**-7`` (2 bf16 ulps: round-to-nearest gives half of one, the interpreter truncates to
one; helpers.py). Forward, elementwise, to first order::

    |out − ref| ≤ u·|out| + Σ_e |c_e| · (u·|y_e| + |W2_e| · (u·(|a_e| + |∂a/∂g|·|g_e| + |∂a/∂u|·|u_e|)))

where ``c_e`` is the token's weight for expert e, ``y_e = W2_e·a_e`` (before the bias, which is
added in fp32), and ``g_e, u_e`` the gate and up pre-activations before their bias; the products
and sums themselves run in fp32 (2**-24 per step, covered by the factor 2 on the whole bound).
Gradients, normwise: each is at the end of a chain of at most five bf16 roundings (pre-activation,
∂L/∂a, ∂L/∂gate_up, ∂L/∂x per pair, the combined gradient), each perturbing the chain's value by
at most ``u`` relatively, and a product with random well-conditioned matrices carries a relative
perturbation through at about its size: ``‖grad − ref‖ / ‖ref‖ ≤ 5·u``. The fp32 tests are the
sharp ones (relative 1e-5); bf16 checks the low-precision plumbing.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from ligertune.kernels import moe as moe_module
from ligertune.kernels.moe import GPT_OSS_ALPHA, GPT_OSS_LIMIT, moe_experts, moe_experts_reference
from tests.kernels.helpers import (
    FP32_REL_TOL,
    assert_close,
    fresh_randn,
    poisoned_allocations_fixture,  # noqa: F401 (fixture)
    rel_err,
)

LAYOUTS = ("gate_up_halves", "gpt_oss")
BF16_U = 2.0**-7
BF16_GRAD_ROUNDINGS = 5
NAMES = ("hidden", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")

# tl.sigmoid's exp(-x) overflows to inf under the interpreter for very negative x; 1/(1+inf) = 0
# is the right limit (values are checked). The interpreter reads a loaded scalar (the segment
# sum's loop bounds) through a one-element array, which numpy deprecates.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


def make_case(n_tokens, hidden, inter, n_experts, k, layout, dtype=torch.float32, device="cpu", experts=None):
    """Fresh random inputs. Routing: k distinct experts per token drawn from ``experts`` (all by
    default); weights softmax-normalised as routers make them. gpt_oss in fp32 gets
    pre-activations wide enough (std ~4) that both clamps at ±7 take effect. In 16 bits they stay
    well inside them (std ~1.4 with the bias): a rounding can move a value across ±7, where the
    derivative jumps, and no rounding bound covers a jump."""
    pool = torch.arange(n_experts) if experts is None else torch.tensor(experts)
    choice = torch.rand(n_tokens, len(pool)).argsort(dim=-1)[:, :k]
    index = pool[choice].to(device)
    weights = torch.softmax(fresh_randn(n_tokens, k, device=device), dim=-1).to(dtype)
    gate_scale = (4.0 if layout == "gpt_oss" and dtype == torch.float32 else 1.0) / hidden**0.5
    if layout == "gate_up_halves":
        w1 = fresh_randn(n_experts, 2 * inter, hidden, dtype=dtype, device=device, scale=gate_scale)
        w2 = fresh_randn(n_experts, hidden, inter, dtype=dtype, device=device, scale=inter**-0.5)
        b1 = b2 = None
    else:
        w1 = fresh_randn(n_experts, hidden, 2 * inter, dtype=dtype, device=device, scale=gate_scale)
        w2 = fresh_randn(n_experts, inter, hidden, dtype=dtype, device=device, scale=inter**-0.5)
        b1 = fresh_randn(n_experts, 2 * inter, dtype=dtype, device=device)
        b2 = fresh_randn(n_experts, hidden, dtype=dtype, device=device, scale=0.5)
    x = fresh_randn(n_tokens, hidden, dtype=dtype, device=device)
    return {
        "hidden": x,
        "top_k_index": index,
        "top_k_weights": weights,
        "gate_up_proj": w1,
        "down_proj": w2,
        "gate_up_bias": b1,
        "down_bias": b2,
    }


def _expert(x, w1, w2, b1, b2, layout):
    """One expert on every row of x, float64: (y before its bias, y, activation, and the
    first-order bf16 sensitivity of the activation, |a| + |∂a/∂g|·|g| + |∂a/∂u|·|u|)."""
    pre = x @ (w1.t() if layout == "gate_up_halves" else w1)
    if layout == "gate_up_halves":
        g0, u0 = pre.chunk(2, dim=-1)
    else:
        g0, u0 = pre[:, 0::2], pre[:, 1::2]
    gb = g0 + (0 if b1 is None else (b1[: b1.shape[0] // 2] if layout == "gate_up_halves" else b1[0::2]))
    ub = u0 + (0 if b1 is None else (b1[b1.shape[0] // 2 :] if layout == "gate_up_halves" else b1[1::2]))
    if layout == "gpt_oss":
        gc, uc = gb.clamp(max=GPT_OSS_LIMIT), ub.clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        sig = torch.sigmoid(GPT_OSS_ALPHA * gc)
        a = (uc + 1) * gc * sig
        da_dg = (gb <= GPT_OSS_LIMIT) * (uc + 1) * (sig + GPT_OSS_ALPHA * gc * sig * (1 - sig))
        da_du = ((ub >= -GPT_OSS_LIMIT) & (ub <= GPT_OSS_LIMIT)) * gc * sig
    else:
        sig = torch.sigmoid(gb)
        a = gb * sig * ub
        da_dg = ub * (sig + gb * sig * (1 - sig))
        da_du = gb * sig
    y0 = a @ (w2.t() if layout == "gate_up_halves" else w2)
    y = y0 if b2 is None else y0 + b2
    sens = a.abs() + da_dg.abs() * g0.abs() + da_du.abs() * u0.abs()
    return y0, y, sens


def oracle(case, layout, with_bound=False, low_memory=False):
    """float64 ``Σ_e c_e ⊙ expert_e(x)`` over all experts (c_e: each token's weight for e, zero
    if not routed there), differentiable in every float input; with ``with_bound`` also the bf16
    forward bound of the module docstring (no gradient). ``low_memory`` recomputes each expert
    in the backward (real sizes)."""
    d = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in case.items()}
    index, weights = d["top_k_index"], d["top_k_weights"]
    out = torch.zeros_like(d["hidden"])
    bound = torch.zeros_like(d["hidden"])
    for e in range(d["gate_up_proj"].shape[0]):
        coef = (weights * (index == e)).sum(dim=-1, keepdim=True)
        args = [d["hidden"], d["gate_up_proj"][e], d["down_proj"][e]]
        b1 = None if d["gate_up_bias"] is None else d["gate_up_bias"][e]
        b2 = None if d["down_bias"] is None else d["down_bias"][e]
        if low_memory:
            y0, y, sens = checkpoint(_expert, *args, b1, b2, layout, use_reentrant=False)
        else:
            y0, y, sens = _expert(*args, b1, b2, layout)
        out = out + coef * y
        if with_bound:
            with torch.no_grad():
                w2 = d["down_proj"][e].abs()
                carried = sens @ (w2.t() if layout == "gate_up_halves" else w2)
                bound += coef.abs() * BF16_U * (y0.abs() + carried)
    if with_bound:
        return out, 2.0 * (bound + BF16_U * out.detach().abs())
    return out


def differentiable(case, frozen=()):
    """Leaf copies of the float inputs (requires_grad unless named in ``frozen``)."""
    return {
        k: (
            v.detach().clone().requires_grad_(k not in frozen)
            if v is not None and v.is_floating_point()
            else v
        )
        for k, v in case.items()
    }


def run_ours(case, layout):
    kw = {k: case[k] for k in ("gate_up_bias", "down_bias")}
    return moe_experts(
        case["hidden"], case["top_k_index"], case["top_k_weights"], case["gate_up_proj"], case["down_proj"],
        layout=layout, **kw,
    )  # fmt: skip


@pytest.fixture(name="kernel_path")
def kernel_path_fixture(monkeypatch):
    """The Triton/grouped_mm path must run: the reference fallback fails the test."""

    def fallback(*args, **kwargs):
        raise AssertionError("moe_experts fell back to the per-expert reference")

    monkeypatch.setattr(moe_module, "moe_experts_reference", fallback)


def check_against_oracle(case, layout, dtype, frozen=()):
    ours_in, ref_in = differentiable(case, frozen), differentiable(case, frozen)
    out = run_ours(ours_in, layout)
    assert out.dtype == dtype and out.shape == case["hidden"].shape
    if dtype == torch.bfloat16:
        ref, bound = oracle(ref_in, layout, with_bound=True)
        assert_close(out, ref, dtype, "out", extra_tol=bound)
    else:
        ref = oracle(ref_in, layout)
        assert_close(out, ref, torch.float32, "out")
    dout = fresh_randn(*out.shape, dtype=dtype, device=out.device)
    wrt = [n for n in NAMES if ours_in[n] is not None and ours_in[n].requires_grad]
    grads = torch.autograd.grad(out, [ours_in[n] for n in wrt], dout)
    refs = torch.autograd.grad(ref, [ref_in[n] for n in wrt], dout.double())
    for name, g, r in zip(wrt, grads, refs, strict=True):
        assert g.dtype == case[name].dtype and g.shape == case[name].shape, name
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient"
        err = rel_err(g, r)
        tol = FP32_REL_TOL if dtype == torch.float32 else BF16_GRAD_ROUNDINGS * BF16_U
        assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:.3g}"


# name: (T, H, I, E, k, experts the routing draws from (None: all))
ROUTINGS = {
    "random": (9, 40, 24, 5, 2, None),
    "odd_experts_k_equals_e": (5, 24, 40, 3, 3, None),
    "top_1": (8, 40, 24, 5, 1, None),
    "one_token": (1, 40, 24, 5, 2, None),
    "idle_experts": (10, 40, 24, 5, 2, [1, 3]),  # experts 0, 2, 4 receive no token
    "all_to_one_expert": (6, 24, 40, 3, 1, [2]),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_matches_float64(layout, routing, poisoned_allocations, kernel_path):
    t, h, i, e, k, experts = ROUTINGS[routing]
    check_against_oracle(make_case(t, h, i, e, k, layout, experts=experts), layout, torch.float32)


@pytest.mark.parametrize("routing", ["random", "idle_experts"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_matches_float64(layout, routing, poisoned_allocations, kernel_path):
    t, h, i, e, k, experts = ROUTINGS[routing]
    case = make_case(t, h, i, e, k, layout, dtype=torch.bfloat16, experts=experts)
    check_against_oracle(case, layout, torch.bfloat16)


def test_rows_wider_than_one_block(kernel_path):
    """H and I past the kernels' 1024-column block: the column loops take several steps (gpt-oss:
    the layout whose loops also index interleaved columns and biases)."""
    check_against_oracle(make_case(3, 1096, 1048, 2, 2, "gpt_oss"), "gpt_oss", torch.float32)


@pytest.mark.parametrize("frozen", [("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"), ("hidden",)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inputs_that_require_no_grad(layout, frozen, kernel_path):
    """Frozen expert weights (a LoRA run) or a hidden without grad: the other gradients are right
    and the frozen tensors get none."""
    case = make_case(7, 40, 24, 5, 2, layout)
    ours_in = differentiable(case, frozen)
    check_against_oracle(case, layout, torch.float32, frozen=frozen)
    run_ours(ours_in, layout).sum().backward()
    for name in frozen:
        assert ours_in[name] is None or ours_in[name].grad is None, name


def test_autocast_computes_in_its_dtype(kernel_path):
    """fp32 inputs under bf16 autocast (``bf16-mixed``; gpt-oss, which has biases to cast too):
    the same result and gradients as with hidden, weights and biases cast to bf16 outside
    autocast (the routing weights stay fp32), returned in fp32, the gradients reaching the fp32
    leaves."""
    layout = "gpt_oss"
    case = make_case(7, 40, 24, 5, 2, layout)
    under, cast = differentiable(case), differentiable(case)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_ours(under, layout)
    floats = [n for n in NAMES if case[n] is not None]
    casts = {n: cast[n].to(torch.bfloat16) for n in floats if n != "top_k_weights"}
    expected = run_ours({**cast, **casts}, layout)
    assert out.dtype == torch.float32 and torch.equal(out, expected.float())
    dout = fresh_randn(*out.shape)
    out.backward(dout)
    expected.float().backward(dout)
    for name in floats:
        assert under[name].grad.dtype == torch.float32
        assert torch.equal(under[name].grad, cast[name].grad), name


def test_backward_may_run_twice(kernel_path):
    """retain_graph: the backward reads the saved pre-activation and never writes it, so a second
    backward gives the same gradients."""
    case = make_case(6, 24, 16, 3, 2, "gpt_oss")
    ours_in = differentiable(case)
    out = run_ours(ours_in, "gpt_oss")
    dout = fresh_randn(*out.shape)
    wrt = [ours_in[n] for n in NAMES]
    first = torch.autograd.grad(out, wrt, dout, retain_graph=True)
    second = torch.autograd.grad(out, wrt, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


HF_MODULES = {
    "gate_up_halves": lambda h, i, e, k: Qwen3MoeExperts(
        Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=k)
    ),
    "gpt_oss": lambda h, i, e, k: GptOssExperts(
        GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    ),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_hf_experts_module(layout, kernel_path):
    """HF's module (its own eager per-expert forward) with our function on its parameters: same
    output and gradients for hidden, the routing weights and every parameter, in fp32."""
    t, h, i, e, k = 11, 40, 24, 5, 2
    case = make_case(t, h, i, e, k, layout)
    module = HF_MODULES[layout](h, i, e, k)
    params = {"gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
    if layout == "gpt_oss":
        params |= {"gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}
    with torch.no_grad():
        for ours_name, hf_name in params.items():
            getattr(module, hf_name).copy_(case[ours_name])
    x_hf, w_hf = (case[n].clone().requires_grad_() for n in ("hidden", "top_k_weights"))
    expected = module(x_hf, case["top_k_index"], w_hf)

    ours_in = differentiable(case)
    out = run_ours(ours_in, layout)
    assert rel_err(out, expected) <= FP32_REL_TOL
    dout = fresh_randn(*out.shape)
    expected.backward(dout)
    out.backward(dout)
    pairs = [("hidden", x_hf.grad), ("top_k_weights", w_hf.grad)]
    pairs += [(ours, getattr(module, hf).grad) for ours, hf in params.items()]
    for name, hf_grad in pairs:
        err = rel_err(ours_in[name].grad, hf_grad)
        assert err <= FP32_REL_TOL, f"d{name} vs HF: relative error {err:.3g}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unaligned_rows_take_the_reference(layout):
    """H = 37 (rows not whole 16-byte units, which grouped_mm needs): the per-expert reference
    runs, and it too matches the float64 oracle."""
    check_against_oracle(make_case(6, 37, 20, 3, 2, layout), layout, torch.float32)


def test_reference_in_float64_matches_the_oracle():
    """The reference loop (the CPU fallback) in float64 against the dense oracle, both layouts."""
    for layout in LAYOUTS:
        case = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in
                make_case(7, 12, 10, 4, 2, layout).items()}  # fmt: skip
        out = moe_experts_reference(**case, layout=layout)
        assert rel_err(out, oracle(case, layout)) <= 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiles_to_one_op_node(layout, kernel_path):
    """fullgraph torch.compile (aot_eager): no graph break, the forward op recorded once, same
    output and gradients as eager bit for bit."""
    case = make_case(5, 24, 16, 3, 2, layout)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    eager_in, compiled_in = differentiable(case), differentiable(case)
    expected = run_ours(eager_in, layout)
    out = torch.compile(lambda c: run_ours(c, layout), backend=backend, fullgraph=True)(compiled_in)
    dout = fresh_randn(*out.shape)
    expected.backward(dout)
    out.backward(dout)
    torch._dynamo.reset()
    assert torch.equal(out, expected)
    for name in NAMES:
        if case[name] is not None:
            assert torch.equal(compiled_in[name].grad, eager_in[name].grad), name
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and targets.count(torch.ops.ligertune.moe_experts_fwd.default) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(layout):
    """torch.library's check of both ops: schema, fake implementation against the real one,
    autograd registration."""
    case = make_case(5, 16, 8, 3, 2, layout)
    args = [
        differentiable(case)[n]
        for n in ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")
    ]
    fwd_args = (*args, case["gate_up_bias"], case["down_bias"], layout, GPT_OSS_ALPHA, GPT_OSS_LIMIT)
    torch.library.opcheck(torch.ops.ligertune.moe_experts_fwd, fwd_args)
    _, gate_up = torch.ops.ligertune.moe_experts_fwd(*(a.detach() if a is not None and a.is_floating_point() else a for a in fwd_args[:7]), *fwd_args[7:])  # fmt: skip
    bwd_args = (
        fresh_randn(5, 16), gate_up, *(a.detach() for a in args), case["gate_up_bias"], case["down_bias"],
        layout, GPT_OSS_ALPHA, GPT_OSS_LIMIT, [True] * 4 + [case["gate_up_bias"] is not None] * 2,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.ligertune.moe_experts_bwd, bwd_args)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_size_bf16_against_float64_on_cuda(layout, kernel_path):
    """Qwen3-30B-A3B's expert shape (H 2048, E 128, k 8, I 768) at T 8192 in bf16, both layouts,
    against the float64 oracle on the GPU (each expert recomputed in its backward)."""
    case = make_case(8192, 2048, 768, 128, 8, layout, dtype=torch.bfloat16, device="cuda")
    check_against_oracle_low_memory(case, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_idle_experts_and_no_host_sync_on_cuda(layout, kernel_path):
    """On CUDA: experts that receive no token (their weight gradients must come out zero from
    grouped_mm's empty groups) against the float64 oracle; then forward and backward again under
    torch's sync debug mode, which raises on any host synchronisation; then once more, bit for
    bit the same."""
    case = make_case(512, 256, 128, 8, 2, layout, dtype=torch.bfloat16, device="cuda", experts=[1, 3, 6])
    check_against_oracle(case, layout, torch.bfloat16)
    ours_in = differentiable(case)
    wrt = [ours_in[n] for n in NAMES if ours_in[n] is not None]
    dout = fresh_randn(512, 256, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run_ours(ours_in, layout)
        grads = torch.autograd.grad(out, wrt, dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # No atomics anywhere: a second run is bit-identical.
    again = run_ours(ours_in, layout)
    assert torch.equal(out, again)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(again, wrt, dout), strict=True))


def check_against_oracle_low_memory(case, layout):
    ours_in, ref_in = differentiable(case), differentiable(case)
    out = run_ours(ours_in, layout)
    ref = oracle(ref_in, layout, low_memory=True)
    with torch.no_grad():
        _, bound = oracle(
            {k: (v.detach() if v is not None else v) for k, v in case.items()}, layout, True, True
        )
    assert_close(out, ref, torch.bfloat16, "out", extra_tol=bound)
    dout = fresh_randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    wrt = [n for n in NAMES if ours_in[n] is not None]
    grads = torch.autograd.grad(out, [ours_in[n] for n in wrt], dout)
    refs = torch.autograd.grad(ref, [ref_in[n] for n in wrt], dout.double())
    for name, g, r in zip(wrt, grads, refs, strict=True):
        err = rel_err(g, r)
        assert err <= BF16_GRAD_ROUNDINGS * BF16_U, f"d{name}: relative error {err:.3g}"


def test_checks_its_arguments():
    case = make_case(4, 16, 8, 3, 2, "gate_up_halves")
    with pytest.raises(ValueError, match="layout"):
        run_ours(case, "interleaved")
    with pytest.raises(ValueError, match="down_proj: expected shape"):
        moe_experts(case["hidden"], case["top_k_index"], case["top_k_weights"], case["gate_up_proj"],
                    case["down_proj"].transpose(1, 2))  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        moe_experts(case["hidden"], case["top_k_index"].int(), case["top_k_weights"], case["gate_up_proj"],
                    case["down_proj"])  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        moe_experts(case["hidden"].double(), case["top_k_index"], case["top_k_weights"], case["gate_up_proj"],
                    case["down_proj"])  # fmt: skip
