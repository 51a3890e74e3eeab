"""Selective activation checkpointing (every k-th layer, or a sub-module of each), activation
offload (on CPU: a no-op; its GPU tests are in tests/test_offload_gpu.py), and the
out-of-memory stop."""

from __future__ import annotations

import copy

import pytest
import torch

from ligertune.config import load_recipe
from ligertune.distributed.runtime import Runtime
from ligertune.errors import TrainingError
from ligertune.models.build import decoder_layers
from ligertune.objectives.causal_lm import CausalLM
from ligertune.training import train
from ligertune.training.optim import autocast_for
from ligertune.training.step import forward_backward
from ligertune.training.transforms import apply_transforms
from ligertune.training.transforms.offload import ActivationOffload, autocast_weight_copy
from tests.helpers import QUICKSTART, tiny_llama
from tests.test_patching import grads, random_batch, tiny_model
from tests.test_plan import saved_bytes
from tests.test_train import TINY, _packed_rows


def _grads_after_one_step(model, batch):
    runtime = Runtime(torch.device("cpu"))
    model.train()
    forward_backward(model, CausalLM(), [batch], runtime, lambda: autocast_for("fp32", runtime.device))
    return [p.grad for p in model.parameters()]


def _tiny_three_layers():
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3)
    model.config.use_cache = False
    return model


@pytest.mark.parametrize(
    "overrides, checkpointed",
    [
        (["training.activation_checkpointing=selective"], [True, False, True]),
        (
            ["training.activation_checkpointing=selective", "training.activation_checkpointing_every=3"],
            [True, False, False],
        ),
        (["training.activation_checkpointing=full"], [True, True, True]),
        (["training.activation_checkpointing=true"], [True, True, True]),  # older recipes
        (["training.activation_checkpointing=false"], [False, False, False]),
    ],
)
def test_checkpointing_modes_choose_layers_and_keep_gradients(overrides, checkpointed):
    recipe = load_recipe(QUICKSTART, TINY + overrides)
    plain = _tiny_three_layers()
    model = copy.deepcopy(plain)
    model, reports = apply_transforms(model, recipe)
    layers = model.model.layers
    assert [bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers] == checkpointed
    if any(checkpointed):
        assert f"{sum(checkpointed)} of 3 decoder layers" in reports["activation_checkpointing"]
    batch = _packed_rows(torch.Generator().manual_seed(3), 256, 32)
    for a, b in zip(_grads_after_one_step(plain, batch), _grads_after_one_step(model, batch), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_offload_is_a_no_op_on_cpu():
    recipe = load_recipe(QUICKSTART, TINY + ["training.activation_offload=true"])
    plain = _tiny_three_layers()
    model, reports = apply_transforms(copy.deepcopy(plain), recipe)
    assert "no-op" in reports["activation_checkpointing"]
    offload = ActivationOffload()
    cpu = torch.randn(1024, 1024)
    assert offload.pack(cpu) is cpu and offload.unpack(offload.pack(cpu)) is cpu
    batch = _packed_rows(torch.Generator().manual_seed(3), 256, 32)
    for a, b in zip(_grads_after_one_step(plain, batch), _grads_after_one_step(model, batch), strict=True):
        torch.testing.assert_close(a, b)


def test_offloaded_forward_round_trips_saved_tensors():
    """The wrapper's hooks see every saved tensor and give back equal values (CPU: kept as is)."""
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    ActivationOffload().layer_forward(layer.forward)(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_autocast_weight_copies_are_told_apart_from_activations():
    """Under autocast a linear layer saves its input's bf16 copy and the weight's (as a transposed
    view); only the weight's, which autocast's cache keeps anyway, is left on the GPU."""
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True) * 2.0  # an activation: not a leaf
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with torch.autocast("cpu", dtype=torch.bfloat16), hooks:
        linear(x)
    assert sorted(autocast_weight_copy(t) for t in saved) == [False, True]


# --------------------------------------------------------------------------------------------
# Checkpointing a sub-module of each layer
# --------------------------------------------------------------------------------------------

# The output projection of each sub-module (the same name in every family): how many times it
# is called tells a recompute. A pre-hook, because the recompute stops inside the last op that
# saves a tensor (checkpoint's early stop), before a forward hook would run.
_OUTPUT_LINEAR = {"attention": ("self_attn", "o_proj"), "mlp": ("mlp", "down_proj")}


def _count_calls(layers, module: str) -> list[int]:
    """A counter of the calls of `module`'s output projection, summed over `layers`."""
    calls = [0]
    outer, inner = _OUTPUT_LINEAR[module]
    for layer in layers:
        linear = getattr(getattr(layer, outer), inner)
        linear.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _transformed(model, overrides: list[str]):
    torch.manual_seed(0)  # the same LoRA initialisation in both models
    return apply_transforms(copy.deepcopy(model), load_recipe(QUICKSTART, TINY + overrides))


def _loss_and_grads(model, batch, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both models' forwards
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize(
    "model_type, module, kernels",
    [
        ("llama", "attention", "none"),
        ("llama", "mlp", "all"),
        ("qwen3", "attention", "all"),
        ("mistral", "mlp", "none"),
        ("qwen2", "attention", "none"),
        ("gemma", "attention", "none"),
        ("gemma2", "mlp", "none"),
        ("gemma3_text", "attention", "none"),
        ("phi3", "mlp", "none"),
    ],
)
def test_submodule_checkpointing_recomputes_and_keeps_losses_and_gradients(model_type, module, kernels):
    """fp32, every layer: the sub-module runs twice per step (forward, recompute in backward),
    what stays saved shrinks, and loss and gradients are those of no checkpointing; with our
    kernels patched (norm, RoPE and gated-MLP custom ops, under the Triton interpreter) too."""
    base = tiny_model(model_type)
    common = [f"kernels={kernels}"]
    plain, _ = _transformed(base, common)
    selective = [
        "training.activation_checkpointing=selective",
        "training.activation_checkpointing_every=1",
        f"training.activation_checkpointing_modules=[{module}]",
    ]
    model, reports = _transformed(base, common + selective)
    layers = decoder_layers(model)
    assert (
        f"{module} recomputed in {len(layers)} of {len(layers)} decoder layers"
        in reports["activation_checkpointing"]
    )
    batch = random_batch()
    assert saved_bytes(model, batch["input_ids"]) < saved_bytes(plain, batch["input_ids"])
    calls = _count_calls(layers, module)
    expected_loss, expected = _loss_and_grads(plain, batch)
    loss, got = _loss_and_grads(model, batch)
    assert calls[0] == 2 * len(layers)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-8, msg=name)


def test_submodule_checkpointing_every_k_layers_with_lora_and_dropout():
    """Layers 0 and 2 of 3 recompute attention under peft's LoRA (adapter dropout on: the
    recompute replays the forward's random masks); the adapters' gradients match."""
    lora = ["lora={r: 4, alpha: 8, dropout: 0.2}"]
    base = _tiny_three_layers()
    plain, _ = _transformed(base, lora)
    model, reports = _transformed(
        base,
        lora
        + [
            "training.activation_checkpointing=selective",
            "training.activation_checkpointing_modules=[attention]",
        ],
    )
    assert "attention recomputed in 2 of 3 decoder layers" in reports["activation_checkpointing"]
    calls = _count_calls(decoder_layers(model), "attention")
    batch = _packed_rows(torch.Generator().manual_seed(3), 256, 32)
    expected_loss, expected = _loss_and_grads(plain, batch)
    loss, got = _loss_and_grads(model, batch)
    assert calls[0] == 3 + 2  # three forwards, two recomputes
    assert expected and all("lora_" in name for name in expected)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-8, msg=name)


