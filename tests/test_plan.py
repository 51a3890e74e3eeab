"""The memory plan (`ligertune.training.memory`, ``ligertune plan``) against hand counts, against
what autograd really saves (measured on CPU), and on the GPU against the measured peak."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from ligertune.cli import app
from ligertune.config import load_recipe
from ligertune.patching.apply import patch_model
from ligertune.training.memory.auto import resolve_auto
from ligertune.training.memory.choose import base_setting
from ligertune.training.memory.estimate import (
    GIB,
    Setting,
    estimate,
    head_fixed_bytes,
    layer_activation_bytes,
    model_saved,
    state_bytes,
)
from ligertune.training.memory.shape import model_shape, recipe_shape
from tests.helpers import QUICKSTART, ROOT, TINY_MODEL

OURS = frozenset({"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"})
H, HEADS, KV, D, I, V = 64, 4, 2, 16, 160, 320  # noqa: E741 (the hand-counted model)
B, S = 2, 32
T = B * S  # tokens


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
    fsdp = Setting(micro_batch_size=B, seq_len=S, precision="bf16-mixed", strategy="fsdp", world_size=4)
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
    "kernels, precision",
    [("none", "fp32"), ("none", "bf16"), ("ours", "fp32")],
)
def test_saved_activations_match_a_measurement(kernels, precision):
    """Per-layer bytes: the 3-layer model's saved bytes minus the 2-layer one's (everything
    outside the layers cancels), within 3% of the plan's; the whole model's within 3% too.
    Kernels on run their Triton code under the CPU interpreter (conftest), so what is measured
    is what the kernels' autograd Functions save."""
    if kernels == "ours" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (the reference path saves what eager saves)")
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    measured = {}
    for layers in (2, 3):
        model = tiny(layers).to(dtype)
        if kernels == "ours":
            patch_model(model, "all")
        model.train()
        measured[layers] = saved_bytes(model, ids)
    shape = model_shape(tiny(2))
    s = Setting(
        micro_batch_size=B, seq_len=S, precision=precision, kernels=OURS if kernels == "ours" else frozenset()
    )
    per_layer = layer_activation_bytes(shape, s)
    assert measured[3] - measured[2] == pytest.approx(per_layer, rel=0.03)
    total = 2 * per_layer + sum(t.bytes(T) for t in model_saved(shape, s)) + head_fixed_bytes(shape, s)
    assert measured[2] == pytest.approx(total, rel=0.03)


def test_kernels_save_less_than_eager_by_the_listed_tensors():
    """The difference the kernels make per layer is what the listing says it is: the norms'
    fp32 upcast and x·rstd twice less x itself, and one MLP activation (bf16)."""
    shape = model_shape(tiny(2))
    eager = layer_activation_bytes(shape, Setting(micro_batch_size=B, seq_len=S))
    ours = layer_activation_bytes(shape, Setting(micro_batch_size=B, seq_len=S, kernels=OURS))
    assert eager - ours == 2 * T * H * 4 + T * I * 2


# --------------------------------------------------------------------------------------------
# The plan against the published measurements, the choices, auto
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe, overrides, world, measured_gib",
    [
        ("llama3.2-1b-alpaca-bench.yaml", [], 1, 29.8),
        ("llama3.2-1b-alpaca-bench.yaml", ["kernels=none"], 1, 63.7),
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
    """docs/benchmarks.md's H200 peaks (allocated, torch 2.11): a regression check of the model
    against numbers measured before it existed; scripts/gpu_plan_accuracy.sh remeasures."""
    r = load_recipe(ROOT / "recipes" / recipe, overrides)
    predicted = estimate(recipe_shape(r), base_setting(r, world)).peak / GIB
    assert predicted == pytest.approx(measured_gib, rel=0.10)


def test_checkpointing_and_offload_lower_the_estimate():
    r = load_recipe(ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml", [])
    shape, base = recipe_shape(r), base_setting(r, 1)
    from dataclasses import replace

    peaks = [
        estimate(shape, replace(base, checkpointing=c, offload=o)).peak
        for c, o in (("none", False), ("selective", False), ("none", True), ("full", False))
    ]
    assert peaks[0] > peaks[1] > peaks[3] and peaks[0] > peaks[2]


runner = CliRunner()


def test_plan_command_fits_and_exit_2_naming_a_fix():
    recipe = str(ROOT / "recipes" / "llama3.2-1b-alpaca-bench.yaml")
    ok = runner.invoke(app, ["plan", recipe, "--gpu-memory", "80GiB"])
    assert ok.exit_code == 0, ok.output
    assert "fastest that fits" in ok.output and "does not fit" in ok.output
    assert "loss head" in ok.output and "AdamW moments" in ok.output
    small = runner.invoke(app, ["plan", recipe, "--gpu-memory", "6GiB"])
    assert small.exit_code == 2, small.output
    assert "nothing fits" in small.output and "cheapest change" in small.output


def test_plan_command_needs_a_target_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is the default target")
    result = runner.invoke(app, ["plan", str(QUICKSTART)])
    assert result.exit_code == 2 and "--gpu-memory" in result.output


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
    train(recipe)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    measured = max(r["peak_mem_allocated_gib"] for r in records if r.get("peak_mem_allocated_gib"))
    predicted = estimate(recipe_shape(recipe), base_setting(recipe, 1)).peak / GIB
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
