"""``training.compile: true`` with ``kernels: all`` on the GPU, every family (issue #15).

The model of tests/test_patching_gpu.py (hidden 1024, 4 layers, vocab 32000, batch 4 × 512),
patched with every kernel, then the ``compile`` transform itself (``layer.compile()`` per decoder
layer, default inductor backend). Its losses over a few AdamW steps must match the same patched
model run eagerly, with no graph break and our kernels as custom ops in the graphs.

Tolerance: fp32 with TF32 off, so only inductor's fusion of the plain-torch parts (attention
softmax, residual adds, embedding scale) changes the rounding: 1e-4 relative per step over
STEPS steps (the CPU curve test's bound; Adam's normalised updates carry a 1e-6 difference
forward without growing it much in three steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx

from ligertune.patching import patch_model
from ligertune.training.transforms import TRANSFORMS
from tests.test_patching_gpu import FAMILIES, mid_model, random_batch

pytestmark = pytest.mark.gpu

STEPS, TOL = 3, 1e-4
# The custom ops a patched decoder layer must call (no family here has a LayerNorm).
LAYER_OPS = {"rms_norm_fwd", "rope_fwd", "gated_act_fwd"}


def train(model: torch.nn.Module, batches: list[dict]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_compiled_kernels_match_eager(model_type, monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    # The transform calls layer.compile(); keep its default backend (inductor) and record the
    # graphs dynamo hands it, to see our custom ops in them.
    graphs: list[torch.fx.GraphModule] = []
    original_compile = torch.nn.Module.compile

    def inductor_recording(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self: original_compile(self, backend=inductor_recording)
    )

    torch.manual_seed(0)
    eager = mid_model(model_type, torch.float32)
    report = patch_model(eager, "all")
    assert report.patched["rope"] and report.patched["rms_norm"], str(report)
    compiled = copy.deepcopy(eager)
    transform = next(t for t in TRANSFORMS if t.name == "compile")
    compiled = transform.apply(compiled, None)[0]  # it reads nothing from the recipe

    batches = [random_batch() for _ in range(STEPS)]
    eager_losses, compiled_losses = train(eager, batches), train(compiled, batches)

    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert graphs, "nothing was compiled"
    called = {
        node.target._opname
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "ligertune"
    }
    assert LAYER_OPS <= called, f"ligertune ops in the compiled graphs: {sorted(called)}"
    for step, (a, b) in enumerate(zip(compiled_losses, eager_losses, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: compiled {a} vs eager {b}"


# At H 1024 and a 1024-row budget, 2048 rows take one chunk (its buffer is no larger than the fp32
# dW accumulator it saves) and 4096 rows four (kernels/fused_linear_cross_entropy.py, sweep_rows).
@pytest.mark.parametrize("n_rows", [2048, 4096])
def test_loss_ops_compile_with_inductor(n_rows):
    """The cross entropy and the fused linear cross entropy as custom ops under the default
    inductor backend with ``fullgraph=True`` (a graph break is an error), in bf16 at an lm_head
    size: loss and gradients equal to the same functions run eagerly. Only the backward's
    scaling differs (in place in eager, an inductor multiply under compile), and the upstream
    gradient is 1, so both leave the stored gradients as computed: bit-identical."""
    from ligertune.kernels.cross_entropy import cross_entropy
    from ligertune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
    from tests.kernels.helpers import fresh_randn

    torch._dynamo.reset()
    n_hidden, n_cols = 1024, 32000
    budget = 1024 * n_cols * 2
    hidden = fresh_randn(n_rows, n_hidden, dtype=torch.bfloat16, device="cuda")
    weight = fresh_randn(n_cols, n_hidden, dtype=torch.bfloat16, device="cuda", scale=0.02)
    target = torch.randint(0, n_cols, (n_rows,), device="cuda")
    target[::7] = -100

    def flce(h, w):
        return fused_linear_cross_entropy(h, w, target, label_smoothing=0.1, memory_budget_bytes=budget)

    def ce(h, w):
        return cross_entropy(h @ w.t(), target, lse_square_scale=1e-4)

    for fn in (flce, ce):
        results = []
        for run in (fn, torch.compile(fn, fullgraph=True)):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss = run(h, w)
            loss.backward()
            results.append((loss.detach(), h.grad, w.grad))
        for eager_t, compiled_t in zip(*results, strict=True):
            assert torch.equal(eager_t, compiled_t), fn.__name__
