"""FP8 matmuls through torchao (`training.fp8`, ligertune/training/transforms.py): which linear
layers convert, the recipe rules, and a short CPU run against the same run without FP8 (torchao
emulates the float8 matmul on the CPU, so the wiring and the numerics are checked here; the speed
only on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear  # the dev extra installs torchao

from ligertune.config import RecipeError, load_recipe
from ligertune.training import train
from ligertune.training.transforms import apply_transforms, fp8_layers
from tests.helpers import PLAIN_RUN, QUICKSTART, TINY_MODEL, tiny_llama

CPU_RUN = [*TINY_MODEL, *PLAIN_RUN, "training.device=cpu", "training.precision=fp32"]


def test_only_the_decoder_layers_linears_with_dimensions_divisible_by_16_convert():
    model = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=72)  # 72: not a multiple of 16
    chosen, left_out = fp8_layers(model)
    layer = model.model.layers[0]
    assert {layer.self_attn.q_proj, layer.self_attn.o_proj} <= chosen
    assert layer.mlp.gate_proj not in chosen and layer.mlp.down_proj not in chosen
    assert model.lm_head not in chosen
    assert left_out == 2 * 3  # gate, up and down of each of the 2 layers
    assert len(chosen) == 2 * 4  # q, k, v, o


def test_the_transform_converts_them_and_says_so(tmp_path):
    recipe = load_recipe(QUICKSTART, [*CPU_RUN, "training.fp8=rowwise", f"output_dir={tmp_path}"])
    model = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128)
    model, reports = apply_transforms(model, recipe)
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(model.lm_head) is nn.Linear
    assert reports["fp8"].startswith("fp8 (rowwise scaling): 14 linear layers of the decoder layers")
    assert "without training.compile" in reports["fp8"]


@pytest.mark.parametrize(("scaling", "strategy", "gathered"), [
    ("tensorwise", "fsdp", True), ("rowwise", "fsdp", False), ("tensorwise", "ddp", False),
])  # fmt: skip
def test_tensorwise_fp8_is_all_gathered_in_float8_where_the_strategy_can(
    tmp_path, scaling, strategy, gathered
):
    """Under FSDP2 with tensorwise scales the layers' weights are gathered in float8 (one scale
    per weight suits a shard); rowwise scales and DDP (no gather) keep the bf16 path."""
    overrides = [
        *CPU_RUN,
        f"training.fp8={scaling}",
        f"parallel.strategy={strategy}",
        f"output_dir={tmp_path}",
    ]
    model, reports = apply_transforms(
        tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128), load_recipe(QUICKSTART, overrides)
    )
    flags = {m.config.enable_fsdp_float8_all_gather for m in model.modules() if isinstance(m, Float8Linear)}
    assert flags == {gathered}
    assert ("all-gathered in float8 by FSDP2" in reports["fp8"]) is gathered


@pytest.mark.slow
def test_a_short_run_with_fp8_follows_the_run_without(tmp_path):
    steps = ["training.max_steps=6", "training.lr=1e-3"]
    plain = train(load_recipe(QUICKSTART, [*CPU_RUN, *steps, f"output_dir={tmp_path / 'plain'}"]))
    for scaling in ("rowwise", "tensorwise"):
        overrides = [*CPU_RUN, *steps, f"training.fp8={scaling}", f"output_dir={tmp_path / scaling}"]
        fp8 = train(load_recipe(QUICKSTART, overrides))
        assert any(isinstance(m, Float8Linear) for m in fp8.model.modules())
        # float8 e4m3 keeps 3 mantissa bits: the losses agree to a few percent, not to fp32 rounding.
        assert fp8.final_loss == pytest.approx(plain.final_loss, rel=5e-2), scaling
        assert fp8.final_loss != plain.final_loss, scaling  # the float8 path really ran


def test_fp8_on_the_cpu_says_it_is_emulated_before_the_run_through_the_cli(tmp_path):
    """FP8 on a CPU is torchao's emulation: slower than fp32 for nothing (129 s for two quickstart
    steps). It still runs (this file's tests use it), with a warning first (a warning: -q shows it too); so
    does DeepSpeed on the CPU, whose op build takes a minute or more in silence."""
    from typer.testing import CliRunner

    from ligertune.cli import app
    from ligertune.config.environment_rules import machine_warnings

    args = ["train", str(QUICKSTART), *CPU_RUN, "training.fp8=rowwise", "training.max_steps=1"]
    result = CliRunner().invoke(app, [*args, f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "warning: training.fp8: rowwise on the CPU is emulated by torchao" in result.output
    deepspeed = load_recipe(QUICKSTART, ["parallel.strategy=deepspeed", "training.device=cpu"])
    assert [w.split(" on the CPU")[0] for w in machine_warnings(deepspeed)] == [
        "parallel.strategy: deepspeed"
    ]
    assert machine_warnings(load_recipe(QUICKSTART, ["training.device=cpu"])) == []


def test_fp8_recipe_rules():
    with pytest.raises(RecipeError, match="training.fp8: got 'e5m2'"):
        load_recipe(QUICKSTART, ["training.fp8=e5m2"])
    with pytest.raises(RecipeError, match="training.fp8: not supported with parallel.strategy deepspeed"):
        load_recipe(
            QUICKSTART, ["training.fp8=rowwise", "parallel.strategy=deepspeed", "training.precision=fp32"]
        )


@pytest.mark.gpu
def test_gpu_fp8_with_compile_trains_at_bf16_parity(tmp_path):
    """A 4-layer, hidden-1024 Llama in bf16 with every kernel, compiled, for 30 steps: FP8 rowwise
    against the same run without FP8."""
    common = [
        "model.config_overrides={hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: 4, "
        "num_attention_heads: 16, num_key_value_heads: 4}",
        "data.max_seq_len=1024",
        *PLAIN_RUN[1:],
        "kernels=all",
        "training.compile=true",
        "training.max_steps=30",
        "training.micro_batch_size=4",
        "training.lr=3e-4",
        "training.warmup_steps=5",
    ]
    runs = {}
    for fp8 in ("none", "rowwise"):
        runs[fp8] = train(
            load_recipe(QUICKSTART, [*common, f"training.fp8={fp8}", f"output_dir={tmp_path / fp8}"])
        ).final_loss
    assert runs["rowwise"] == pytest.approx(runs["none"], rel=3e-2), runs
    assert torch.cuda.is_available()
