"""Mixture-of-experts families: patching and the router's balancing loss on tiny random models.

The reference is the same model unpatched (Hugging Face's modules and its own
``load_balancing_loss_func`` in ``*MoeForCausalLM.forward``), fp32, Triton kernels under the CPU
interpreter. The balancing loss is on (``output_router_logits``) with a coefficient of 0.5, so
that dropping it or scaling it wrongly moves the loss far beyond the 1e-5 tolerance.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from dataclasses import replace

import pytest
import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config
from typer.testing import CliRunner

from ligertune.catalog.families import FAMILIES as FAMILY_TABLE
from ligertune.catalog.families import Experts
from ligertune.catalog.kernels import KERNEL_NAMES
from ligertune.cli import app
from ligertune.config import load_recipe
from ligertune.config.rules import model_problems
from ligertune.errors import RecipeError
from ligertune.models.build import build_model
from ligertune.models.config import build_config
from ligertune.models.shape import model_shape, recipe_shape
from ligertune.objectives.causal_lm import CausalLM, Router, chosen_experts_of, router_of
from ligertune.patching import patch_model
from ligertune.patching.mlp import activation_of
from ligertune.plan import choose
from ligertune.plan.activations import layer_saved
from ligertune.plan.estimate import estimate
from ligertune.plan.setting import HEADROOM_FRACTION, Setting
from ligertune.tools.check import FP32_TOL, parity_check
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT
from tests.kernels.helpers import rel_err
from tests.test_patching import (  # noqa: F401 - one_torch_thread: the module's autouse fixture
    CURVE_TOL,
    LAYERS,
    STEPS,
    TINY,
    VOCAB,
    grads,
    one_torch_thread,
    random_batch,
)
from tests.test_patching import train as train_steps
from tests.test_plan import OURS
from tests.test_plan import saved_bytes as plan_saved_bytes

COEF = 0.5
MOE = dict(output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=2)
# Per family: extra config, RMSNorms per layer, SwiGLU modules in the model (dense layers and
# Qwen2-MoE's shared experts); its sparse layers each have one Experts module (`moe_experts`).
FAMILIES = {
    # Layer 1 dense (mlp_only_layers): Qwen3MoeMLP gets the SwiGLU kernel; + q_norm, k_norm.
    "qwen3_moe": (
        dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
        4,
        1,
    ),
    # A shared expert (SwiGLU) beside the routed ones in each layer; no renormalisation.
    "qwen2_moe": (
        dict(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=False
        ),
        2,
        LAYERS,
    ),
    "mixtral": (dict(num_local_experts=4, intermediate_size=32), 2, 0),
    # Layer 0 dense (first_k_dense_replace): DeepseekV3MLP, as wide as a token's routed + shared
    # experts; layer 1 routes among 2 groups of 4 experts (one group kept) beside a shared expert
    # (SwiGLU). Multi-head latent attention with q through a latent (q_a_layernorm, kv_a_layernorm:
    # + 2 norms), heads of 8 + 8 (interleaved RoPE on the second 8) and v heads of 16.
    "deepseek_v3": (
        dict(
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=32,
            n_shared_experts=1,
            intermediate_size=96,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,  # the rotary part's, as the config computes it (TINY's 16 would win)
            num_key_value_heads=4,
        ),
        4,
        2,
    ),
    # Half-width cos/sin RoPE, attention sinks, top-k-then-softmax routing, clamped SwiGLU experts.
    "gpt_oss": (
        dict(num_local_experts=4, intermediate_size=32, layer_types=["sliding_attention", "full_attention"]),
        2,
        0,
    ),
}

# Every kernel of `kernels: all` and the experts kernel, which is not part of it yet (its catalog
# entry: off until it has run on a GPU).
WITH_EXPERTS = {"moe_experts": True}


def tiny_moe(model_type: str, **changes) -> nn.Module:
    extra = FAMILIES[model_type][0]
    config = AutoConfig.for_model(model_type, **{**TINY, **MOE, **extra, **changes})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "sinks" not in name:  # norm weights and biases: away from ones/zeros
                p.add_(0.2 * torch.randn_like(p))
    return model


def route(
    experts: Experts, config, logits: torch.Tensor, router: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert indices) of each token as the family record says it routes, in float64
    (`Experts.routing`; DeepSeek-V3's score bias is the router's buffer)."""
    k = getattr(config, experts.top_k_attr)
    logits = logits.double()
    if experts.routing == "topk_softmax":
        top, chosen = logits.topk(k, dim=-1)
        return top.softmax(-1), chosen
    if experts.routing == "sigmoid_group_topk":
        scores = logits.sigmoid()
        biased = scores + router.e_score_correction_bias.double()
        groups = biased.unflatten(-1, (config.n_group, -1))  # [T, groups, experts per group]
        kept = groups.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(-1, kept, True)
        chosen = groups.masked_fill(~keep[..., None], float("-inf")).flatten(-2).topk(k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        scale = config.routed_scaling_factor
    else:
        weights, chosen = logits.softmax(-1).topk(k, dim=-1)
        scale = 1.0
    renormalise = experts.renormalise
    if isinstance(renormalise, str):
        renormalise = getattr(config, renormalise)
    return (weights / weights.sum(-1, keepdim=True) if renormalise else weights) * scale, chosen


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_experts_record_describes_the_hf_model(model_type):
    """The family table's experts record against the model transformers builds: its classes and
    attributes, and its routing semantics against the router's own output on random rows."""
    model = tiny_moe(model_type)
    family = FAMILY_TABLE[model_type]
    experts = family.experts
    blocks = [m for m in model.modules() if isinstance(m, family.resolve(experts.sparse_block))]
    assert blocks
    rows = torch.randn(16, model.config.hidden_size)
    for block in blocks:
        router = getattr(block, experts.router_attr)
        if experts.routing == "sigmoid_group_topk":  # a trained bias: the choice must use it
            router.e_score_correction_bias.normal_(0, 0.5)
        assert isinstance(router, family.resolve(experts.router))
        assert isinstance(block.experts, family.resolve(experts.experts))
        assert block.experts.gate_up_proj.shape[0] == getattr(model.config, experts.num_experts_attr)
        assert hasattr(block.experts, "gate_up_proj_bias") == experts.experts_biased
        if experts.expert_activation == "silu":
            assert activation_of(block.experts.act_fn) == "silu"
        else:  # GPT-OSS's clamped SwiGLU
            assert (block.experts.alpha, block.experts.limit) == (1.702, 7.0)
        if experts.shared_expert_attr:
            shared = getattr(block, experts.shared_expert_attr)
            assert isinstance(shared, family.resolve(family.mlp))
            assert shared.down_proj.in_features == experts.shared_width(model.config)
        if experts.shared_expert_gate_attr:
            assert isinstance(getattr(block, experts.shared_expert_gate_attr), nn.Linear)
        with torch.no_grad():
            logits, weights, chosen = router(rows)
            ours_weights, ours_chosen = route(experts, model.config, logits, router)
        # sorted=False in DeepSeek's top-k: the same set of experts, in whatever order.
        order, ours_order = chosen.sort(-1).indices, ours_chosen.sort(-1).indices
        assert torch.equal(chosen.gather(-1, order), ours_chosen.gather(-1, ours_order))
        torch.testing.assert_close(  # HF's fp32 against float64
            weights.gather(-1, order).double(), ours_weights.gather(-1, ours_order), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_moe_family_parity(model_type):
    """Every kernel that applies is patched, the routed experts too; the loss (token loss +
    balancing loss), every gradient and the eval logits match HF's unpatched model."""
    _, norms, swiglu = FAMILIES[model_type]
    model = tiny_moe(model_type)
    experts_class = FAMILY_TABLE[model_type].experts.experts
    sparse = sum(type(m).__name__ == experts_class for m in model.modules())
    result = parity_check(model, random_batch(), WITH_EXPERTS)
    expected = dict.fromkeys(KERNEL_NAMES, 0)
    expected.update(
        rms_norm=LAYERS * norms + 1,
        rope=LAYERS,
        swiglu=swiglu,
        moe_experts=sparse,
        fused_linear_cross_entropy=1,
    )
    assert result.report.patched == expected, str(result.report)
    modules = f"{sparse} {experts_class} module{'s' if sparse > 1 else ''}"
    assert f"experts: ours (moe_experts), {modules}" in result.report.notes, str(result.report)
    assert result.ok, str(result)
    router = [
        c
        for c in result.checks
        if c.name.startswith("grad ") and (".gate.weight" in c.name or ".router." in c.name)
    ]
    assert router, "the routers must be trained and checked"


@pytest.mark.parametrize("where", ["config", "one_layer"])
def test_experts_the_kernel_cannot_compute_stay_hfs(where):
    """Mixtral with GELU experts (``hidden_act`` in the config: every layer; or one layer's act_fn
    swapped): those Experts modules are left to transformers with the reason in the report, the
    note says which implementation runs, and the model still matches HF's in training."""
    if where == "config":
        model = tiny_moe("mixtral", hidden_act="gelu_pytorch_tanh")
    else:
        model = tiny_moe("mixtral")
        model.model.layers[0].mlp.experts.act_fn = nn.GELU(approximate="tanh")
    result = parity_check(model, random_batch(), WITH_EXPERTS)
    assert result.ok, str(result)
    report = result.report
    reason = "the kernel computes SiLU"
    if where == "config":
        assert report.patched["moe_experts"] == 0
        assert report.skipped["moe_experts"].endswith(f"hidden_act 'gelu_pytorch_tanh' (GELUTanh): {reason}")
        assert "experts: transformers' grouped_mm (MixtralExperts)" in report.notes
    else:
        assert report.patched["moe_experts"] == 1
        assert (
            report.skipped["moe_experts"] == f"model.layers.0.mlp.experts: hidden_act 'silu' (GELU): {reason}"
        )
        expected = "experts: ours (moe_experts) in 1 of 2 MixtralExperts modules, transformers' grouped_mm in the rest"
        assert expected in report.notes


def test_dense_and_unknown_families_have_no_experts_to_patch():
    for model_type in ("llama", "olmo"):  # a dense family of the table; one the table does not know
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY))
        report = patch_model(model, WITH_EXPERTS)
        assert report.skipped["moe_experts"].startswith("not a known MoE family"), str(report)
        assert not any(n.startswith("experts:") for n in report.notes)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])  # both routings; ~13 s each
