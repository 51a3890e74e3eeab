"""The memory plan (`ligertune.plan`, ``ligertune plan``) against hand counts, against
what autograd really saves (measured on CPU), and on the GPU against the measured peak."""

from __future__ import annotations

import gc
import json
import os
import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from ligertune.catalog.objectives.dpo import DPOOptions
from ligertune.catalog.strategies import DDPParallel, DeepSpeedParallel, FSDPParallel, SingleProcess
from ligertune.cli import app
from ligertune.config import load_recipe
from ligertune.config.rules import recipe_problems
from ligertune.config.schema.training import CHECKPOINT_MODULES
from ligertune.models.shape import frozen_shape, model_shape, recipe_shape
from ligertune.objectives.dpo import DPO
from ligertune.objectives.reference import Reference
from ligertune.patching.apply import patch_model
from ligertune.plan import choose
from ligertune.plan.activations import (
    activation_bytes,
    checkpointed_layer_saved,
    head_fixed_bytes,
    layer_activation_bytes,
    layer_saved,
    model_saved,
    recomputed_bytes,
)
from ligertune.plan.choose import candidates, offload_slowdown, relative_speed
from ligertune.plan.estimate import estimate, state_bytes
from ligertune.plan.recipe import base_setting
from ligertune.plan.setting import GIB, Setting
from ligertune.training.auto import resolve_auto
from ligertune.training.transforms.checkpointing import SUBMODULE_ATTRIBUTES, checkpoint_submodules
from tests.helpers import QUICKSTART, ROOT, TINY_MODEL

OURS = frozenset({"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"})
H, HEADS, KV, D, I, V = 64, 4, 2, 16, 160, 320  # noqa: E741 (the hand-counted model)
B, S = 2, 32
T = B * S  # tokens


def setting_of(recipe, world_size: int) -> Setting:
    """The recipe's `Setting`, its objective's frozen model included (as `plan` and auto read it)."""
    return base_setting(recipe, world_size, frozen_shape(recipe))


