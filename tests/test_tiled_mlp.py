"""``training.tiled_mlp``: the decoder MLP over tiles of tokens, recomputed tile by tile in
backward (`ligertune.training.transforms.tiled_mlp`): exact against the untiled MLP, with our
gated kernels, LoRA, activation checkpointing and FSDP2; its rules; the memory plan's count."""

from __future__ import annotations

import pytest
import torch

from ligertune.config import RecipeError, load_recipe
from ligertune.models.build import decoder_layers
from ligertune.training import train
from tests.helpers import QUICKSTART
from tests.test_checkpointing import _loss_and_grads, _tiny_three_layers, _transformed
from tests.test_patching import random_batch, tiny_model
from tests.test_train import TINY, _packed_rows, tiny_recipe, train_losses


def _down_proj_calls(model) -> list[int]:
    """A counter of the down projections' calls over all decoder layers (each call: one tile)."""
    calls = [0]
    for layer in decoder_layers(model):
        layer.mlp.down_proj.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _assert_same(got, expected, loss, expected_loss):
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "kernels, tile",
    [("none", 5), ("none", 8), ("none", "true"), ("none", 10**6), ("all", 5), ("all", 10**6)],
)
def test_tiled_mlp_gives_the_untiled_loss_and_every_gradient(kernels, tile):
    """fp32: 2 rows × 8 tokens = 16 tokens per MLP call, in tiles of 5 (not dividing 16), 8,
    the hidden size (64: one tile) and a million (one tile); with the swiglu kernel patched
    (under the interpreter: two of them) and without. The input's gradient reaches the embedding's, so it is checked too; the forward
    runs the tiles once in forward and once more in backward."""
    base = tiny_model("llama")
    plain, _ = _transformed(base, [f"kernels={kernels}"])
    model, reports = _transformed(base, [f"kernels={kernels}", f"training.tiled_mlp={tile}"])
    assert reports["tiled_mlp"].startswith("tiled MLP: 2 of 2 decoder layers")
    if kernels == "all":
        assert all(layer.mlp.__dict__["_ligertune_kernel"] == "swiglu" for layer in decoder_layers(model))
    batch = random_batch()
    calls = _down_proj_calls(model)
    expected_loss, expected = _loss_and_grads(plain, batch)
    loss, got = _loss_and_grads(model, batch)
    tiles = -(-16 // (64 if tile == "true" else tile))
    assert calls[0] == 2 * 2 * tiles  # layers × (forward, backward) × tiles
    _assert_same(got, expected, loss, expected_loss)
    with torch.no_grad():  # evaluation: plain tiles, no Function
        torch.testing.assert_close(model(**batch).logits, plain(**batch).logits, rtol=1e-6, atol=1e-6)


def _lora_model(base, overrides: list[str]):
    """`base` under peft LoRA on every projection, with lora_B drawn at random (peft starts it
    at zero, where lora_A's gradients are zero too), the same in every call."""
    model, _ = _transformed(base, overrides)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model


LORA = "lora={r: 4, alpha: 8, dropout: %s, target_modules: all-linear}"


def test_tiled_mlp_with_lora_and_full_checkpointing():
    """peft LoRA on every projection, with and without full checkpointing: loss and the
    adapters' gradients are the untiled model's. Under checkpointing each tile runs three times
    per layer (forward, the layer's recompute, the tiled backward), never more."""
    base = _tiny_three_layers()
    batch = _packed_rows(torch.Generator().manual_seed(3), 256, 32)
    expected_loss, expected = _loss_and_grads(_lora_model(base, [LORA % 0.0]), batch)
    assert {"mlp.gate_proj.lora_A", "mlp.up_proj.lora_B", "mlp.down_proj.lora_A"} <= {
        ".".join(name.split(".")[-5:-2]) for name in expected
    }
    for checkpointing, passes in (("none", 2), ("full", 3)):
        model = _lora_model(
            base, [LORA % 0.0, "training.tiled_mlp=48", f"training.activation_checkpointing={checkpointing}"]
        )
        calls = _down_proj_calls(model)
        loss, got = _loss_and_grads(model, batch)
        assert calls[0] == 3 * passes * 3  # 3 layers, 128 tokens in 3 tiles of ≤ 48
        _assert_same(got, expected, loss, expected_loss)


def test_tiled_backward_replays_the_forwards_dropout_masks():
    """Adapter dropout inside the MLP: the backward's tiles draw the forward's masks again. The
    reference runs the same tiles, in the same order, with autograd keeping every graph (the
    untiled MLP draws its masks in another order, so it is no reference here)."""
    base = _tiny_three_layers()
    batch = _packed_rows(torch.Generator().manual_seed(3), 256, 32)
    reference = _lora_model(base, [LORA % 0.3])
    for layer in decoder_layers(reference):
        forward = layer.mlp.forward
        layer.mlp.forward = lambda x, forward=forward: torch.cat(
            [forward(t) for t in x.reshape(-1, x.shape[-1]).split(48)]
        ).view_as(x)
    expected_loss, expected = _loss_and_grads(reference, batch)
    model = _lora_model(base, [LORA % 0.3, "training.tiled_mlp=48"])
    loss, got = _loss_and_grads(model, batch)
    _assert_same(got, expected, loss, expected_loss)


def test_training_loop_gives_the_same_losses_tiled(tmp_path):
    """The quickstart's tiny model (our kernels on) for 3 steps, untiled and in 40-token tiles."""
    train(tiny_recipe(tmp_path / "plain", "training.max_steps=3"))
    train(tiny_recipe(tmp_path / "tiled", "training.max_steps=3", "training.tiled_mlp=40"))
    plain, tiled = train_losses(tmp_path / "plain"), train_losses(tmp_path / "tiled")
    assert plain.keys() == tiled.keys() == {1, 2, 3}
    for step in plain:
        assert tiled[step] == pytest.approx(plain[step], rel=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.tiled_mlp=0"], "positive number of tokens per tile"),
        (["training.tiled_mlp=auto"], "positive number of tokens per tile"),
        (["training.compile=true"], "training.tiled_mlp: not with training.compile"),
        (
            [
                "training.activation_checkpointing=selective",
                "training.activation_checkpointing_modules=[mlp]",
            ],
            "training.tiled_mlp: the tiled MLP keeps only its input already",
        ),
        (
            ["parallel={strategy: deepspeed}", "training.precision=bf16-mixed"],
            "training.tiled_mlp: not supported with parallel.strategy deepspeed",
        ),
    ],
)
def test_tiled_mlp_rules_name_the_key(overrides, message):
    tiled = [] if "tiled_mlp" in overrides[0] else ["training.tiled_mlp=true"]
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        load_recipe(QUICKSTART, TINY + tiled + overrides)