def test_moe_family_training_curve(model_type):
    """20 AdamW steps with the balancing loss on, normalised by num_items_in_batch on every other
    step; one layer (Qwen3-MoE: sparse) and one sequence per batch, as the dense families' curve."""
    one_layer = {"num_hidden_layers": 1}
    if "layer_types" in FAMILIES[model_type][0]:
        one_layer["layer_types"] = ["full_attention"]
    if model_type == "qwen3_moe":
        one_layer["mlp_only_layers"] = []
    torch.manual_seed(0)  # routing near-ties: see test_moe_family_parity_bf16
    hf = tiny_moe(model_type, **one_layer)
    ours = copy.deepcopy(hf)
    patch_model(ours, WITH_EXPERTS)
    distinct = [random_batch(num_items=i % 2 == 1, batch=1) for i in range(4)]
    batches = [distinct[i % 4] for i in range(STEPS)]
    hf_losses, our_losses = train_steps(hf, batches), train_steps(ours, batches)
    for step, (a, b) in enumerate(zip(our_losses, hf_losses, strict=True)):
        assert abs(a - b) <= CURVE_TOL * abs(b), f"step {step}: patched loss {a} vs HF {b}"
    assert hf_losses[-1] < 0.5 * hf_losses[0], "the curve must move for the comparison to mean something"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])  # GPT-OSS: its norm's fp32 weight product
