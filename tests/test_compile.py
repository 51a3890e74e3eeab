"""The kernels under torch.compile, on CPU: single graph nodes, fake implementations, model wiring.

Two paths are checked. ``triton``: Triton's CPU interpreter (tests/conftest.py sets it), where
every kernel is a ``ligertune::`` custom op that dynamo records as one node. ``reference``: the
interpreter off (``_utils.INTERPRET`` patched to False), where CPU tensors take each kernel's
plain-PyTorch reference, which dynamo traces like any other torch code (how the quickstart
trains on CPU with ``training.compile: true``).

Backend ``aot_eager`` (dynamo + AOTAutograd, no code generation) keeps this fast on 2 cores;
it is where graph breaks, guards and fake implementations are exercised. The default inductor
backend runs once per family on the GPU (tests/test_compile_gpu.py) and here once for one family.
``fullgraph=True`` turns any graph break into an error. With aot_eager, compiled results must equal
eager ones bit for bit in fp32: the kernels run the same launches in both, and AOTAutograd does
not reorder the plain-torch parts.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch._dynamo
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

import ligertune.kernels._utils as kernel_utils
from ligertune.catalog.families import FAMILIES as FAMILY_TABLE
from ligertune.kernels import cross_entropy as ce_kernel
from ligertune.kernels import fused_linear_cross_entropy as flce_kernel
from ligertune.kernels import layer_norm as ln_kernel
from ligertune.kernels import rms_norm as rms_kernel
from ligertune.kernels import rope as rope_kernel
from ligertune.kernels import swiglu as gated_kernel
from ligertune.models.build import decoder_layers
from ligertune.patching import patch_model
from ligertune.patching.rope import rope_forward_for
from ligertune.tools.check import FP32_TOL
from ligertune.training.transforms import TRANSFORMS
from tests.kernels.helpers import rel_err
from tests.test_patching import FAMILIES, grads, one_torch_thread, random_batch, tiny_model  # noqa: F401

# torch.compile of every family and kernel: minutes on 2 cores, outside the quick subset.
pytestmark = pytest.mark.slow

PATHS = ["triton", "reference"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Which implementation CPU tensors take; dynamo guards on the flag, so no stale graph is reused."""
    if request.param == "reference":
        monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