def test_a_model_without_a_dense_mlp_is_refused_naming_the_key():
    model = tiny_model("llama")
    for layer in decoder_layers(model):
        del layer.mlp
    with pytest.raises(RecipeError, match="training.tiled_mlp: LlamaForCausalLM has no dense gated MLP"):
        _transformed(model, ["training.tiled_mlp=true"])


def test_fsdp2_and_ddp_on_two_ranks_match_one_process_untiled(tmp_path):
    """Two gloo ranks under FSDP2 (the MLP's forward called inside its backward with the
    layer's gathered weights): tiled, tiled under full checkpointing, and tiled with LoRA adapters
    on the MLP; under DDP (whose reducer must see one gradient per weight): tiled. Each gives one
    untiled process's losses and gradient norms."""
    from tests.test_distributed import FP32_RTOL, SHAPE_1, SHAPE_2, assert_losses_close, launch_worker, losses
    from tests.test_distributed import TINY as DISTRIBUTED

    common = DISTRIBUTED + ["training.max_steps=2", "data.validation_fraction=0.0", "training.tiled_mlp=48"]
    lora = ["lora={r: 4, alpha: 8, target_modules: [gate_proj, up_proj, down_proj]}", "training.lr=1e-2"]
    references = {"plain": [], "checkpointed": ["training.activation_checkpointing=full"], "lora": lora}
    # run → (strategy, the one-process reference it must match)
    runs = {
        "fsdp": ("fsdp", "plain"),
        "fsdp-checkpointed": ("fsdp", "checkpointed"),
        "fsdp-lora": ("fsdp", "lora"),
    }
    runs["ddp"] = ("ddp", "plain")
    output = launch_worker(
        [
            common
            + SHAPE_2
            + references[reference]
            + [f"parallel.strategy={strategy}", f"output_dir={tmp_path / run}"]
            for run, (strategy, reference) in runs.items()
        ],
        tmp_path,
    )
    assert output.count("tiled MLP: 2 of 2 decoder layers, 48 tokens per tile") == len(runs)
    for name, extra in references.items():
        overrides = common + SHAPE_1 + extra + ["training.tiled_mlp=false", f"output_dir={tmp_path / name}"]
        train(load_recipe(QUICKSTART, overrides))
    for run, (_, reference) in runs.items():
        for key in ("loss", "grad_norm"):
            expected = losses(tmp_path / reference, key=key)
            assert_losses_close(losses(tmp_path / run, key=key), expected, FP32_RTOL, f"{run} {key}")