def test_moe_family_parity_bf16(model_type):
    """Seeded: top-k routing is discontinuous, and in 16-bit a near-tie between two experts'
    scores can go one way in the patched run and the other in the fp32 one (measured on tiny
    GPT-OSS: 1 to 2 batches in 24), which no tolerance on rounding covers."""
    torch.manual_seed(0)
    result = parity_check(tiny_moe(model_type), random_batch(), WITH_EXPERTS, dtype=torch.bfloat16)
    assert result.ok, str(result)


def test_fused_forward_adds_hfs_balancing_term_per_forward():
    """Normalised by a count N larger than the micro-batch's own label tokens (accumulation), the
    fused forward's loss is still HF's: token sum / N + coef · aux, loss and every gradient."""
    hf = tiny_moe("qwen3_moe")
    ours = copy.deepcopy(hf)
    patch_model(ours, WITH_EXPERTS)
    hf.train()
    ours.train()
    batch = random_batch(num_items=True)
    ref, out = hf(**batch), ours(**batch)
    assert out.logits is None and out.aux_loss is not None
    assert rel_err(out.aux_loss, ref.aux_loss) <= FP32_TOL
    assert rel_err(out.loss, ref.loss) <= FP32_TOL
    ref.loss.backward()
    out.loss.backward()
    for name, g in grads(hf).items():
        assert rel_err(grads(ours)[name], g) <= FP32_TOL, name