class GraphRecorder:
    """An aot_eager backend that keeps every FX graph dynamo hands it."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def targets(self) -> list:
        """What each call node calls, once per node."""
        return [node.target for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"]


def leaves(tensors: list[torch.Tensor], differentiable: int) -> list[torch.Tensor]:
    """Copies of `tensors`, the first `differentiable` of them leaves requiring grad."""
    return [t.detach().clone().requires_grad_(i < differentiable) for i, t in enumerate(tensors)]


def cases():
    """(name, function, inputs, the custom op its Triton path must record). Inputs are fresh
    random tensors; each function returns one tensor to differentiate."""
    x, res = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    w, b = 1.0 + 0.2 * torch.randn(64), 0.2 * torch.randn(64)
    # HF's q layout: [B, S, H, D] in memory, viewed as [B, H, S, D]; partial rotary (24 of 32 dims).
    q, k = torch.randn(2, 5, 4, 32).transpose(1, 2), torch.randn(2, 5, 2, 32).transpose(1, 2)
    cos, sin = torch.randn(1, 5, 24), torch.randn(1, 5, 24)
    gate_up = torch.randn(3, 5, 2 * 48)  # Phi3's fused projection, split by the function
    ops = torch.ops.ligertune

    def rope_sum(q, k, cos, sin):
        q_embed, k_embed = rope_kernel.apply_rotary_pos_emb(q, k, cos, sin, in_place=True)
        return q_embed.sum(1) + k_embed.sum(1)

    def add_norm(x, res, w):
        normed, new_res = rms_kernel.add_rms_norm(x, res, w, 1e-6, 1.0, "gemma")
        return normed * new_res

    # The losses: every option, a tensor count (an op input, never read by the host), the
    # reported values stacked after the loss (they take no gradient), ignored targets.
    target = torch.tensor([3, -100, 7, 39, 0, 12, -100])
    class_weight, count = 0.5 + torch.rand(40), torch.tensor(9)
    options = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0, return_z_loss=True)
    budget = 3 * 40 * 4  # three fp32 rows of logits per chunk: three chunks, dW summed over them
    logits, hidden, lm_head, lm_bias = (
        torch.randn(7, 40),
        torch.randn(7, 16),
        torch.randn(40, 16),
        torch.randn(40),
    )

    def ce(logits):
        out = ce_kernel.cross_entropy(
            3.0 * logits,
            target,
            weight=class_weight,
            num_items_in_batch=count,
            return_token_accuracy=True,
            inplace_backward=True,
            **options,
        )
        return torch.stack(list(out))

    def ce_none(logits):
        out = ce_kernel.cross_entropy(
            3.0 * logits, target, reduction="none", inplace_backward=True, **options
        )
        return torch.cat([out.loss, out.z_loss])

    def flce(hidden, weight, bias):
        out = flce_kernel.fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            class_weight=class_weight,
            num_items_in_batch=count,
            return_token_accuracy=True,
            memory_budget_bytes=budget,
            **options,
        )
        return torch.stack(list(out))

    def flce_none(hidden, weight):
        # The deferred path: losses in the forward, the sweep again in backward.
        out = flce_kernel.fused_linear_cross_entropy(
            hidden, weight, target, reduction="none", return_token_accuracy=True, memory_budget_bytes=budget
        )
        return torch.cat([out.loss, out.token_accuracy])

    return [
        ("rms_norm", lambda x, w: rms_kernel.rms_norm(x, w, 1e-6, in_place=True), [x, w], ops.rms_norm_fwd),
        ("add_rms_norm", add_norm, [x, res, w], ops.add_rms_norm_fwd),
        ("layer_norm", lambda x, w, b: ln_kernel.layer_norm(x, w, b), [x, w, b], ops.layer_norm_fwd),
        ("rope", rope_sum, [q, k, cos, sin], ops.rope_fwd),
        (
            "swiglu",
            lambda gu: gated_kernel.swiglu(*(3.0 * gu).chunk(2, -1), True),
            [gate_up],
            ops.gated_act_fwd,
        ),
        (
            "geglu",
            lambda gu: gated_kernel.geglu(*(3.0 * gu).chunk(2, -1), True),
            [gate_up],
            ops.gated_act_fwd,
        ),
        ("cross_entropy", ce, [logits], ops.cross_entropy_fwd),
        ("cross_entropy_none", ce_none, [logits], ops.cross_entropy_fwd),
        ("fused_linear_cross_entropy", flce, [hidden, lm_head, lm_bias], ops.fused_linear_cross_entropy_fwd),
        ("fused_linear_cross_entropy_none", flce_none, [hidden, lm_head], ops.fused_linear_cross_entropy_fwd),
    ]


@pytest.mark.parametrize("case", range(len(cases())), ids=[c[0] for c in cases()])
def test_functional_api_compiles_to_one_graph(case, path):
    """fullgraph compile of each functional API (with its in-place options on, which compile must
    drop): same forward and gradients as eager, and on the Triton path the kernel is one op node
    and no op that overwrites its input is in the graph."""
    _, fn, inputs, op = cases()[case]
    differentiable = 2 if fn.__name__ == "rope_sum" else len(inputs)  # cos/sin get no gradient
    eager_in, compiled_in = leaves(inputs, differentiable), leaves(inputs, differentiable)
    recorder = GraphRecorder()
    compiled = torch.compile(fn, backend=recorder, fullgraph=True)

    expected, out = fn(*eager_in), compiled(*compiled_in)
    dy = torch.randn_like(expected)
    expected.backward(dy.clone())
    out.backward(dy.clone())

    assert torch.equal(out, expected)
    for a, b in zip(compiled_in, eager_in, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            assert torch.equal(a.grad, b.grad)
    assert len(recorder.graphs) == 1
    targets = recorder.targets()
    recorded = targets.count(op.default)
    assert recorded == (path == "triton"), f"{op} in the graph {recorded} times on the {path} path"
    mutating = [t for t in targets if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable]
    assert not [t for t in mutating if t.namespace == "ligertune"], mutating


def _opcheck_cases():
    """(op, args) for every custom op, small random inputs (the interpreter runs the real ones)."""
    ops = torch.ops.ligertune
    x, w, b = torch.randn(3, 4, 32), 1.0 + torch.randn(32), torch.randn(32)
    rstd, mean = torch.rand(12) + 0.5, torch.randn(12)
    q, k = torch.randn(2, 6, 3, 16).transpose(1, 2), torch.randn(2, 2, 6, 16)
    cos, sin = torch.randn(1, 6, 12), torch.randn(2, 6, 12)
    gate, up = torch.randn(2, 3, 40).chunk(2, -1)
    logits, hidden, lm_head, lm_bias = (
        torch.randn(5, 24),
        torch.randn(5, 8),
        torch.randn(24, 8),
        torch.randn(24),
    )
    target, class_weight, count = torch.tensor([3, -100, 23, 0, 9]), 0.5 + torch.rand(24), torch.tensor(4.0)
    ce_options = (-100, 0.1, 1e-3, 5.0)  # ignore_index, label_smoothing, lse_square_scale, softcap
    plain_ce = (-100, 0.0, 0.0, None)
    budget = 2 * 24 * 4  # two rows per chunk: three chunks
    # The loss ops run with scale_in_place=False, as under compile: in eager mode their backward
    # scales a forward output in place, which the AOTAutograd check cannot express (the kernel
    # tests run that backward; `scale_rows_` is checked here on its own).
    grad = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    return {
        "rms_norm_fwd": (ops.rms_norm_fwd, (*grad(x, w), 1e-6, 0.0, "llama", False)),
        "rms_norm_fwd_gemma": (ops.rms_norm_fwd, (*grad(x, w), 1e-6, 1.0, "gemma", True)),
        "rms_norm_fwd_no_weight": (ops.rms_norm_fwd, (*grad(x), None, 1e-6, 0.0, "llama", False)),
        "add_rms_norm_fwd": (ops.add_rms_norm_fwd, (*grad(x, x.flip(0), w), 1e-6, 0.0, "llama")),
        "layer_norm_fwd": (ops.layer_norm_fwd, (*grad(x, w, b), 1e-5)),
        "row_norm_bwd": (ops.row_norm_bwd, (x, x.flip(1), w, mean, rstd, x.flip(0), 0.0, True, True, True)),
        "row_norm_bwd_no_dw": (
            ops.row_norm_bwd,
            (x, x.flip(1), w, None, rstd, None, 0.0, False, False, False),
        ),
        "rms_norm_bwd_": (ops.rms_norm_bwd_, (x.clone(), x.flip(1), w, rstd, 0.0, True, True)),
        "rope_fwd": (ops.rope_fwd, (*grad(q, k), cos, sin, 1, False)),
        "rope_bwd": (ops.rope_bwd, (q, k, cos, sin, 1)),
        "rope_bwd_": (ops.rope_bwd_, (q.clone(), k.clone(), cos, sin, 1)),
        "gated_act_fwd": (ops.gated_act_fwd, (*grad(gate, up), "silu", False)),
        "gated_act_bwd": (ops.gated_act_bwd, (gate.contiguous(), gate, up, "gelu_tanh")),
        "gated_act_bwd_": (ops.gated_act_bwd_, (gate.contiguous(), gate.clone(), up.clone(), "silu")),
        "cross_entropy_fwd": (
            ops.cross_entropy_fwd,
            (*grad(logits), target, class_weight, count, *ce_options, "mean", True, True, True, False),
        ),
        "cross_entropy_fwd_none": (
            ops.cross_entropy_fwd,
            (*grad(logits), target, None, None, *plain_ce, "none", False, True, True, False),
        ),
        "cross_entropy_fwd_": (
            ops.cross_entropy_fwd_,
            (logits.clone(), target, class_weight, None, *ce_options, "sum", True, False),
        ),
        "scale_rows_": (ops.scale_rows_, (logits.clone(), torch.randn(5))),
        "fused_linear_cross_entropy_fwd": (
            ops.fused_linear_cross_entropy_fwd,
            (
                *grad(hidden, lm_head),
                target,
                *grad(lm_bias),
                class_weight,
                count,
                *ce_options,
                "mean",
                True,
                True,
                *(True, True, True),  # want dh, dW, db
                torch.float32,
                budget,
                False,
            ),
        ),
        "fused_linear_cross_entropy_fwd_none": (
            ops.fused_linear_cross_entropy_fwd,
            (
                *grad(hidden, lm_head),
                target,
                None,
                None,
                None,
                *plain_ce,
                "none",
                False,
                False,
                *(True, True, False),
                torch.float32,
                budget,
                False,
            ),
        ),
        "fused_linear_cross_entropy_bwd": (
            ops.fused_linear_cross_entropy_bwd,
            (
                torch.randn(5),
                hidden,
                lm_head,
                target,
                lm_bias,
                None,
                *ce_options,
                True,
                False,
                True,
                torch.float32,
                budget,
            ),
        ),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    """torch.library's own check of each op: schema (declared mutations, no aliased outputs),
    fake implementation against the real one (shapes, dtypes, strides), autograd registration."""
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def test_compiled_loss_backward_may_run_twice():
    """Compiled, the losses' backward multiplies the stored gradient into a fresh tensor (eager
    mode scales it in place and refuses a second backward: tests/kernels/test_cross_entropy.py),
    so a retained graph's second backward adds the same gradient again."""
    torch._dynamo.reset()
    x = torch.randn(4, 30, requires_grad=True)
    target = torch.tensor([1, 5, -100, 29])
    loss = torch.compile(
        lambda x: ce_kernel.cross_entropy(2.0 * x, target), backend="aot_eager", fullgraph=True
    )(x)
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward()
    assert torch.equal(x.grad, 2 * once)


