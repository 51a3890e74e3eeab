"""Selective activation checkpointing, activation offload, and the out-of-memory stop."""

from __future__ import annotations

import copy

import pytest
import torch

from ligertune.config import load_recipe
from ligertune.distributed.runtime import Runtime
from ligertune.errors import TrainingError
from ligertune.objectives.causal_lm import CausalLM
from ligertune.training import train
from ligertune.training.memory.offload import _pack, _unpack, offloaded_forward
from ligertune.training.optim import autocast_for
from ligertune.training.step import forward_backward
from ligertune.training.transforms import apply_transforms
from tests.helpers import QUICKSTART, tiny_llama
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
    cpu = torch.randn(1024, 1024)
    assert _pack(cpu) is cpu and _unpack(_pack(cpu)) is cpu
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
    offloaded_forward(layer.forward)(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)


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


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_offload_lowers_the_peak_and_keeps_gradients_on_gpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    from ligertune.training.memory.offload import install_offload

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=8192,
        use_cache=False,
    )
    plain = LlamaForCausalLM(config).cuda()
    offloaded = copy.deepcopy(plain)
    assert install_offload(list(offloaded.model.layers)) == 6
    ids = torch.randint(0, 8192, (4, 2048), device="cuda")
    peaks, grads = [], []
    for model in (plain, offloaded):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert peaks[1] < 0.6 * peaks[0], peaks
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


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