@pytest.mark.parametrize("kernels", [True, False], ids=["fused", "hf"])
def test_sft_weights_the_balancing_loss_by_token_share(kernels):
    """Two micro-batches of one window: the SFT objective's loss is Σ token losses / N +
    coef · aux · n / N per micro-batch, kernels on or off. The reference is independent of the
    code under test: a float64 cross entropy over HF's own logits plus HF's own aux_loss."""
    hf = tiny_moe("qwen3_moe")
    model = copy.deepcopy(hf)
    if kernels:
        patch_model(model, WITH_EXPERTS)
    objective = CausalLM(Router(top_k=2, aux_loss_coef=COEF))
    batches = [random_batch(), random_batch(batch=1)]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    n = torch.tensor(sum(counts))
    hf.train()
    model.train()
    for batch, count in zip(batches, counts, strict=True):
        ref = hf(input_ids=batch["input_ids"])  # logits and the balancing loss, no loss of HF's
        logits = ref.logits[:, :-1].reshape(-1, VOCAB).double()
        tokens = nn.functional.cross_entropy(logits, batch["labels"][:, 1:].reshape(-1), reduction="sum")
        expected = tokens / n + COEF * ref.aux_loss.double() * count / n
        expected.backward()
        out = objective(model, batch, n)
        assert rel_err(out.loss, expected) <= FP32_TOL
        out.loss.backward()
        assert set(out.metrics) == {"aux_loss", "expert_load_max", "expert_load_mean"}
    for name, g in grads(hf).items():
        assert rel_err(grads(model)[name], g) <= FP32_TOL, name
    model.eval()  # validation: the token loss alone
    with torch.no_grad():
        batch = batches[0]
        ref = hf.eval()(input_ids=batch["input_ids"]).logits[:, :-1].reshape(-1, VOCAB).double()
        tokens = nn.functional.cross_entropy(ref, batch["labels"][:, 1:].reshape(-1), reduction="sum")
        assert rel_err(objective(model, batch, torch.tensor(1)).loss, tokens) <= FP32_TOL


def training_forwards(model_type: str, **changes):
    """A tiny model of the family, its patched copy, a batch and both models' training outputs."""
    hf = tiny_moe(model_type, **changes)
    ours = copy.deepcopy(hf)
    patch_model(ours, WITH_EXPERTS)
    batch = random_batch()
    hf.train()
    ours.train()
    return hf, ours, batch, hf(**batch), ours(**batch)


def test_router_outputs_off_means_no_balancing_loss():
    hf, ours, batch, ref, out = training_forwards("mixtral", output_router_logits=False)
    assert ref.aux_loss is None and out.aux_loss is None
    assert rel_err(out.loss, ref.loss) <= FP32_TOL
    on = ours(**batch, output_router_logits=True)  # the forward's argument wins over the config
    assert (
        on.aux_loss is not None and rel_err(on.loss, hf(**batch, output_router_logits=True).loss) <= FP32_TOL
    )


def test_deepseek_has_no_balancing_loss_to_add():
    """DeepSeek-V3 balances its experts without a loss (its router's score bias): transformers'
    forward returns none, even with ``output_router_logits`` in the config (tiny_moe sets it), and
    neither do ours nor the SFT objective (no router, no aux_loss metric); ``model.router_aux_loss:
    true`` is refused and the default leaves the config alone."""
    _, ours, batch, ref, out = training_forwards("deepseek_v3")
    assert getattr(ref, "aux_loss", None) is None and getattr(out, "aux_loss", None) is None
    assert rel_err(out.loss, ref.loss) <= FP32_TOL
    assert router_of(ours) is None
    output = CausalLM(router_of(ours))(ours, batch, torch.tensor(int((batch["labels"][:, 1:] != -100).sum())))
    assert output.metrics == {} and rel_err(output.loss, ref.loss) <= FP32_TOL
    deepseek = (
        "model.config={model_type: deepseek_v3, vocab_size: 2048, hidden_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, n_routed_experts: 4, n_group: 1, topk_group: 1, num_experts_per_tok: 2}"
    )
    recipe = load_recipe(QUICKSTART, [deepseek, "model.router_aux_loss=true"])
    with pytest.raises(RecipeError, match="'deepseek_v3': it balances its experts without one"):
        build_config(recipe)
    config = build_config(load_recipe(QUICKSTART, [deepseek]))
    assert not getattr(config, "output_router_logits", False)  # a field from transformers 5.2x on