def tiny(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        intermediate_size=I,
        vocab_size=V,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return LlamaForCausalLM(config)


# --------------------------------------------------------------------------------------------
# Hand counts
# --------------------------------------------------------------------------------------------


def test_parameters_and_states_by_hand():
    shape = model_shape(tiny(2))
    # q and o: H×H; k and v: H×(KV·D); gate, up, down: H×I; two norms of H.
    layer = 2 * H * H + 2 * H * KV * D + 3 * H * I + 2 * H
    assert shape.layer_params == layer == 43136
    assert shape.embed_params == shape.head_params == V * H  # untied
    total = 2 * V * H + 2 * layer + H  # embeddings, lm_head, layers, final norm
    assert shape.params == total == 127296

    s = Setting(micro_batch_size=B, seq_len=S, precision="bf16")
    states, grads = state_bytes(shape, s)
    assert states == {"weights": 2 * total, "AdamW moments": 4 * total} and grads == 2 * total
    mixed, grads = state_bytes(shape, Setting(micro_batch_size=B, seq_len=S, precision="bf16-mixed"))
    assert mixed == {
        "weights": 4 * total,
        "AdamW moments": 8 * total,
        "autocast bf16 weight copies": 2 * total,
    }
    assert grads == 4 * total
    fsdp = Setting(
        micro_batch_size=B, seq_len=S, precision="bf16-mixed", parallel=FSDPParallel(), world_size=4
    )
    states, grads = state_bytes(shape, fsdp)
    assert states["weights (sharded)"] == 4 * total // 4 and grads == 4 * total // 4
    assert states["AdamW moments (sharded)"] == 8 * total // 4
    assert states["FSDP2 gathered layers (current + prefetch)"] == 2 * layer * 2  # bf16, two layers


def test_layer_activations_by_hand():
    """Every tensor one decoder layer saves, written out: HF eager and ours, fp32 and bf16."""
    shape = model_shape(tiny(2))
    q, kv = HEADS * D, KV * D
    for precision, e in (("fp32", 4), ("bf16", 2)):
        # RMSNorm (HF): x upcast to fp32, rstd, x·rstd (input dtype), output (the projections' input)
        norm_eager = T * (H * 4 + 4 + H * e + H * e)
        norm_ours = T * (H * e + 4 + H * e)  # our kernel: x and rstd; the output
        attention = T * (q + kv + kv + q) * e + T * HEADS * 4  # q, k, v, out; fp32 log-sum-exp
        mlp_eager = T * I * e * 4  # gate, silu(gate), up, silu(gate)·up
        mlp_ours = T * I * e * 3  # gate, up (kernel), product (down_proj's input)
        eager = Setting(micro_batch_size=B, seq_len=S, precision=precision)
        ours = Setting(micro_batch_size=B, seq_len=S, precision=precision, kernels=OURS)
        assert layer_activation_bytes(shape, eager) == 2 * norm_eager + attention + mlp_eager
        assert layer_activation_bytes(shape, ours) == 2 * norm_ours + attention + mlp_ours
    # The fused CE keeps dh [T, H] and dW [V, H] (its gradients), never [T, V].
    ours = Setting(micro_batch_size=B, seq_len=S, precision="fp32", kernels=OURS)
    assert head_fixed_bytes(shape, ours) == V * H * 4
    assert not any("vocab" in t.name or t.per_token == V for t in model_saved(shape, ours))


def test_submodule_checkpointing_by_hand():
    """A layer whose attention (or MLP) is checkpointed keeps the rest of the layer and the
    checkpoint's input, the normed hidden state in the residual stream's dtype (fp32 under
    bf16-mixed, where the projections would have kept its bf16 copy)."""
    shape = model_shape(tiny(2))
    q, kv = HEADS * D, KV * D
    for precision, e, es in (("fp32", 4, 4), ("bf16", 2, 2), ("bf16-mixed", 2, 4)):
        norm = T * (H * es + 4)  # our kernel: x and rstd
        out = T * H * e  # a norm's output, as the projections after it keep it
        attention = T * (q + kv + kv + q) * e + T * HEADS * 4
        mlp = T * I * e * 3
        kept_input = T * H * es
        s = Setting(
            micro_batch_size=B,
            seq_len=S,
            precision=precision,
            kernels=OURS,
            checkpointing="selective",
            every=1,
            modules=("attention",),
        )
        assert (
            sum(t.bytes(T) for t in checkpointed_layer_saved(shape, s)) == 2 * norm + kept_input + out + mlp
        )
        assert recomputed_bytes(shape, s) == out + attention
        mlp_only = replace(s, modules=("mlp",))
        assert (
            sum(t.bytes(T) for t in checkpointed_layer_saved(shape, mlp_only))
            == 2 * norm + out + attention + kept_input
        )
        assert recomputed_bytes(shape, mlp_only) == out + mlp
    # Layers 0 and 2 of 3 with every 2: two partial layers and one whole, in the breakdown.
    shape3 = model_shape(tiny(3))
    s = Setting(B, S, kernels=OURS, checkpointing="selective", every=2, modules=("attention",))
    parts = activation_bytes(shape3, s)
    partial = sum(t.bytes(T) for t in checkpointed_layer_saved(shape3, s))
    assert parts[f"2 layers recomputing attention × {partial / GIB:.2f} GiB"] == 2 * partial
    whole = layer_activation_bytes(shape3, s)
    assert parts[f"1 layers × {whole / GIB:.2f} GiB"] == whole


# --------------------------------------------------------------------------------------------
# Against what autograd saves (CPU)
# --------------------------------------------------------------------------------------------


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize(
    "kernels, precision, modules",
    [
        ("none", "fp32", ()),
        ("none", "bf16", ()),
        ("ours", "fp32", ()),
        ("ours", "fp32", ("attention",)),
        ("none", "bf16", ("mlp",)),
    ],
    ids=["eager-fp32", "eager-bf16", "ours-fp32", "ours-fp32-attention", "eager-bf16-mlp"],
)
def test_saved_activations_match_a_measurement(kernels, precision, modules):
    """Per-layer bytes: the 3-layer model's saved bytes minus the 2-layer one's (everything
    outside the layers cancels), within 3% of the plan's; the whole model's within 3% too.
    Kernels on run their Triton code under the CPU interpreter (conftest), so what is measured
    is what the kernels' autograd Functions save. With a checkpointed sub-module in every layer,
    what stays saved is the checkpoint's inputs (the sub-module's own saves are replaced by
    checkpoint placeholders, which the hooks never see)."""
    if kernels == "ours" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (the reference path saves what eager saves)")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    measured = {}
    for layers in (2, 3):
        model = tiny(layers).to(dtype)
        if kernels == "ours":
            patch_model(model, "all")
        if modules:
            checkpoint_submodules(list(model.model.layers), list(modules), 1)
        model.train()
        measured[layers] = saved_bytes(model, ids)
    shape = model_shape(tiny(2))
    s = Setting(
        micro_batch_size=B,
        seq_len=S,
        precision=precision,
        kernels=OURS if kernels == "ours" else frozenset(),
        checkpointing="selective" if modules else "none",
        every=1,
        modules=modules,
    )
    saved = checkpointed_layer_saved(shape, s) if modules else layer_saved(shape, s)
    per_layer = sum(t.bytes(T) for t in saved)
    assert measured[3] - measured[2] == pytest.approx(per_layer, rel=0.03)
    total = 2 * per_layer + sum(t.bytes(T) for t in model_saved(shape, s)) + head_fixed_bytes(shape, s)
    assert measured[2] == pytest.approx(total, rel=0.03)


class LiveStorages(TorchDispatchMode):
    """Follows every storage an operator creates inside the mode until it is freed, and keeps
    the largest total alive: the peak of what a forward and backward allocate (tensors made
    outside the mode, the parameters, are not counted)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.sizes = 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.sizes:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                self.sizes[key] = size
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.live -= self.sizes.pop(key, 0)


@pytest.mark.parametrize("kernels", ["none", "ours"])
def test_backward_peak_matches_a_measurement(kernels):
    """The plan's peak of a fully checkpointed step (the last layer's backward: the layers'
    inputs, the layer recomputed and its backward's working set, the loss head's tensors gone)
    against the live storages followed through a real forward and backward on CPU, per token:
    the difference between 2,048 and 1,024 tokens, which cancels what does not grow with the
    row (the parameters' gradients). Kernels on run their Triton code under the interpreter."""
    if kernels == "ours" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (the reference path saves what eager saves)")
    measured, predicted = [], []
    for seq in (1024, 2048):
        model = tiny(2)
        if kernels == "ours":
            patch_model(model, "all")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(0, V, (1, seq), generator=torch.Generator().manual_seed(0))
        with LiveStorages() as mode:
            model(input_ids=ids, labels=ids).loss.backward()
        measured.append(mode.peak)
        s = Setting(
            1, seq, precision="fp32", checkpointing="full", kernels=OURS if kernels == "ours" else frozenset()
        )
        predicted.append(estimate(model_shape(model), s).moments["start of backward"])
    per_token = (measured[1] - measured[0]) / 1024
    assert (predicted[1] - predicted[0]) / 1024 == pytest.approx(per_token, rel=0.08)


def test_kernels_save_less_than_eager_by_the_listed_tensors():
    """The difference the kernels make per layer is what the listing says it is: the norms'
    fp32 upcast and x·rstd twice less x itself, and one MLP activation (bf16)."""
    shape = model_shape(tiny(2))
    eager = layer_activation_bytes(shape, Setting(micro_batch_size=B, seq_len=S))
    ours = layer_activation_bytes(shape, Setting(micro_batch_size=B, seq_len=S, kernels=OURS))
    assert eager - ours == 2 * T * H * 4 + T * I * 2


def test_dpo_saves_two_rows_per_pair_and_nothing_of_its_reference():
    """The real DPO objective (materialised path, fp32) over B pairs with a frozen reference:
    what autograd saves is the plan's activations at 2·B rows (the 3-layer minus the 2-layer
    model per layer, and the whole), within 3% as for sft; the reference, run first under
    no_grad, saves nothing."""
    ids = torch.randint(0, V, (2 * B, S), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    measured = {}
    for layers in (2, 3):
        policy, reference = tiny(layers).train(), tiny(layers).eval().requires_grad_(False)
        objective = DPO(DPOOptions(beta=0.1), Reference("frozen", model=reference), fused=False)
        frozen = {p.untyped_storage().data_ptr() for p in reference.parameters()}
        params = frozen | {p.untyped_storage().data_ptr() for p in policy.parameters()}
        seen: dict[int, int] = {}

        def pack(t, params=params, seen=seen):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            objective(policy, batch, torch.tensor(B))
        measured[layers] = sum(seen.values())
    shape = model_shape(tiny(2))
    s = Setting(B, S, precision="fp32", rows_per_sample=2, loss_head="pairs", frozen=shape)
    per_token = sum(t.per_token * t.bytes_per_element for t in layer_saved(shape, s))
    assert measured[3] - measured[2] == pytest.approx(2 * T * per_token, rel=0.03)
    assert measured[2] == pytest.approx(sum(activation_bytes(shape, s).values()), rel=0.03)


# --------------------------------------------------------------------------------------------
# Objectives: pairs, a frozen reference, a teacher (hand counts)
# --------------------------------------------------------------------------------------------


def test_pairs_count_two_rows_per_sample_by_hand():
    """B pairs are a [2B, S] batch: one layer saves 2·T tokens' worth (our kernels, bf16)."""
    shape = model_shape(tiny(2))
    q, kv, e = HEADS * D, KV * D, 2
    per_token = 2 * (H * e + 4 + H * e) + (q + kv + kv + q) * e + HEADS * 4 + I * e * 3
    for head in ("pairs", "logprobs"):
        s = Setting(B, S, precision="bf16", kernels=OURS, rows_per_sample=2, loss_head=head)
        assert s.tokens == 2 * B * S
        assert layer_activation_bytes(shape, s) == 2 * T * per_token


def test_grpo_generation_and_policy_head_by_hand():
    """grpo: B prompts × G completions are the micro-batch's rows (every one S tokens long), its
    loss head reaches the L generated positions only, and the generation before the step holds
    the states without gradients, the KV cache of the window's rows at full length (k and v of
    every layer at the key/value heads), one layer's prefill forward and the sampling's logits;
    under FSDP2 every layer gathered (the states count the root and two layers already)."""
    shape = model_shape(tiny(4))
    layer, total = shape.layer_params, shape.params
    g, length = 4, 8
    s = Setting(
        B, S, precision="bf16", kernels=OURS, rows_per_sample=g, loss_head="policy", generated_tokens=length
    )
    rows, tokens = B * g, B * g * S
    assert (s.rows, s.tokens, s.head_tokens) == (rows, tokens, rows * length)
    b = estimate(shape, s)
    kv = 2 * 4 * KV * D * rows * S * 2
    prefill = tokens * (3 * I * 2 + 4 * H * 2)
    sampling = (
        rows * V * (2 + 4 + 4 + 12 + 4 + 4)
    )  # bf16 logits; fp32 /T, softmax, sort (+ int64), scatter, cdf
    assert b.temporaries["generation: KV cache (8 rows × 32 tokens)"] == kv
    assert b.temporaries["generation: one layer's prefill forward (no grad)"] == prefill
    assert b.temporaries["generation: last position's logits and sampling"] == sampling
    states = 2 * total + 4 * total  # bf16 weights and AdamW moments; no gradients before the step
    assert b.moments["generation (before the step)"] == states + kv + prefill + sampling
    # The fused policy head: all 8 completions of 8 tokens in one chunk (8 · 8 · V bf16 logits),
    # the completion positions' hidden states copied, and dh over those positions only.
    assert b.temporaries["loss head at its peak"] == rows * length * V * 2 + rows * length * H * 2
    eager = replace(s, kernels=frozenset())
    assert estimate(shape, eager).temporaries["loss head at its peak"] == rows * length * V * 8
    fsdp = estimate(shape, replace(s, parallel=FSDPParallel(), world_size=4))
    assert fsdp.temporaries["generation: FSDP2 whole model gathered"] == (4 - 2) * layer * 2
    # Two micro-batches per step: the window is generated as one batch of twice the rows.
    window = estimate(shape, replace(s, accumulation=2))
    assert window.temporaries["generation: KV cache (16 rows × 32 tokens)"] == 2 * kv
    assert window.temporaries["generation: last position's logits and sampling"] == 2 * sampling
    # From the recipe: the objective's facts reach the setting.
    recipe = _recipe("grpo", "training.micro_batch_size=2")
    setting = setting_of(recipe, 1)
    assert (setting.rows_per_sample, setting.generated_tokens, setting.loss_head) == (8, 8, "policy")
    assert setting.rows == 16 and setting.tokens == 16 * recipe.data.max_seq_len


def _recipe(name: str, *overrides: str):
    return load_recipe(ROOT / "recipes" / f"quickstart-{name}.yaml", list(overrides))


def test_dpo_recipe_doubles_the_activations_of_the_same_recipe_on_sft_data():
    """quickstart-dpo against the quickstart (sft) with the same model, rows, micro-batch,
    precision and kernels: every activation but the per-model lm_head gradient doubles."""
    dpo = _recipe("dpo")
    sft = load_recipe(
        QUICKSTART,
        [
            f"data.max_seq_len={dpo.data.max_seq_len}",
            "data.packing=false",
            f"training.micro_batch_size={dpo.training.micro_batch_size}",
            f"training.precision={dpo.training.precision}",
        ],
    )
    shape = recipe_shape(dpo)
    assert shape == recipe_shape(sft)
    pair, single = setting_of(dpo, 1), setting_of(sft, 1)
    assert (pair.rows_per_sample, single.rows_per_sample) == (2, 1)
    assert pair.kernels == single.kernels and "fused_linear_cross_entropy" in pair.kernels
    head = V_TINY * H_TINY * 4  # fp32 dW [vocab × hidden], once per model
    pair_parts, single_parts = activation_bytes(shape, pair), activation_bytes(shape, single)
    assert pair_parts["fused CE: lm_head gradient"] == single_parts["fused CE: lm_head gradient"] == head
    assert sum(pair_parts.values()) - head == 2 * (sum(single_parts.values()) - head)


# tiny-llama (ligertune/catalog/architectures.py), the quickstarts' model, counted by hand:
# q and o H×H, k and v H×(2 heads × 32), gate/up/down H×I, two norms; untied embeddings.
H_TINY, I_TINY, V_TINY = 128, 352, 2048
LAYER_TINY = 2 * H_TINY * H_TINY + 2 * H_TINY * 2 * 32 + 3 * H_TINY * I_TINY + 2 * H_TINY


def tiny_llama_params(layers: int) -> int:
    return 2 * V_TINY * H_TINY + layers * LAYER_TINY + H_TINY


def test_frozen_reference_adds_its_weights_by_hand():
    """A frozen reference (the starting model) adds its parameters once, in the weights' dtype,
    with no gradients or moments: × 2 bytes in bf16 on one GPU (and under DDP, a replica per
    GPU), ÷ world under FSDP2 and ZeRO-3, fp32 (build_model's bf16-mixed parameter dtype) on one
    GPU in bf16-mixed; every moment grows by exactly that much."""
    shape = model_shape(tiny(2))
    total, layer = 2 * V * H + 2 * (2 * H * H + 2 * H * KV * D + 3 * H * I + 2 * H) + H, 43136
    assert shape.params == total
    cases = [
        ("bf16", SingleProcess(), 1, "frozen reference (bf16, replica)", 2 * total),
        ("bf16", DDPParallel(), 4, "frozen reference (bf16, replica)", 2 * total),
        ("bf16-mixed", SingleProcess(), 1, "frozen reference (fp32, replica)", 4 * total),
        ("bf16", FSDPParallel(), 4, "frozen reference (bf16, sharded)", 2 * total // 4),
        ("bf16-mixed", FSDPParallel(), 4, "frozen reference (fp32, sharded)", 4 * total // 4),
        ("bf16-mixed", DeepSpeedParallel(), 4, "frozen reference (bf16, sharded)", 2 * total // 4),
    ]
    for precision, strategy, world, name, expected in cases:
        plain = Setting(
            B,
            S,
            precision=precision,
            parallel=strategy,
            world_size=world,
            kernels=OURS,
            rows_per_sample=2,
        )
        with_reference = replace(plain, loss_head="pairs", frozen=shape)
        states, _ = state_bytes(shape, with_reference)
        assert states[name] == expected, (precision, strategy)
        a, b = estimate(shape, with_reference), estimate(shape, replace(plain, loss_head="pairs"))
        for moment in ("loss (end of forward)", "start of backward", "end of backward"):
            assert a.moments[moment] - b.moments[moment] == expected, (precision, strategy, moment)
        assert not any("frozen" in k for k in (*b.states, *b.temporaries, *b.moments))
    # Its forward comes first, under no_grad: on one GPU in bf16 with our kernels, the states
    # (without gradients), one layer's working set at 2T tokens (gate, up, product and four
    # hidden-sized tensors) and its head (final hidden states and one logits chunk: all 2T rows
    # fit the default budget). Under FSDP2 also two gathered layers and the root, in bf16.
    s = Setting(B, S, precision="bf16", kernels=OURS, rows_per_sample=2, loss_head="pairs", frozen=shape)
    b = estimate(shape, s)
    states = 2 * total + 4 * total + 2 * total  # weights, moments, reference
    working = 2 * T * (3 * I * 2 + 4 * H * 2) + 2 * T * H * 2 + 2 * T * V * 2
    assert b.moments["frozen reference forward (before the policy's)"] == states + working
    fsdp = estimate(shape, replace(s, parallel=FSDPParallel(), world_size=4))
    gathered = (2 * layer + 2 * V * H) * 2
    assert (
        fsdp.temporaries["frozen reference: FSDP2 gathered layers (current + prefetch) and root"] == gathered
    )
    fsdp_states = sum(v for k, v in fsdp.states.items() if not k.startswith("gradients"))
    assert fsdp.moments["frozen reference forward (before the policy's)"] == fsdp_states + gathered + working


def test_recipes_hold_a_frozen_model_only_where_there_is_one():
    """dpo and kto (reference frozen, no LoRA) hold the starting model again; dpo with LoRA
    (adapters off), with a precomputed or no reference, orpo and simpo hold none. All of them
    train on pairs."""
    for name in ("dpo", "kto"):
        r = _recipe(name, "training.precision=bf16")
        s = setting_of(r, 1)
        assert s.frozen == replace(recipe_shape(r), lora_params=0) and s.frozen.params == tiny_llama_params(2)
        assert estimate(recipe_shape(r), s).states[
            "frozen reference (bf16, replica)"
        ] == 2 * tiny_llama_params(2)
    for name, overrides in (
        ("dpo", ["lora={r: 8}"]),
        ("dpo", ["objective.reference=none"]),
        ("kto", ["objective.reference=precomputed"]),
        ("orpo", []),
        ("simpo", []),
    ):
        r = _recipe(name, *overrides)
        s = setting_of(r, 1)
        assert s.frozen is None and s.rows_per_sample == 2, (name, overrides)
        b = estimate(recipe_shape(r), s)
        assert not any("frozen" in k for k in (*b.states, *b.temporaries, *b.moments)), (name, overrides)
    # The lora fix drops the reference too (adapters off): at 10.5 MB (9.66 usable) the fp32
    # DPO fits neither in bf16 (10.4 MB) nor with adapters beside a frozen copy (12.9 MB), but
    # with adapters alone (9.3 MB).
    r = _recipe("dpo")
    shape, base = recipe_shape(r), setting_of(r, 1)
    fix = choose.cheapest_fix(shape, base, 10_500_000)
    assert fix.startswith("a lora section") and "adapters off" in fix
    smallest = replace(base, micro_batch_size=1, checkpointing="full")
    adapted = replace(shape, lora_params=int(shape.params * choose.LORA_SHARE))
    assert not estimate(adapted, smallest).fits(10_500_000)


def test_distill_teacher_adds_its_own_size():
    """quickstart-distill's teacher is tiny-llama with 3 layers against the student's 2: its
    parameters, not the student's, are added (fp32 here, bf16 in bf16), sharded under FSDP2;
    and its forward, inside the student's loss, brings its gathered layers and root there."""
    r = _recipe("distill")
    shape, s = recipe_shape(r), setting_of(r, 1)
    assert shape.params == tiny_llama_params(2) and s.frozen.params == tiny_llama_params(3)
    assert s.rows_per_sample == 1 and s.frozen_role == "teacher"
    sft = replace(s, loss_head="causal", frozen=None)  # the same student, no teacher
    a, b = estimate(shape, s), estimate(shape, sft)
    assert a.states["frozen teacher (fp32, replica)"] == 4 * tiny_llama_params(3)
    for moment in ("start of backward", "end of backward"):
        assert a.moments[moment] - b.moments[moment] == 4 * tiny_llama_params(3)
    assert a.moments["loss (end of forward)"] - b.moments["loss (end of forward)"] > 4 * tiny_llama_params(3)
    bf16 = setting_of(_recipe("distill", "training.precision=bf16", "parallel.strategy=fsdp"), 4)
    c = estimate(shape, bf16)
    assert c.states["frozen teacher (bf16, sharded)"] == 2 * tiny_llama_params(3) // 4
    gathered = (2 * LAYER_TINY + 2 * V_TINY * H_TINY) * 2
    assert c.temporaries["frozen teacher: FSDP2 gathered layers (current + prefetch) and root"] == gathered
    c_no_teacher = estimate(shape, replace(bf16, loss_head="causal", frozen=None))
    assert (
        c.moments["start of backward"] - c_no_teacher.moments["start of backward"]
        == 2 * tiny_llama_params(3) // 4
    )


# --------------------------------------------------------------------------------------------
# The plan against the published measurements, the choices, auto
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe, overrides, world, measured_gib",
    [
        ("llama3.2-1b-alpaca-bench.yaml", [], 1, 27.3),
        ("llama3.2-1b-alpaca-bench.yaml", ["kernels=none"], 1, 57.2),
        ("llama3-8b-alpaca-bench.yaml", ["parallel.strategy=none", "training.precision=bf16"], 1, 60.1),
        (
            "llama3-8b-alpaca-bench.yaml",
            ["parallel.strategy=none", "training.precision=bf16", "kernels=none"],
            1,
            60.9,
        ),
        ("llama3-8b-alpaca-bench.yaml", [], 4, 34.9),
        ("llama3-8b-alpaca-bench.yaml", ["kernels=none"], 4, 40.8),
        (
            "llama3-8b-alpaca-bench.yaml",
            ["training.activation_checkpointing=false", "training.micro_batch_size=8"],
            4,
            96.3,
        ),
    ],
)
def test_plan_within_10_percent_of_published_peaks(recipe, overrides, world, measured_gib):
    """docs/benchmarks.md's peaks (allocated, torch 2.11): 1B and one-GPU 8B measured on an H100
    with the current code, the 4-GPU 8B lines on H200s before the plan existed. A regression check
    of the model against measurements; scripts/gpu_plan_accuracy.sh remeasures."""
    r = load_recipe(ROOT / "recipes" / recipe, overrides)
    predicted = estimate(recipe_shape(r), setting_of(r, world)).peak / GIB
    assert predicted == pytest.approx(measured_gib, rel=0.10)


def test_fsdp_layers_kept_gathered_without_reshard_after_forward():
    """``parallel.fsdp.reshard_after_forward: false``: every decoder layer stays gathered from its
    forward to its backward, L − 1 − prefetch layers more than the default holds (measured: the
    Qwen3-30B-A3B LoRA shape on 4 × H200, docs/benchmarks.md), in bf16; holding the whole model
    for generation then adds nothing."""
    from ligertune.catalog.strategies.fsdp import FSDPOptions
    from tests.test_plan_cp import SHAPE

    kept = FSDPParallel(fsdp=FSDPOptions(reshard_after_forward=False))
    default, keep = (Setting(4, 2048, parallel=p, world_size=4) for p in (FSDPParallel(), kept))
    extra = (SHAPE.layers - 2) * SHAPE.layer_params * 2
    before, after = estimate(SHAPE, default), estimate(SHAPE, keep)
    assert after.states["FSDP2 other layers kept gathered (reshard_after_forward: false)"] == extra
    assert all(after.moments[m] - before.moments[m] == extra for m in before.moments)
    assert kept.memory_whole_gathered(SHAPE, "bf16-mixed") == 0
    assert FSDPParallel().memory_whole_gathered(SHAPE, "bf16-mixed") == extra


def test_checkpointing_and_offload_lower_the_estimate():
    r = load_recipe(ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml", [])
    shape, base = recipe_shape(r), setting_of(r, 1)
    peaks = [
        estimate(shape, replace(base, checkpointing=c, offload=o)).peak
        for c, o in (("none", False), ("selective", False), ("none", True), ("full", False))
    ]
    assert peaks[0] > peaks[1] > peaks[3] and peaks[0] > peaks[2]
    # Recomputing attention in every layer: between none and full in memory, and costs less
    # than recomputing every other layer whole.
    attention = replace(base, checkpointing="selective", every=1, modules=("attention",))
    assert peaks[0] > estimate(shape, attention).peak > peaks[3]
    every_other = replace(base, checkpointing="selective", every=2)
    assert relative_speed(shape, base) > relative_speed(shape, attention) > relative_speed(shape, every_other)


def test_offload_costs_the_pcie_time_the_layer_cannot_hide(monkeypatch):
    """A Llama-3-8B layer by hand: 4096² (q) + 2·4096·1024 (k, v) + 4096² (o) + 3·4096·14336
    (MLP) + 2·4096 (norms) = 218,112,000 parameters, 6 FLOPs each a token: 3.27 µs at 400
    TFLOP/s. With our kernels it saves per token, in bf16: q 8192 B, k and v 2048 each, o's
    input 8192, the attention's log-sum-exp 32·4, each norm's input and output 2·8192 plus its
    fp32 rstd 4 (twice), gate, up and their product 3·28672: 139,400 B, 2.79 µs each way at
    50 GB/s. The copies outlast both the forward (1.09 µs) and the backward (2.18 µs):
    (2.79 + 2.79) / 3.27 - 1 = 0.705."""
    r = load_recipe(
        ROOT / "recipes" / "llama3-8b-alpaca-bench.yaml",
        ["parallel.strategy=none", "training.precision=bf16"],
    )
    shape, base = recipe_shape(r), replace(setting_of(r, 1), offload=True)
    assert shape.layer_params == 218_112_000
    assert offload_slowdown(shape, base) == pytest.approx(
        2 * (139_400 / 50e9) / (6 * 218_112_000 / 400e12) - 1
    )
    # Recomputing attention leaves only the MLP's and the norms' bytes to copy: a smaller cost.
    attention = replace(base, checkpointing="selective", every=1, modules=("attention",))
    assert 0 < offload_slowdown(shape, attention) < offload_slowdown(shape, base)
    # A link fast enough to hide the copies behind the forward costs nothing.
    monkeypatch.setattr(choose, "PCIE_BYTES_PER_S", 1e15)
    assert offload_slowdown(shape, base) == 0
    labels = {s.label() for s in candidates(base, (1,), ("none", "selective", "full"))}
    assert "micro 1, checkpointing selective/1 (attention)" in labels
    assert "micro 1, checkpointing selective/2, offload" in labels


def test_auto_can_pick_recomputing_attention():
    """At micro-batch 1 on 4 GPUs, 37.5 GiB leaves no room for no checkpointing (35.3 GiB
    predicted, 8% headroom) but for attention recomputed in every layer (34.1 GiB), the
    cheapest recompute that fits; the resolved recipe reads back as a valid one."""
    recipe = load_recipe(
        ROOT / "recipes" / "llama3-8b-alpaca-bench.yaml",
        [
            "training.micro_batch_size=1",
            "training.activation_checkpointing=auto",
            "training.memory_budget_gib=37.5",
        ],
    )
    training = resolve_auto(recipe, 4, torch.device("cpu")).recipe.training
    assert training.activation_checkpointing == "selective"
    assert training.activation_checkpointing_every == 1
    assert training.activation_checkpointing_modules == ["attention"]
    assert recipe_problems(recipe.model_copy(update={"training": training})) == []


def test_cpu_offload_moves_the_states_to_the_host_by_hand():
    """What an offload moves leaves the GPU's states and is counted, per rank, in the host's."""
    shape = model_shape(tiny(2))
    total = 127296  # the hand count of test_parameters_and_states_by_hand
    assert shape.params == shape.trainable == total
    fsdp = FSDPParallel(fsdp={"cpu_offload": True})
    states, grads = fsdp.memory_states(shape, "bf16-mixed", 4)
    assert states["weights (sharded)"] == states["AdamW moments (sharded)"] == grads == 0
    assert fsdp.memory_host(shape, "bf16-mixed", 4) == {
        "weights (sharded)": 4 * total // 4,
        "AdamW moments (sharded)": 8 * total // 4,
        "gradients (sharded)": 4 * total // 4,
    }
    assert FSDPParallel().memory_host(shape, "bf16-mixed", 4) == {}

    optimizer = DeepSpeedParallel(deepspeed={"zero_stage": 3, "offload_optimizer": True})
    states, grads = optimizer.memory_states(shape, "bf16-mixed", 4)
    assert states["fp32 master weights + AdamW moments (sharded)"] == 0
    assert states["weights (sharded)"] == 2 * total // 4
    assert grads == 2 * total // 4  # the bf16 partition; the fp32 one is on the host
    assert optimizer.memory_host(shape, "bf16-mixed", 4) == {
        "fp32 master weights + AdamW moments (sharded)": 12 * total // 4,
        "fp32 gradients (sharded)": 4 * total // 4,
    }
    on_gpu = DeepSpeedParallel(deepspeed={"zero_stage": 3})
    assert on_gpu.memory_states(shape, "bf16-mixed", 4)[1] == 6 * total // 4
    assert on_gpu.memory_host(shape, "bf16-mixed", 4) == {}
    both = DeepSpeedParallel(deepspeed={"zero_stage": 3, "offload_optimizer": True, "offload_params": True})
    assert both.memory_states(shape, "bf16", 4)[0]["weights (sharded)"] == 0
    assert both.memory_host(shape, "bf16", 4)["weights (sharded)"] == 2 * total // 4


runner = CliRunner()


def test_plan_command_checks_the_offloaded_states_against_the_hosts_memory():
    """1B, bf16-mixed, FSDP2 with cpu_offload over 2 ranks: 16 bytes a parameter in all (fp32
    weights, gradients and two moments), split over the ranks; on one host, or one rank on
    each of two (``--nnodes``)."""
    recipe = str(ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml")
    offload = [
        "parallel.strategy=fsdp",
        "parallel.fsdp.cpu_offload=true",
        "parallel.sharded_init=false",
        "training.precision=bf16-mixed",
    ]
    args = ["plan", recipe, *offload, "--nproc-per-node", "2", "--gpu-memory", "80GiB"]
    params = recipe_shape(load_recipe(recipe, offload)).params

    def host_line(output: str) -> str:
        (line,) = [x for x in output.splitlines() if x.startswith("host memory (CPU offload)")]
        return line

    need = f"{16 * params / GIB:.1f} GiB for the 2 ranks of one host"
    small = runner.invoke(app, [*args, "--host-memory", "16GiB"])
    assert small.exit_code == 2, small.output
    assert need in host_line(small.output) and host_line(small.output).endswith("the rest: does not fit")
    assert "the offloaded states do not fit the host's memory" in small.output
    large = runner.invoke(app, [*args, "--host-memory", "64GiB"])
    assert large.exit_code == 0, large.output
    assert need in host_line(large.output) and host_line(large.output).endswith("the rest: fits")
    assert "do not fit the host's memory" not in large.output
    # The same 2 ranks on 2 hosts: each host holds one rank's shards, half of the whole.
    one_each = ["plan", recipe, *offload, "--nnodes", "2", "--nproc-per-node", "1", "--gpu-memory", "80GiB"]
    spread = runner.invoke(app, [*one_each, "--host-memory", "16GiB"])
    assert spread.exit_code == 0, spread.output
    line = host_line(spread.output)
    assert f"{8 * params / GIB:.1f} GiB for the 1 rank of one host" in line and line.endswith(
        "the rest: fits"
    )
    assert "fsdp × 2" in spread.output
    plain = runner.invoke(app, ["plan", recipe, "--gpu-memory", "80GiB"])
    assert plain.exit_code == 0 and "host memory" not in plain.output
    bad = runner.invoke(app, [*args, "--host-memory", "lots"])
    assert bad.exit_code == 2 and "--host-memory 'lots'" in bad.output


def test_plan_command_fits_and_exit_2_naming_a_fix():
    recipe = str(ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml")
    ok = runner.invoke(app, ["plan", recipe, "--gpu-memory", "80GiB"])
    assert ok.exit_code == 0, ok.output
    assert "fastest that fits" in ok.output and "does not fit" in ok.output
    assert "loss head" in ok.output and "AdamW moments" in ok.output
    small = runner.invoke(app, ["plan", recipe, "--gpu-memory", "6GiB"])
    assert small.exit_code == 2, small.output
    assert "nothing fits" in small.output and "cheapest change" in small.output


def test_plan_command_defaults_the_target_on_cpu_and_counts_small_models():
    """Without a GPU (a laptop planning for a server) the target is 80 GiB, said in the header;
    the tiny quickstart model is counted in M, not as "0.00B"."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is the default target")
    result = runner.invoke(app, ["plan", str(QUICKSTART)])
    assert result.exit_code == 0, result.output
    header = result.output.splitlines()[0]
    assert header.startswith("quickstart: 893.6k parameters (2 layers")
    assert header.endswith(
        "target 80.0 GiB per GPU (no GPU here: the default target; --gpu-memory sets another)"
    )


def test_auto_resolves_against_the_budget_and_keeps_the_global_batch():
    overrides = [
        *TINY_MODEL,
        "training.micro_batch_size=auto",
        "training.activation_checkpointing=auto",
        "training.global_batch_size=16",
    ]
    cpu = torch.device("cpu")
    plain = resolve_auto(load_recipe(QUICKSTART, overrides), 2, cpu)
    assert (
        plain.recipe.training.micro_batch_size == 1
        and plain.recipe.training.activation_checkpointing == "none"
    )
    assert plain.recipe.training.gradient_accumulation_steps == 8 and "no GPU memory" in plain.message
    budget = resolve_auto(load_recipe(QUICKSTART, [*overrides, "training.memory_budget_gib=8"]), 2, cpu)
    training = budget.recipe.training
    assert (
        training.micro_batch_size == 8 and training.activation_checkpointing == "none"
    )  # the largest dividing 16/2
    assert training.micro_batch_size * training.gradient_accumulation_steps * 2 == 16
    tight = resolve_auto(
        load_recipe(
            ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml",
            ["training.activation_checkpointing=auto", "training.memory_budget_gib=24"],
        ),
        1,
        cpu,
    )
    assert tight.recipe.training.activation_checkpointing in ("selective", "full")
    assert "auto:" in tight.message and "predicted peak" in tight.message


def test_rules_for_the_new_keys():
    from ligertune.errors import RecipeError

    with pytest.raises(RecipeError, match="global_batch_size: used only with"):
        load_recipe(QUICKSTART, ["training.global_batch_size=8"])
    with pytest.raises(RecipeError, match="activation_checkpointing_every: used only with"):
        load_recipe(QUICKSTART, ["training.activation_checkpointing_every=3"])
    assert (
        load_recipe(QUICKSTART, ["training.activation_checkpointing=false"]).training.activation_checkpointing
        == "none"
    )
    modules = "training.activation_checkpointing_modules"
    with pytest.raises(
        RecipeError, match=rf"{modules}: \[mlp\] is used only with .*=selective \(it is none\)"
    ):
        load_recipe(QUICKSTART, [f"{modules}=[mlp]"])
    with pytest.raises(RecipeError, match="auto chooses the sub-modules itself"):
        load_recipe(QUICKSTART, [f"{modules}=[attention]", "training.activation_checkpointing=auto"])
    with pytest.raises(RecipeError, match=rf"{modules}.0: got 'attn'; allowed: 'attention' or 'mlp'"):
        load_recipe(QUICKSTART, [f"{modules}=[attn]", "training.activation_checkpointing=selective"])
    with pytest.raises(RecipeError, match="name one of attention, mlp, or leave it empty"):
        load_recipe(
            QUICKSTART, [f"{modules}=[attention, mlp]", "training.activation_checkpointing=selective"]
        )
    selective = load_recipe(
        QUICKSTART, [f"{modules}=[attention]", "training.activation_checkpointing=selective"]
    )
    assert selective.training.activation_checkpointing_modules == ["attention"]


def test_recipe_module_names_are_the_ones_checkpointing_knows():
    assert CHECKPOINT_MODULES == tuple(SUBMODULE_ATTRIBUTES)


# --------------------------------------------------------------------------------------------
# GPU: predicted against measured peak
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["all", "none"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_plan_predicts_the_measured_peak_on_gpu(tmp_path, kernels, checkpointing):
    """A 4-layer Llama at 4 × 1024 tokens in bf16 for 3 steps: the peak allocated of the run's
    metrics within 10% of the plan's (the full-size check is scripts/gpu_plan_accuracy.sh)."""
    from ligertune.training import train

    overrides = [
        "model.config_overrides={hidden_size: 1024, intermediate_size: 3584, num_hidden_layers: 4, "
        "num_attention_heads: 16, num_key_value_heads: 4, vocab_size: 32768}",
        "data.max_seq_len=1024",
        "training.micro_batch_size=4",
        "training.max_steps=3",
        "training.precision=bf16",
        "training.eval_every=null",
        "data.validation_fraction=0.0",
        f"training.activation_checkpointing={checkpointing}",
        f"kernels={kernels}",
        "logging.log_every=1",
        "checkpoint.export_hf=false",
        "checkpoint.save_final=false",
        f"output_dir={tmp_path}",
    ]
    recipe = load_recipe(QUICKSTART, overrides)
    # The run's peak counts every live tensor of the process, and earlier GPU tests in this
    # process leave some (0.25 GiB after the kernel tests): the plan predicts the run's own.
    gc.collect()
    left_over = torch.cuda.memory_allocated() / GIB
    train(recipe)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    measured = (
        max(r["peak_mem_allocated_gib"] for r in records if r.get("peak_mem_allocated_gib")) - left_over
    )
    predicted = estimate(recipe_shape(recipe), setting_of(recipe, 1)).peak / GIB
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


# --------------------------------------------------------------------------------------------
# Vision-language models: model.freeze and the vision tower
# --------------------------------------------------------------------------------------------


def _tiny_vl_counts() -> tuple[int, int]:
    """(the tower's parameters without its merger, the merger's) of the tiny Qwen2.5-VL, counted
    on a meta build straight from transformers."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ligertune.catalog.architectures import SHIPPED_CONFIGS

    mapping = dict(SHIPPED_CONFIGS["tiny-qwen2.5-vl"])
    config = AutoConfig.for_model(mapping.pop("model_type"), **mapping)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    tower = sum(p.numel() for p in model.model.visual.parameters())
    merger = sum(p.numel() for p in model.model.visual.merger.parameters())
    return tower - merger, merger


@pytest.mark.parametrize("parts", [["vision"], ["vision", "projector"]])
def test_freeze_drops_exactly_the_frozen_parameters_gradients_and_moments(parts):
    """fp32: 4 bytes per gradient element, two AdamW moments of 4; the weights stay."""
    blocks, merger = _tiny_vl_counts()
    frozen = blocks + (merger if "projector" in parts else 0)
    vl = ROOT / "recipes" / "quickstart-vl.yaml"
    plain = load_recipe(vl, [])
    freezing = load_recipe(vl, [f"model.freeze=[{','.join(parts)}]"])
    before = estimate(recipe_shape(plain), setting_of(plain, 1)).states
    after = estimate(recipe_shape(freezing), setting_of(freezing, 1)).states
    assert recipe_shape(freezing).frozen_params == frozen
    assert before["weights"] == after["weights"]
    assert before["AdamW moments"] - after["AdamW moments"] == 2 * frozen * 4
    grads = "gradients (at the end of backward)"
    assert before[grads] - after[grads] == frozen * 4


def test_vision_tower_by_hand():
    """A tower of 3 blocks, hidden 40, gated MLP 100; images of 30 tokens, 4 patches each (120
    patches); rows of 100 tokens hold 3 of them, micro-batch 2: 720 patches, bf16."""
    from ligertune.catalog.shape import VisionShape
    from ligertune.plan.vision import assumption, frozen_tower_bytes, vision_activation_bytes

    tower = VisionShape(
        layers=3,
        hidden=40,
        intermediate=100,
        gated=True,
        trains=True,
        patches_per_token=4,
        tokens_per_image=30,
        patches_per_image=120,
        max_pixels=120 * 14 * 14,
    )
    shape = replace(model_shape(tiny()), vision=tower)
    s = Setting(micro_batch_size=2, seq_len=100, kernels=OURS)
    patches = 2 * 3 * 120
    block = patches * (8 * 40 + 4 * 100) * 2
    assert vision_activation_bytes(shape, s) == {"vision tower: 3 blocks (720 patches)": 3 * block}
    assert frozen_tower_bytes(shape, s) == 0
    full = vision_activation_bytes(shape, replace(s, checkpointing="full"))
    assert full == {"vision tower: 3 checkpointed blocks (their inputs, 720 patches)": 3 * patches * 40 * 2}
    assert "assumes 3 images of 23,520 pixels" in assumption(shape, s)

    frozen = replace(shape, vision=replace(tower, trains=False, gated=False))
    ungated = patches * (8 * 40 + 2 * 100) * 2
    assert vision_activation_bytes(frozen, s) == {} and frozen_tower_bytes(frozen, s) == ungated
    b = estimate(frozen, s)
    states = sum(v for k, v in b.states.items() if not k.startswith("gradients"))
    assert b.moments["frozen vision tower forward (start of the forward)"] == states + ungated
    assert (
        estimate(shape, s).moments["loss (end of forward)"]
        - estimate(replace(shape, vision=None), s).moments["loss (end of forward)"]
        == 3 * block
    )

    # No bound on an image (Qwen-VL without data.image_max_pixels): rows of image tokens only.
    unbounded = replace(shape, vision=replace(tower, tokens_per_image=None, patches_per_image=None))
    assert frozen_tower_bytes(replace(unbounded, vision=replace(unbounded.vision, trains=False)), s) == (
        2 * 100 * 4 * (8 * 40 + 4 * 100) * 2
    )
    assert "data.image_max_pixels is unset" in assumption(unbounded, s)


def test_a_vl_recipes_tower_from_its_config_and_image_bounds():
    """tiny-qwen2.5-vl: 2 blocks, hidden 64, gated MLP 128, 14-pixel patches merged 2×2;
    image_max_pixels 3136 = 56×56: 16 patches, 4 tokens. Gemma 3's: 56-pixel images of 14-pixel
    patches (16), 4 tokens each (mm_tokens_per_image), ungated SigLIP MLP."""
    qwen = recipe_shape(load_recipe(ROOT / "recipes" / "quickstart-vl.yaml", [])).vision
    assert (qwen.layers, qwen.hidden, qwen.intermediate, qwen.gated, qwen.trains) == (2, 64, 128, True, True)
    assert (qwen.tokens_per_image, qwen.patches_per_image, qwen.patches_per_token) == (4, 16, 4)
    lora = load_recipe(ROOT / "recipes" / "quickstart-vl.yaml", ["lora.r=4"])
    assert not recipe_shape(lora).vision.trains  # adapters on the language model only
    gemma = recipe_shape(
        load_recipe(ROOT / "recipes" / "quickstart-vl-gemma3.yaml", ["model.freeze=[vision]"])
    )
    v = gemma.vision
    assert (v.gated, v.trains, v.tokens_per_image, v.patches_per_image) == (False, False, 4, 16)
    # Llama 3.2 Vision: 2 local + 1 global encoder layer; 2 tiles of 16 patches + the class token,
    # padded to 24; one image per row assumed (its one token per image bounds nothing).
    from ligertune.plan.vision import assumption

    mllama = recipe_shape(load_recipe(ROOT / "recipes" / "quickstart-vl-mllama.yaml", []))
    v = mllama.vision
    assert (v.layers, v.gated, v.trains, v.patches_per_image, v.images_per_row) == (3, False, True, 48, 1)
    assert mllama.layers == 3  # both decoder layer kinds
    line = assumption(mllama, Setting(micro_batch_size=2, seq_len=128))
    assert "assumes 1 image of all its tiles (48 patches) per row" in line
    assert recipe_shape(load_recipe(QUICKSTART, [])).vision is None


def test_plan_command_says_what_it_assumes_of_the_images():
    result = runner.invoke(
        app, ["plan", str(ROOT / "recipes" / "quickstart-vl.yaml"), "model.freeze=[vision]"]
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "frozen (model.freeze: vision)" in text
    assert (
        "vision tower (2 blocks, frozen: one block's forward at a time, nothing saved): assumes 32 images"
        in text
    )
    assert "frozen vision tower forward" in text