def test_rope_scope_is_its_own_module():
    """torch.compile looks an inlined function's globals up by their ``__name__``: the patched
    attention's must name a module whose namespace they are, with our kernel in it."""
    forward = rope_forward_for(LlamaAttention.forward, FAMILY_TABLE["llama"])
    scope = forward.__globals__
    assert vars(sys.modules[scope["__name__"]]) is scope
    assert scope["apply_rotary_pos_emb"] is rope_kernel.apply_rotary_pos_emb
    assert LlamaAttention.forward.__globals__["apply_rotary_pos_emb"] is not rope_kernel.apply_rotary_pos_emb


def _compiled_layers(monkeypatch, backend: str) -> None:
    """Make the ``compile`` transform (``layer.compile()`` per decoder layer) compile with
    `backend` and fullgraph=True, so the test runs the real transform and a break fails it."""
    original = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self: original(self, backend=backend, fullgraph=True))


def _compile_transform(model: nn.Module) -> nn.Module:
    transform = next(t for t in TRANSFORMS if t.name == "compile")
    return transform.apply(model, None)[0]  # it reads nothing from the recipe


def check_compiled_family(model_type: str, monkeypatch, backend: str, tol: float = 0.0) -> None:
    """Kernels all, then the compile transform: two steps' loss and every gradient within `tol`
    (relative) of the uncompiled patched model's (the second step reuses the compiled graphs)."""
    _compiled_layers(monkeypatch, backend)
    eager = tiny_model(model_type)
    patch_model(eager, "all")
    compiled = _compile_transform(copy.deepcopy(eager))
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled))
    for _ in range(2):
        batch = random_batch(num_items=True)
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            model.train()
        expected, out = eager(**batch).loss, compiled(**batch).loss
        expected.backward()
        out.backward()
        assert rel_err(out, expected) <= tol, f"loss {out.item()} vs eager {expected.item()}"
        eager_grads, compiled_grads = grads(eager), grads(compiled)
        assert compiled_grads.keys() == eager_grads.keys()
        for name, g in eager_grads.items():
            err = rel_err(compiled_grads[name], g)
            assert err <= tol, f"grad {name}: relative error {err:.3g}"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_compiles_per_layer(model_type, path, monkeypatch):
    check_compiled_family(model_type, monkeypatch, "aot_eager")


def test_family_compiles_with_inductor(monkeypatch, path):
    """The default backend once (C++ code generation on CPU is slow): Qwen3 has every decoder-layer
    kernel but LayerNorm, q_norm/k_norm over heads included. Inductor fuses the plain-torch parts
    (and the reference path whole), so fp32 results agree to rounding, not bit for bit."""
    check_compiled_family("qwen3", monkeypatch, "inductor", FP32_TOL)