@pytest.mark.parametrize("kernels", [True, False], ids=["ours", "hf"])
def test_deepseek_logs_the_load_of_the_experts_its_router_chose(kernels):
    """DeepSeek-V3's choice (the best groups, then the top k of the bias-corrected scores) is not
    the top k of its logits, so its expert load is read from the experts each token is sent to.
    The reference calls each MoE layer's router itself on the hidden states that layer received
    and counts with bincount; a large score bias makes the choice differ from the logits' top k.
    Two MoE layers, so that max and mean differ. With checkpointing, the recomputation in
    backward sends the tokens to the experts again: the next step's metrics are still its own
    forward's."""
    assert chosen_experts_of(tiny_moe("deepseek_v3", first_k_dense_replace=LAYERS)) is None  # dense only
    model = tiny_moe("deepseek_v3", num_hidden_layers=3)
    if kernels:
        patch_model(model, WITH_EXPERTS)
    blocks = [m for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"]
    assert len(blocks) == 2
    with torch.no_grad():
        for block in blocks:
            block.gate.e_score_correction_bias.copy_(torch.linspace(2.0, -2.0, 8))
    seen = []
    for block in blocks:
        block.register_forward_hook(lambda module, args, out: seen.append((module, args[0].detach())))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    objective = CausalLM(router_of(model), chosen_experts_of(model))
    for step in range(2):
        batch = random_batch()
        count = int((batch["labels"][:, 1:] != -100).sum())
        seen.clear()
        out = objective(model, batch, torch.tensor(count + 3))
        loads, differs = [], False
        with torch.no_grad():
            for block, hidden in seen[: len(blocks)]:
                logits, _, chosen = block.gate(hidden)
                differs |= not torch.equal(
                    chosen.sort(dim=-1).values, logits.topk(2, dim=-1).indices.sort(dim=-1).values
                )
                counts = torch.bincount(chosen.reshape(-1), minlength=8).double()
                loads.append(counts.max() / counts.mean())
        assert differs, "the bias did not move the choice away from the logits' top k"
        share = count / (count + 3)
        assert set(out.metrics) == {"expert_load_max", "expert_load_mean"}
        assert out.metrics["expert_load_max"].item() == pytest.approx(max(loads).item() * share, rel=1e-6)
        assert out.metrics["expert_load_mean"].item() == pytest.approx(
            (sum(loads) / len(loads)).item() * share, rel=1e-6
        )
        out.loss.backward()
        # The recomputation reached the experts again (a forward hook after the last saved
        # tensor, as `seen`'s is, is skipped by checkpoint's early stop; the record's pre-hook is not).
        recomputed = objective.chosen.load_sum.item()
        assert recomputed == pytest.approx(2 * sum(loads).item(), rel=1e-6), f"step {step}: no recomputation"


# Three layers, two or three of them MoE: a graph compiled again for each MoE layer shows.
# DeepSeek-V3 without router outputs, as `build_config` leaves it (from transformers 5.2x its
# config takes the field, and its router logits are then collected by transformers' hooks).
THREE_LAYERS = {
    "gpt_oss": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"]),
    "deepseek_v3": dict(num_hidden_layers=3, output_router_logits=False),
}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_compiled_layers_train_as_eager(model_type, monkeypatch):
    """``training.compile`` on a mixture-of-experts model (three checkpointed layers, experts
    kernel inside): loss (with the balancing term), router metrics and gradients are the eager
    model's at every step, and each kind of layer is compiled once (dynamo's recompile limit set
    to 2, a dense and an MoE layer, which fails the run when hit). DeepSeek-V3's expert-load record is a pre-hook traced into the
    layer's graph (one graph per layer: ``fullgraph`` fails on a break); the recomputation in
    backward runs inside the compiled graph and calls no hook, where the eager model's calls it
    again. The families with a balancing loss break each layer's graph where transformers'
    output-capture hooks (their router logits) read a ``ContextVar``, which dynamo cannot trace
    (docs/moe.md); the start log says so."""
    from ligertune.training.transforms import apply_transforms

    fullgraph = model_type == "deepseek_v3"
    original = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self: original(self, backend="aot_eager", fullgraph=fullgraph)
    )
    torch._dynamo.reset()
    base = tiny_moe(model_type, **THREE_LAYERS.get(model_type, dict(num_hidden_layers=3)))
    if model_type == "deepseek_v3":  # a choice away from the logits' top k (the test above)
        with torch.no_grad():
            for module in base.modules():
                if type(module).__name__ == "DeepseekV3MoE":
                    module.gate.e_score_correction_bias.copy_(torch.linspace(2.0, -2.0, 8))
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["training.compile=true"])):
        recipe = load_recipe(QUICKSTART, ["training.activation_checkpointing=full", *extra])
        model, reports = apply_transforms(copy.deepcopy(base), recipe)
        runs[name] = (model, CausalLM(router_of(model), chosen_experts_of(model)))
    # The start log says where the graphs break.
    assert ("router logits" in reports.get("compile", "")) == (not fullgraph)
    try:
        for step in range(2):
            batch = random_batch()
            count = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()) + 3)
            outs, gradients = {}, {}
            for name, (model, objective) in runs.items():
                model.zero_grad(set_to_none=True)
                with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
                    outs[name] = objective(model, batch, count)
                    outs[name].loss.backward()
                gradients[name] = grads(model)
            eager, compiled = outs["eager"], outs["compiled"]
            assert compiled.loss.item() == pytest.approx(eager.loss.item(), rel=1e-6), step
            assert eager.metrics and set(compiled.metrics) == set(eager.metrics)
            for key, value in eager.metrics.items():
                assert compiled.metrics[key].item() == pytest.approx(value.item(), rel=1e-6), (step, key)
            assert set(gradients["compiled"]) == set(gradients["eager"])
            for key, g in gradients["eager"].items():
                torch.testing.assert_close(gradients["compiled"][key], g, rtol=1e-5, atol=1e-7, msg=key)
            if model_type == "deepseek_v3":
                twice, once = (runs[name][1].chosen.load_sum.item() for name in ("eager", "compiled"))
                assert twice == pytest.approx(2 * once, rel=1e-6)
    finally:
        torch._dynamo.reset()