def test_submodule_checkpointing_under_compile(monkeypatch):
    """training.compile on top: each layer compiles to one graph (fullgraph: a break fails)
    with the checkpoint inside, and loss and gradients stay those of the eager model."""
    original = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self: original(self, backend="aot_eager", fullgraph=True)
    )
    torch._dynamo.reset()
    base = tiny_model("llama")
    plain, _ = _transformed(base, [])
    model, _ = _transformed(
        base,
        [
            "training.compile=true",
            "training.activation_checkpointing=selective",
            "training.activation_checkpointing_every=1",
            "training.activation_checkpointing_modules=[mlp]",
        ],
    )
    batch = random_batch()
    expected_loss, expected = _loss_and_grads(plain, batch)
    loss, got = _loss_and_grads(model, batch)
    torch._dynamo.reset()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


# --------------------------------------------------------------------------------------------
# Out of memory: a clear error with the plan's suggestion; the last checkpoint stays
# --------------------------------------------------------------------------------------------

_CALLS = {"n": 0}


def oom_on_third_forward(model, recipe):
    """A plugin (the public extension point) whose model runs out of memory in its third forward."""
    forward = model.forward
    _CALLS["n"] = 0

    def failing(*args, **kwargs):
        _CALLS["n"] += 1
        if _CALLS["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(*args, **kwargs)

    model.forward = failing
    return model


def test_out_of_memory_stops_with_the_plan_suggestion_and_keeps_the_checkpoint(tmp_path):
    recipe = load_recipe(
        QUICKSTART,
        TINY
        + [
            f"output_dir={tmp_path}",
            "training.max_steps=5",
            "checkpoint.every_steps=2",
            "training.memory_budget_gib=0.001",
            "plugins=[tests.test_checkpointing:oom_on_third_forward]",
        ],
    )
    with pytest.raises(TrainingError) as caught:
        train(recipe)
    message = str(caught.value)
    assert message.startswith("out of memory at step 3")
    assert "ligertune plan suggests:" in message and "step-2" in message
    assert (tmp_path / "checkpoints" / "step-2").is_dir()


def test_auto_on_cpu_says_what_it_chose_in_the_start_log(tmp_path):
    recipe = load_recipe(
        QUICKSTART,
        TINY
        + [
            f"output_dir={tmp_path}",
            "training.max_steps=1",
            "training.micro_batch_size=auto",
            "training.activation_checkpointing=auto",
        ],
    )
    result = train(recipe)
    assert result.steps == 1
    log = (tmp_path / "train.log").read_text()
    assert "auto: no GPU memory to plan against" in log
    assert "1 × 1 × 1 sequences" in log  # micro-batch 1, the recipe's accumulation, one process