def test_the_plan_counts_the_mlp_intermediates_of_one_tile():
    """Llama-3-8B (hidden 4096, intermediate 14336), one 131,072-token row, bf16, our kernels
    (swiglu: gate, up and the product saved, 3 × 14336 × 2 = 86,016 bytes a token; one
    gate/up-sized gradient in backward). Untiled, a layer saves those over every token and its
    backward holds the gradient over every token; tiled (true: 4096-token tiles), both are one
    tile's, and a full-checkpointing recompute keeps none of them."""
    from ligertune.plan.activations import layer_activation_bytes, layer_backward_bytes, recomputed_bytes
    from ligertune.plan.setting import Setting
    from tests.test_plan_cp import OURS, SHAPE

    def at(tiled, kernels=OURS, checkpointing="none"):
        return Setting(1, 131072, checkpointing=checkpointing, kernels=kernels, tiled_mlp=tiled)

    untiled, tiled = at(False), at(True)
    assert layer_activation_bytes(SHAPE, untiled) - layer_activation_bytes(SHAPE, tiled) == 11_274_289_152
    # Untiled, the MLP's moment: 131072 × (4096 + 14336) × 2 (the arriving gradient and
    # down_proj's input gradient).
    assert layer_backward_bytes(SHAPE, untiled) == 4_831_838_208
    # Tiled, the MLP's moment is 131072 × 4096 × 2 + 4096 × 14336 × 2 + 4096 × 3 × 14336 × 2 (the
    # tile's recomputed intermediates) = 1,543,503,872; the attention's is larger: the arriving
    # gradient plus q's, k's and v's, 131072 × (4096 + 48 × 128) × 2, less the post-norm output
    # the MLP kept, 131072 × 4096 × 2.
    assert layer_backward_bytes(SHAPE, tiled) == layer_backward_bytes(SHAPE, at(4096)) == 1_610_612_736
    # A tile longer than the row: one tile of every token, the intermediates on top of the gradient.
    assert layer_backward_bytes(SHAPE, at(10**9)) == 4_831_838_208 + 11_274_289_152
    full = recomputed_bytes(SHAPE, at(False, checkpointing="full"))
    assert full - recomputed_bytes(SHAPE, at(True, checkpointing="full")) == 11_274_289_152
    # Without the fused kernel act(gate) is saved too (4 tensors) and the product's backward
    # holds two gradients: 131072 × 4096 × 2 + 4096 × 2 × 14336 × 2 + 4096 × 4 × 14336 × 2.
    assert layer_backward_bytes(SHAPE, at(True, kernels=frozenset())) == 1_778_384_896