def test_deepseek_rope_without_interleaving():
    """``rope_interleave: false``: the attention calls the plain ``apply_rotary_pos_emb`` on the
    rotary part, which our kernel computes as well."""
    result = parity_check(tiny_moe("deepseek_v3", rope_interleave=False), random_batch(), WITH_EXPERTS)
    assert result.ok and result.report.patched["rope"] == LAYERS, str(result)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patched_moe_forward_keeps_hf_signature(model_type):
    model = tiny_moe(model_type)
    hf_params = list(inspect.signature(type(model).forward).parameters)[1:]
    patch_model(model, WITH_EXPERTS)
    assert list(inspect.signature(model.forward).parameters) == hf_params


# --------------------------------------------------------------------------------------------
# The recipe key, the plan's active parameters, a run's metrics
# --------------------------------------------------------------------------------------------

E, K, WIDTH, H = 4, 2, 32, 64
MOE_CONFIG = (
    "model.config={model_type: qwen3_moe, vocab_size: 2048, hidden_size: 64, intermediate_size: 128, "
    f"moe_intermediate_size: {WIDTH}, num_experts: {E}, num_experts_per_tok: {K}, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, tie_word_embeddings: false}"
)


def moe_overrides(tmp_path, *overrides) -> list[str]:
    # 64 tokens: the bundled Alpaca prompts fill 32.
    return [MOE_CONFIG, "data.max_seq_len=64", f"output_dir={tmp_path}", *overrides]


def moe_recipe(tmp_path, *overrides):
    return load_recipe(QUICKSTART, moe_overrides(tmp_path, *overrides))


def test_router_aux_loss_key(tmp_path):
    assert build_config(moe_recipe(tmp_path)).output_router_logits is True  # on by default
    assert build_config(moe_recipe(tmp_path, "model.router_aux_loss=false")).output_router_logits is False
    aliased = moe_recipe(tmp_path, "model.config_overrides={num_experts: 8}")  # attribute_map's alias
    assert build_config(aliased).num_local_experts == 8
    kept = moe_recipe(tmp_path, "model.config_overrides={output_router_logits: false}")
    assert build_config(kept).output_router_logits is False
    both = moe_recipe(
        tmp_path, "model.router_aux_loss=true", "model.config_overrides={output_router_logits: true}"
    )
    with pytest.raises(
        RecipeError, match="model.router_aux_loss and model.config_overrides.output_router_logits"
    ):
        build_config(both)
    # validate names the key for a dense model
    problems = model_problems(load_recipe(QUICKSTART, ["model.router_aux_loss=true"]))
    assert any(p.startswith("model.router_aux_loss: true needs a mixture-of-experts model") for p in problems)


