"""Sharded initialisation (``parallel.sharded_init``) under real 2-process torchrun launches on
the CPU (gloo): the model is built on the meta device, sharded, and its shards filled from rank
0, with weights bit-for-bit those of a plain one-process build; it trains to the same losses.

The file is also the worker: ``python tests/test_sharded_init.py SPEC.json`` under torchrun
(the repository root on PYTHONPATH for ``tests.*``). For each case of the spec it builds the
model through the runtime as the trainer does, records what the parameters were before and after
`wrap`, gathers the full state dict and the buffers, and saves them for the test to compare.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ligertune.config import RecipeError, load_recipe
from ligertune.models.build import build_model
from ligertune.training.transforms import state_transforms
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL
from tests.test_distributed import FP32_RTOL, _env, assert_losses_close, losses

TINY = [*TINY_MODEL, *PLAIN_RUN, "training.device=cpu", "data.validation_fraction=0.0"]
TWO_RANKS = [
    "parallel.strategy=fsdp",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
]
ZERO3 = ["parallel.strategy=deepspeed", "training.precision=fp32"]
ONE_RANK = ["training.micro_batch_size=4", "training.gradient_accumulation_steps=2"]
# Adapters on every linear layer; trained in full, the embeddings (peft's ModulesToSaveWrapper:
# another renaming; not with tied embeddings, which peft warns about); DoRA's magnitudes are
# computed from the base weights at init.
LORA = ["lora.r=4", "lora.alpha=8", "lora.dropout=0.1"]
SAVE = ["lora.modules_to_save=[embed_tokens]"]
DORA = ["lora.use_dora=true"]


def _launch(runs: list, work: Path) -> str:
    """`launch_worker` of test_distributed.py, with this file as the worker: a list of override
    lists trains those runs, a list of {"overrides": [...]} builds them (`_build`)."""
    spec = work / f"spec-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps(runs))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        str(spec),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def _one_process_state(overrides: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The plain build's state dict and buffers (non-persistent ones included), through the
    transforms that change the state (LoRA's) as the trainer applies them."""
    recipe = load_recipe(QUICKSTART, overrides)
    torch.manual_seed(recipe.seed)
    model = state_transforms(recipe)(build_model(recipe, torch.device("cpu")))
    return model.state_dict(), dict(model.named_buffers())


def _assert_bitwise_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, (what, name)
        assert torch.equal(got[name], value), f"{what}: {name} differs"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """One launch: the random-init build, a build from saved weights (with tied embeddings, so the
    tie survives sharding), and the plain fsdp build as the control; the same with LoRA."""
    root = tmp_path_factory.mktemp("sharded")
    weights = root / "weights"
    recipe = load_recipe(QUICKSTART, TINY + ["model.config_overrides.tie_word_embeddings=true"])
    torch.manual_seed(7)
    model = build_model(recipe, torch.device("cpu"))
    with torch.no_grad():  # weights no seeded init would give
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    model.save_pretrained(weights)
    pretrained = ["model.config=null", f"model.name_or_path={weights}"]
    cases = {
        "random": TINY + TWO_RANKS,
        "pretrained": TINY + TWO_RANKS + pretrained,
        "plain": TINY + TWO_RANKS + ["parallel.sharded_init=false"],
        "zero3-random": TINY + TWO_RANKS + ZERO3,
        "zero3-pretrained": TINY + TWO_RANKS + ZERO3 + pretrained,
    }
    lora = {"lora-random": LORA + SAVE, "lora-pretrained": LORA + DORA + pretrained}
    for name, overrides in lora.items():  # each sharded, and built whole as the control
        cases[name] = TINY + TWO_RANKS + overrides
        cases[f"{name}-plain"] = TINY + TWO_RANKS + overrides + ["parallel.sharded_init=false"]
    cases = {name: overrides + [f"output_dir={root / name}"] for name, overrides in cases.items()}
    _launch([{"overrides": o} for o in cases.values()], root)
    return {"root": root, "weights": weights, **{n: root / n for n in cases}}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["random", "pretrained"])