def test_plan_counts_active_parameters():
    """Qwen3-30B-A3B's published sizes: 30.5B parameters, 3.3B active; each token computes
    with 8 of the 128 experts of its 48 layers (3 matrices of 2048 × 768 each)."""
    recipe = load_recipe(ROOT / "recipes" / "qwen3-30b-a3b-alpaca-bench.yaml")
    shape = recipe_shape(recipe)
    experts = 48 * 128 * 3 * 2048 * 768
    assert shape.expert_params == experts and (shape.experts, shape.top_k) == (128, 8)
    assert shape.active_params == shape.params - experts * 120 // 128
    assert round(shape.params / 1e9, 1) == 30.5 and round(shape.active_params / 1e9, 1) == 3.4
    dense_flops = 6 * (shape.params - shape.embed_params)  # what MFU counted before
    assert shape.flops_per_token(0) == 6 * (shape.active_params - shape.embed_params) < dense_flops / 7
    assert shape.intermediate == 8 * 768  # the routed rows one token's activations are sized by
    assert shape.layer_active_params == shape.layer_params - 128 * 3 * 2048 * 768 * 120 // 128
    experts_saved = {
        t.name: t.per_token for t in layer_saved(shape, Setting(micro_batch_size=1, seq_len=2048))
    }
    assert experts_saved["experts: each token's k input copies"] == 8 * 2048
    assert experts_saved["mlp: up"] == 8 * 768


@pytest.mark.parametrize(
    "architecture, total, active, q_rank",
    [("deepseek-v3", 671.0, 37.6, 1536), ("moonlight-16b-a3b", 16.0, 2.9, 0)],
)
def test_plan_counts_deepseek_parameters(architecture, total, active, q_rank):
    """The published sizes: DeepSeek-V3 671B parameters, 37B active (its multi-token-prediction
    layer, 14B more, is not built by transformers); Moonlight-16B-A3B 16B, 3B active. MLA's heads
    are 128 + 64 wide for q and k, 128 for v; MFU counts the active experts, the largest layer is
    an MoE layer (the first ones are dense)."""
    shape = recipe_shape(load_recipe(QUICKSTART, [f"model.config={architecture}"]))
    config = build_config(load_recipe(QUICKSTART, [f"model.config={architecture}"]))
    experts, k = config.n_routed_experts, config.num_experts_per_tok
    sparse = config.num_hidden_layers - config.first_k_dense_replace
    assert shape.expert_layers == sparse and shape.experts == experts and shape.top_k == k
    assert shape.expert_params == sparse * experts * 3 * config.hidden_size * config.moe_intermediate_size
    assert round(shape.params / 1e9, 1) == total and round(shape.active_params / 1e9, 1) == active
    assert (shape.head_dim, shape.v_head_dim, shape.rotary_dim) == (192, 128, 64)
    assert shape.latent.q_rank == q_rank and shape.latent.kv_rank == 512
    assert shape.attention_width == config.num_attention_heads * (192 + 128) // 2
    assert shape.flops_per_token(0) == 6 * (shape.active_params - shape.embed_params)
    assert (
        shape.layer_active_params
        == shape.layer_params - shape.expert_params // sparse * (experts - k) // experts
    )
    assert shape.intermediate == (k + config.n_shared_experts) * config.moe_intermediate_size


@pytest.mark.parametrize("kernels", ["none", "ours"])
def test_plan_counts_what_latent_attention_saves(kernels):
    """The plan's listing of a DeepSeek-V3 layer (MLA, the latents' norms, RoPE's copies, a dense
    MLP) against autograd's record: a 3-layer model's saved bytes minus a 2-layer one's, fp32,
    dense layers only (first_k_dense_replace), as wide as a token's experts so that the shape's
    MLP width holds; the experts' own rows are checked above."""
    if kernels == "ours" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (the reference path saves what eager saves)")
    measured = {}
    for layers in (2, 3):
        model = tiny_moe("deepseek_v3", num_hidden_layers=layers, first_k_dense_replace=layers)
        if kernels == "ours":
            patch_model(model, "all")
        model.train()
        measured[layers] = plan_saved_bytes(model, random_batch()["input_ids"])
    shape = replace(model_shape(model), experts=0, top_k=0, expert_params=0, expert_layers=0)
    s = Setting(
        micro_batch_size=2,
        seq_len=random_batch()["input_ids"].shape[1],
        precision="fp32",
        kernels=OURS if kernels == "ours" else frozenset(),
    )
    assert measured[3] - measured[2] == pytest.approx(
        sum(t.bytes(s.tokens) for t in layer_saved(shape, s)), rel=0.03
    )


def test_plan_counts_what_the_experts_kernel_saves():
    """The plan's row for the patched experts against autograd's own record: the unique storages
    the patched Experts module saves for backward, other than its inputs and weights, on a tiny
    Qwen3-MoE (fp32, the Triton path under the interpreter); and the grouped_mm rows are gone."""
    model = tiny_moe("qwen3_moe")
    patch_model(model, WITH_EXPERTS)
    experts = model.model.layers[0].mlp.experts
    tokens, hidden = 24, model.config.hidden_size
    x = torch.randn(tokens, hidden, requires_grad=True)
    weights, index = torch.randn(tokens, E).softmax(-1).topk(K, dim=-1)
    weights.requires_grad_()
    inputs = {t.untyped_storage().data_ptr() for t in (x, index, weights, *experts.parameters())}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, index, weights)
    s = Setting(micro_batch_size=1, seq_len=tokens, precision="fp32", kernels=frozenset({"moe_experts"}))
    rows = {t.name: t for t in layer_saved(model_shape(model), s) if t.name.startswith(("experts", "mlp"))}
    assert set(rows) == {"experts: pre-activation gate/up (moe_experts)"}
    assert sum(seen.values()) == rows["experts: pre-activation gate/up (moe_experts)"].bytes(tokens)


def test_plan_fix_turns_the_experts_kernel_on():
    """A Qwen3-30B-A3B step that fits only with the experts' smaller saved activations (the dense
    kernels on, moe_experts off): the plan's fix turns the experts kernel on; a dense model is never
    told."""
    shape = recipe_shape(load_recipe(ROOT / "recipes" / "qwen3-30b-a3b-alpaca-bench.yaml"))
    base = Setting(micro_batch_size=1, seq_len=8192, kernels=choose.OUR_KERNELS)
    smallest = replace(base, checkpointing="full")
    without = estimate(shape, smallest).peak
    with_kernel = estimate(shape, replace(smallest, kernels=base.kernels | {"moe_experts"})).peak
    assert with_kernel < without
    budget = int((with_kernel + without) / 2 / (1 - HEADROOM_FRACTION))
    assert choose.cheapest_fix(shape, base, budget) == "kernels.moe_experts=true"
    dense = replace(shape, experts=0, top_k=0, expert_params=0)  # every fix fits: the first is named
    assert choose.cheapest_fix(dense, base, 10**15) != "kernels.moe_experts=true"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_run_logs_router_metrics(tmp_path, lora):
    """One step (two micro-batches) of a tiny Qwen3-MoE through ``ligertune train`` with every
    kernel, the routed experts' included, fully trained or with LoRA on its linear layers:
    metrics.jsonl has the balancing loss and the expert load, within their ranges."""
    overrides = [
        *PLAIN_RUN,
        "kernels=all",
        "kernels.moe_experts=true",
        "training.max_steps=1",
        "training.micro_batch_size=2",
    ]
    overrides += ["training.gradient_accumulation_steps=2", "data.validation_fraction=0.0"]
    if lora:
        overrides.append("lora={r: 4, alpha: 8, target_modules: all-linear}")
    result = CliRunner().invoke(app, ["train", str(QUICKSTART), *moe_overrides(tmp_path, *overrides)])
    assert result.exit_code == 0, result.output
    run_dir = moe_recipe(tmp_path, *overrides).run_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["kernels_patched"]["moe_experts"] == 2  # both layers
    steps = [r for r in records if r["event"] == "train"]
    assert len(steps) == 1
    for r in steps:
        # E·Σ fᵢ·Pᵢ with fᵢ ≤ 1 (a token picks an expert once) and Σ Pᵢ = 1: at most E (k if balanced).
        assert 0 < r["aux_loss"] <= E
        assert 1 <= r["expert_load_mean"] <= r["expert_load_max"] <= E / K


def test_mxfp4_checkpoint_loads_dequantised(tmp_path, monkeypatch):
    """A GPT-OSS folder whose config says MXFP4 (as openai/gpt-oss-20b's does) is loaded with
    ``Mxfp4Config(dequantize=True)``: plain floating experts, equal to the saved weights, trainable."""
    saved = tiny_moe("gpt_oss", num_hidden_layers=1, layer_types=["full_attention"])
    saved.save_pretrained(tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    config_file.write_text(json.dumps(config))
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("quantization_config"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    recipe = load_recipe(
        QUICKSTART,
        ["model.config=null", f"model.name_or_path={tmp_path / 'model'}", f"output_dir={tmp_path}"],
    )
    model = build_model(recipe, torch.device("cpu"))
    assert isinstance(seen[0], Mxfp4Config) and seen[0].dequantize
    experts = model.model.layers[0].mlp.experts
    assert type(experts.gate_up_proj) is nn.Parameter and experts.gate_up_proj.is_floating_point()
    torch.testing.assert_close(experts.gate_up_proj.float(), saved.model.layers[0].mlp.experts.gate_up_proj)
    model.train()
    model(**random_batch()).loss.backward()
    assert experts.gate_up_proj.grad is not None