def test_sharded_init_builds_on_meta_and_equals_the_plain_build_bit_for_bit(built, case):
    report = json.loads((built[case] / "report-rank0.json").read_text())
    report1 = json.loads((built[case] / "report-rank1.json").read_text())
    for rank_report in (report, report1):
        # Nothing of the model existed before wrap: every parameter and buffer was on meta.
        assert rank_report["params_before_wrap"] == ["meta"]
        assert rank_report["buffers_before_wrap"] == ["meta"]
        # After wrap: DTensors, each rank holding its half of every sharded dimension.
        assert rank_report["all_dtensor"] and rank_report["local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert rank_report["sharded_init"] is True
    overrides = json.loads((built[case] / "overrides.json").read_text())
    expected_state, expected_buffers = _one_process_state(overrides)
    state = torch.load(built[case] / "full_state.pt", weights_only=True)
    _assert_bitwise_equal(state, expected_state, case)
    # Rotary inv_freq is a non-persistent buffer (in no state dict): broadcast from rank 0.
    for rank in (0, 1):
        buffers = torch.load(built[case] / f"buffers-rank{rank}.pt", weights_only=True)
        assert any("inv_freq" in name for name in buffers)
        _assert_bitwise_equal(buffers, expected_buffers, f"{case} buffers rank {rank}")
    if case == "pretrained":
        # The tie survives: one parameter, shared by the embedding and the head.
        assert report["tied"] is True and report1["tied"] is True


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero3-random", "zero3-pretrained"])
def test_zero3_sharded_init_builds_inside_zero_init_and_equals_the_plain_build(built, case):
    for rank in (0, 1):
        report = json.loads((built[case] / f"report-rank{rank}.json").read_text())
        # Partitioned from construction on: no rank ever held a whole parameter set.
        assert report["sharded_init"] is True and report["zero3_partitioned"] is True
        assert report["local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert report["tied"] is (case == "zero3-pretrained")
    overrides = json.loads((built[case] / "overrides.json").read_text())
    expected_state, expected_buffers = _one_process_state(overrides)
    state = torch.load(built[case] / "full_state.pt", weights_only=True)
    if case == "zero3-pretrained":  # DeepSpeed's consolidated state dict names a tied weight once
        expected_state = {k: v for k, v in expected_state.items() if k in state}
        assert "model.embed_tokens.weight" in state
    _assert_bitwise_equal(state, expected_state, case)
    for rank in (0, 1):
        buffers = torch.load(built[case] / f"buffers-rank{rank}.pt", weights_only=True)
        _assert_bitwise_equal(buffers, expected_buffers, f"{case} buffers rank {rank}")


@pytest.mark.slow
def test_the_plain_fsdp_build_is_still_available(built):
    report = json.loads((built["plain"] / "report-rank0.json").read_text())
    assert report["params_before_wrap"] == ["cpu"] and report["sharded_init"] is False
    overrides = json.loads((built["plain"] / "overrides.json").read_text())
    _assert_bitwise_equal(
        torch.load(built["plain"] / "full_state.pt", weights_only=True),
        _one_process_state(overrides)[0],
        "plain",
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lora-random", "lora-pretrained"])
def test_lora_sharded_init_equals_the_plain_lora_build_bit_for_bit(built, case):
    """The peft model built on meta, sharded and filled from rank 0's build put through the same
    LoRA transform: every parameter (base weights under peft's names, the adapters' seeded init,
    the modules_to_save copy, DoRA's magnitudes from tied saved weights) equals the sharded_init=false run's and a
    one-process build's, bit for bit."""
    for rank in (0, 1):
        report = json.loads((built[case] / f"report-rank{rank}.json").read_text())
        assert report["params_before_wrap"] == ["meta"] and report["sharded_init"] is True
        assert report["all_dtensor"] and report["local_fraction"] == pytest.approx(0.5, abs=0.02)
    plain = json.loads((built[f"{case}-plain"] / "report-rank0.json").read_text())
    assert plain["params_before_wrap"] == ["cpu"] and plain["sharded_init"] is False
    state = torch.load(built[case] / "full_state.pt", weights_only=True)
    _assert_bitwise_equal(
        state, torch.load(built[f"{case}-plain"] / "full_state.pt", weights_only=True), case
    )
    expected_state, expected_buffers = _one_process_state(
        json.loads((built[case] / "overrides.json").read_text())
    )
    _assert_bitwise_equal(state, expected_state, f"{case} vs one process")
    for rank in (0, 1):
        buffers = torch.load(built[case] / f"buffers-rank{rank}.pt", weights_only=True)
        _assert_bitwise_equal(buffers, expected_buffers, f"{case} buffers rank {rank}")
    # What was compared is peft's model: wrapped base weights, random A (B starts at zero).
    lora_a = [v for k, v in state.items() if ".lora_A." in k]
    assert any(k.endswith("q_proj.base_layer.weight") for k in state) and lora_a
    assert all(a.abs().sum() > 0 for a in lora_a)
    assert any(".modules_to_save." in k for k in state) is (case == "lora-random")
    assert any("lora_magnitude_vector" in k for k in state) is (case == "lora-pretrained")


@pytest.mark.slow
def test_lora_sharded_init_trains_to_the_plain_lora_losses(tmp_path):
    """Three steps of LoRA (dropout on, so the RNG state every rank continues from matters) from
    saved weights under fsdp: sharded init and the whole-model build give the same losses and
    gradient norms."""
    weights = tmp_path / "weights"
    torch.manual_seed(0)
    build_model(load_recipe(QUICKSTART, TINY), torch.device("cpu")).save_pretrained(weights)
    run = [
        "training.max_steps=3",
        "training.warmup_steps=1",
        "model.config=null",
        f"model.name_or_path={weights}",
    ]
    runs = {"sharded": ["parallel.sharded_init=true"], "plain": ["parallel.sharded_init=false"]}
    _launch(
        [TINY + TWO_RANKS + LORA + run + o + [f"output_dir={tmp_path / n}"] for n, o in runs.items()],
        tmp_path,
    )
    for key in ("loss", "grad_norm"):
        got, expected = losses(tmp_path / "sharded", key=key), losses(tmp_path / "plain", key=key)
        assert sorted(got) == [1, 2, 3] and got == expected, key


@pytest.mark.slow
def test_sharded_init_trains_to_the_one_process_losses(tmp_path):
    """Four steps from saved weights under fsdp and ZeRO-3 with sharded init match one process at
    the same global batch: losses and gradient norms. (From a random init, the strategy tests of
    tests/test_distributed.py run with sharded init too: it is the default.)"""
    from ligertune.training import train

    weights = tmp_path / "weights"
    torch.manual_seed(0)  # another init than the recipe seed's: "pretrained" weights
    build_model(load_recipe(QUICKSTART, TINY), torch.device("cpu")).save_pretrained(weights)
    run = ["training.max_steps=4", "training.warmup_steps=2", "training.adam_eps=1e-6"]
    run += ["model.config=null", f"model.name_or_path={weights}"]
    reference = tmp_path / "one"
    train(load_recipe(QUICKSTART, TINY + ONE_RANK + run + [f"output_dir={reference}"]))
    sharded = {"fsdp": tmp_path / "fsdp", "deepspeed": tmp_path / "zero3"}
    strategy = {"fsdp": [], "deepspeed": ZERO3}
    _launch(
        [
            TINY + TWO_RANKS + strategy[n] + run + ["parallel.sharded_init=true", f"output_dir={d}"]
            for n, d in sharded.items()
        ],
        tmp_path,
    )
    for name, directory in sharded.items():
        assert_losses_close(losses(directory), losses(reference), FP32_RTOL, name)
        assert_losses_close(
            losses(directory, key="grad_norm"), losses(reference, key="grad_norm"), FP32_RTOL, name
        )
        start = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()][0]
        assert start["world_size"] == 2 and start["strategy"] == name
        assert start["parameters"] == sum(t.numel() for t in _one_process_state(TINY)[0].values())


def test_sharded_init_true_needs_a_sharding_strategy():
    for overrides in (
        ["parallel.strategy=ddp"],
        ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"],
    ):
        with pytest.raises(RecipeError, match="parallel.sharded_init: true, but parallel.strategy"):
            load_recipe(QUICKSTART, [*overrides, "parallel.sharded_init=true"])
    auto = {
        "fsdp": True,
        "ddp": False,
        "none": False,
    }
    for strategy, expected in auto.items():
        assert load_recipe(QUICKSTART, [f"parallel.strategy={strategy}"]).parallel.shards_at_init is expected
    offload = ["parallel.strategy=fsdp", "parallel.fsdp.cpu_offload=true"]
    assert load_recipe(QUICKSTART, offload).parallel.shards_at_init is False  # not supported yet
    with pytest.raises(RecipeError, match="not supported with parallel.fsdp.cpu_offload yet"):
        load_recipe(QUICKSTART, [*offload, "parallel.sharded_init=true"])
    stage3 = load_recipe(QUICKSTART, ["parallel.strategy=deepspeed", "training.precision=fp32"])
    assert stage3.parallel.shards_at_init is True
    assert (
        load_recipe(
            QUICKSTART, ["parallel.strategy=fsdp", "parallel.sharded_init=false"]
        ).parallel.shards_at_init
        is False
    )


def test_lora_shards_at_init_and_what_refuses_it():
    """LoRA no longer turns sharded init off under fsdp; what cannot shard with it is refused by
    name: a quantised base (QLoRA) under fsdp, and LoRA under DeepSpeed at all. Adapters on the
    experts' 3-D weights shard at init too (tests/test_moe_lora.py trains them under fsdp)."""
    lora = ["lora.r=4", "parallel.strategy=fsdp"]
    assert load_recipe(QUICKSTART, lora).parallel.shards_at_init is True
    assert load_recipe(QUICKSTART, [*lora, "parallel.sharded_init=true"]).parallel.shards_at_init is True
    assert load_recipe(QUICKSTART, [*lora, "parallel.sharded_init=false"]).parallel.shards_at_init is False
    refused = {
        "model.quantize=4bit": "model.quantize: not supported with parallel.strategy fsdp",
        "parallel.strategy=deepspeed": "lora: not supported with parallel.strategy deepspeed",
    }
    experts = load_recipe(QUICKSTART, [*lora, "lora.dropout=0", "lora.target_parameters=experts"])
    assert experts.parallel.shards_at_init is True
    for override, message in refused.items():
        with pytest.raises(RecipeError, match=message):
            load_recipe(QUICKSTART, [*lora, "parallel.sharded_init=true", "lora.dropout=0", override])


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------


def _build(overrides: list[str]) -> None:
    """Build and wrap as `Trainer._setup_model` does; write what the test checks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ligertune.distributed import create_runtime
    from ligertune.training.optim import build_optimizer
    from ligertune.training.transforms import apply_transforms, state_transforms

    recipe = load_recipe(QUICKSTART, overrides)
    out = recipe.run_dir
    out.mkdir(parents=True, exist_ok=True)
    runtime = create_runtime(recipe)
    torch.manual_seed(recipe.seed)
    model = runtime.build_model(recipe)
    params = list(model.parameters())
    report = {
        "sharded_init": runtime.sharded_init,
        "params_before_wrap": sorted({p.device.type for p in params}),
        "buffers_before_wrap": sorted({b.device.type for b in model.buffers()}),
        # ZeRO-3's zero.Init: every parameter an empty placeholder, its partition in ds_tensor.
        "zero3_partitioned": all(hasattr(p, "ds_tensor") and p.numel() == 0 for p in params),
    }
    if report["zero3_partitioned"]:
        report["local_fraction"] = sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
    model, _ = apply_transforms(model, recipe)
    model, _ = runtime.wrap(
        model, lambda module, where: build_optimizer(module, recipe.training, where), state_transforms(recipe)
    )
    hf_model = runtime.unwrap(model)
    if recipe.parallel.strategy == "fsdp":
        params = list(model.parameters())
        report["all_dtensor"] = all(isinstance(p, DTensor) for p in params)
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        report["local_fraction"] = local / sum(p.numel() for p in params)
    report["tied"] = hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight
    state = runtime.full_model_state_dict(model)
    rank = dist.get_rank()
    torch.save({n: b.detach().clone() for n, b in hf_model.named_buffers()}, out / f"buffers-rank{rank}.pt")
    (out / f"report-rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        torch.save({n: t.clone() for n, t in state.items()}, out / "full_state.pt")
        (out / "overrides.json").write_text(json.dumps(overrides))
    runtime.barrier()


if __name__ == "__main__":
    import torch.distributed as dist

    from ligertune.distributed.runtime import leave_process_groups
    from tests.test_distributed import _work

    spec = Path(sys.argv[1])
    cases = json.loads(spec.read_text())
    if cases and isinstance(cases[0], dict):
        dist.init_process_group("gloo")
        for case in cases:
            _build(case["overrides"])
        leave_process_groups(synchronised=True)
    else:
        _work(spec)
