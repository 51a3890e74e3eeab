"""LoRA (peft) with our kernels on: recipe errors, patched vs unpatched parity of the adapted
model, adapter-only training and checkpoints, exact resume, the two exports, DDP and FSDP2 on
gloo, and `ligertune compare` on the LoRA quickstart. QLoRA (bitsandbytes) is GPU-only:
tests/test_lora_gpu.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ligertune.config import RecipeError, load_recipe, machine_problems
from ligertune.config.schema import KernelsSection
from ligertune.distributed.runtime import load_trainable_state
from ligertune.lora import apply_lora, merged_state_dict
from ligertune.models.build import build_model
from ligertune.patching import patch_model
from ligertune.patching.losses import fused_head
from ligertune.run.checkpoint import load_checkpoint
from ligertune.training import train
from ligertune.training.export import merged_directory
from tests.helpers import PLAIN_RUN, ROOT, TINY_MODEL
from tests.test_patching import random_batch, tiny_model

peft = pytest.importorskip("peft")

QUICKSTART_LORA = ROOT / "recipes" / "quickstart-lora.yaml"
TINY = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "data.validation_fraction=0.0",
    "training.micro_batch_size=2",
    "training.warmup_steps=2",
    "training.eval_every=null",
    "export.merge_lora=false",
]


def lora_recipe(*overrides: str):
    return load_recipe(QUICKSTART_LORA, [*TINY, *overrides])


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------
# Recipe errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.rank=8"], "lora.rank"),  # unknown key
        (["lora.r=0"], "lora.r"),
        (["lora.r=true"], "lora.r"),  # strict types
        (["lora.target_modules=[]"], "lora.target_modules"),
        (["lora.target_modules=some-linear"], "lora.target_modules"),
        (["lora.dropout=1.0"], "lora.dropout"),
        (["model.quantize=2bit"], "model.quantize"),
        (["lora=null", "model.quantize=4bit"], "model.quantize: 4bit freezes the base weights"),
        (["parallel.strategy=deepspeed"], "lora: not supported with parallel.strategy deepspeed"),
        (["model.quantize=4bit", "parallel.strategy=fsdp"], "not supported with parallel.strategy fsdp"),
        (["lora=null", "export.merge_lora=true"], "export.merge_lora: there is nothing to merge"),
        (["training.fp8=rowwise"], "training.fp8: not supported with lora"),
    ],
)
def test_recipe_errors_name_the_key(overrides, message):
    with pytest.raises(RecipeError) as info:
        lora_recipe(*overrides)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_quantize_is_a_machine_error_on_cpu():
    recipe = lora_recipe("model.quantize=4bit", "training.device=cpu")
    assert any(
        p.startswith("model.quantize: 4bit (bitsandbytes) runs on CUDA only")
        for p in machine_problems(recipe)
    )


def test_quantize_on_cpu_exits_2_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from ligertune.cli import app

    result = CliRunner().invoke(
        app,
        [
            "train",
            str(QUICKSTART_LORA),
            "model.quantize=4bit",
            "training.device=cpu",
            f"output_dir={tmp_path}",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "model.quantize: 4bit (bitsandbytes) runs on CUDA only" in result.output


def test_unknown_target_names_the_linear_modules():
    with pytest.raises(RecipeError) as info:
        apply_lora(tiny_model("llama"), lora_recipe("lora.target_modules=[q_proj, qproj]"))
    (problem,) = info.value.problems
    assert problem.startswith("lora.target_modules: 'qproj' matches no linear module of LlamaForCausalLM")
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in problem


def test_unknown_module_to_save_is_named():
    with pytest.raises(RecipeError, match="lora.modules_to_save: 'embed' matches no module"):
        apply_lora(tiny_model("llama"), lora_recipe("lora.modules_to_save=[embed]"))


# --------------------------------------------------------------------------------------------
# Parity: our kernels under peft vs the unpatched peft model
# --------------------------------------------------------------------------------------------


def _adapted_pair(model_type: str, *overrides: str):
    """(unpatched peft model, patched-then-peft model) with equal weights, B nonzero (at init B
    is zero and the adapters would not show in the output)."""
    base = tiny_model(model_type)
    recipe = lora_recipe("lora.r=4", *overrides)
    plain, _ = apply_lora(copy.deepcopy(base), recipe)
    patched_base = copy.deepcopy(base)
    patch_model(patched_base, KernelsSection())
    patched, report = apply_lora(patched_base, recipe)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                p.normal_(0, 0.1)
    patched.load_state_dict(plain.state_dict())
    return plain, patched, report


def _loss_and_grads(model, batch, seed=5):
    model.train()
    torch.manual_seed(seed)  # the same dropout masks in both
    output = model(**batch)
    output.loss.backward()
    return output, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model_type", "targets", "extra"),
    [
        ("llama", "all-linear", []),
        ("llama", "[q_proj, v_proj, gate_proj, up_proj, down_proj, lm_head]", ["lora.dropout=0.2"]),
        ("llama", "[gate_proj, lm_head]", ["lora.use_rslora=true", "lora.modules_to_save=[embed_tokens]"]),
        ("phi3", "[qkv_proj, gate_up_proj, down_proj, lm_head]", ["lora.dropout=0.1"]),
        ("llama", "[up_proj, lm_head]", ["lora.use_dora=true"]),  # DoRA head: HF's loss, said so
    ],
)
def test_patched_peft_model_matches_unpatched(model_type, targets, extra):
    plain, patched, report = _adapted_pair(model_type, f"lora.target_modules={targets}", *extra)
    batch = random_batch(num_items=True)
    expected, expected_grads = _loss_and_grads(plain, batch)
    got, got_grads = _loss_and_grads(patched, batch)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == expected_grads.keys()
    assert expected_grads and all(("lora_" in n or "modules_to_save" in n) for n in expected_grads)
    for name, grad in expected_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    lm = patched.get_base_model()
    head_fused = fused_head(lm.lm_head)[0] is not None
    if "lora.use_dora=true" in extra:
        assert not head_fused and got.logits is not None
        assert "fused_linear_cross_entropy: LoRA on the lm_head with DoRA" in report
    else:  # the fused path ran: no logits
        assert head_fused and got.logits is None
    projections = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
    named = targets.strip("[]").split(", ")
    adapted = [p for p in projections if p in named or (targets == "all-linear" and p != "gate_up_proj")]
    assert f"swiglu: 2 MLPs (LoRA on {'/'.join(sorted(adapted))} in 2)" in report, report


def test_the_lora_head_path_is_the_one_taken():
    """Poisoning the adapter's B of the lm_head must change the fused loss (the path reads it)."""
    _, patched, report = _adapted_pair("llama", "lora.target_modules=[lm_head]")
    assert "fused_linear_cross_entropy: fused with the LoRA adapter" in report
    batch = random_batch(num_items=True)
    patched.train()
    before = patched(**batch).loss
    with torch.no_grad():
        patched.get_base_model().lm_head.lora_B["default"].weight.mul_(3)
    assert patched(**batch).loss != before


# --------------------------------------------------------------------------------------------
# Training runs: adapters only, checkpoints, resume, exports
# --------------------------------------------------------------------------------------------


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def test_only_adapters_train_and_checkpoints_hold_only_them(tmp_path):
    recipe = lora_recipe("training.max_steps=4", "checkpoint.every_steps=2", f"output_dir={tmp_path}")
    before = build_model(recipe, torch.device("cpu")).state_dict()  # the seeded build the run starts from
    result = train(recipe)
    model = result.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # The frozen base equals the seeded build, after 4 steps.
    for name, value in model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=name)
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "step-2")
    assert set(checkpoint.model) == trained
    assert len(checkpoint.optimizer["state"]) == len(trained)


def test_lora_resume_is_exact(tmp_path):
    common = ["training.max_steps=8", "training.gradient_accumulation_steps=2", "data.max_samples=24"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(lora_recipe(*common, f"output_dir={straight}"))
    first = train(lora_recipe(*common, f"output_dir={split}"), on_step_end=lambda record: record.step == 4)
    assert first.steps == 4
    second = train(lora_recipe(*common, f"output_dir={split}"))
    assert second.steps == 8
    expected, got = _losses(straight), _losses(split)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"


def test_resume_refuses_a_checkpoint_of_other_lora_settings(tmp_path):
    train(lora_recipe("training.max_steps=2", f"output_dir={tmp_path}"))
    with pytest.raises(
        RecipeError, match="lora.target_modules: 'all-linear' → \\['q_proj'\\] since the checkpoint"
    ):
        train(lora_recipe("training.max_steps=3", "lora.target_modules=[q_proj]", f"output_dir={tmp_path}"))
    # Below the recipe check: the adapter-only state itself must match the model's trained parameters.
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "step-2")
    other, _ = apply_lora(
        build_model(lora_recipe(), torch.device("cpu")), lora_recipe("lora.target_modules=[q_proj]")
    )
    with pytest.raises(RecipeError, match="checkpoint.resume: .* holds parameters this run does not train"):
        load_trainable_state(other, checkpoint.model, checkpoint.path)
    full = build_model(lora_recipe(), torch.device("cpu"))  # no frozen parameters: strict, as before
    with pytest.raises(RuntimeError, match="Missing key"):
        load_trainable_state(full, checkpoint.model, checkpoint.path)


def test_exports_load_in_peft_and_in_plain_transformers(tmp_path):
    from peft import PeftModel

    recipe = lora_recipe(
        "training.max_steps=3",
        "checkpoint.export_hf=true",
        "export.merge_lora=true",
        "lora.target_modules=[q_proj, v_proj, gate_proj, down_proj, lm_head]",
        "lora.use_rslora=true",
        f"output_dir={tmp_path}",
    )
    result = train(recipe)
    adapted = result.model.eval()
    input_ids = torch.randint(3, 2000, (2, 12))
    with torch.no_grad():
        expected = adapted(input_ids=input_ids).logits

    final = tmp_path / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(build_model(recipe, torch.device("cpu")), final).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=input_ids).logits, expected, rtol=1e-5, atol=1e-5)

    merged = AutoModelForCausalLM.from_pretrained(merged_directory(final)).eval()
    assert type(merged).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_merged_state_dict_with_dora_and_modules_to_save_matches_peft_merge():
    base = tiny_model("llama")
    recipe = lora_recipe(
        "lora.r=4", "lora.use_dora=true", "lora.modules_to_save=[lm_head]", "lora.target_modules=all-linear"
    )
    adapted, _ = apply_lora(base, recipe)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    ours = merged_state_dict(adapted, adapted.state_dict())
    reference = copy.deepcopy(adapted).merge_and_unload().state_dict()
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


# --------------------------------------------------------------------------------------------
# DDP and FSDP2 (gloo, 2 processes) against one process; compare
# --------------------------------------------------------------------------------------------


# The LoRA section as overrides of the plain quickstart (the torchrun worker of
# tests/test_distributed.py trains that recipe with the overrides it is given).
LORA_SECTION = (
    "lora={r: 8, alpha: 16, target_modules: [q_proj, v_proj, gate_proj, up_proj, down_proj, lm_head]}"
)


def train_ddp_and_fsdp_and_resume(common: list[str], tmp_path) -> dict[str, Path]:
    """One torchrun launch of 2 gloo ranks: `common` with micro-batch 2 under ddp and under fsdp,
    and each again resumed from its step-2 checkpoint; the run directories by name ("ddp",
    "ddp-resumed", "fsdp", "fsdp-resumed")."""
    from tests.test_distributed import launch_worker

    runs, dirs = [], {}
    for strategy in ("ddp", "fsdp"):
        dirs[strategy] = tmp_path / strategy
        straight = [*common, "training.micro_batch_size=2", f"parallel.strategy={strategy}"]
        runs.append([*straight, f"output_dir={dirs[strategy]}"])
        dirs[f"{strategy}-resumed"] = tmp_path / f"{strategy}-resumed"
        step_2 = f"checkpoint.resume={dirs[strategy] / 'checkpoints' / 'step-2'}"
        runs.append([*straight, f"output_dir={dirs[f'{strategy}-resumed']}", step_2])
    launch_worker(runs, tmp_path)
    return dirs


@pytest.mark.slow
def test_ddp_and_fsdp_match_one_process_with_lora_and_resume_exactly(tmp_path):
    from tests.helpers import QUICKSTART
    from tests.test_distributed import FP32_RTOL, assert_losses_close

    common = [
        *TINY,
        LORA_SECTION,
        "training.device=cpu",
        "training.adam_eps=1e-6",
        "training.max_steps=4",
        "training.gradient_accumulation_steps=2",
        "checkpoint.every_steps=2",
        "kernels=all",
        "kernels.rope=false",  # ~10 s a step under the interpreter, and no LoRA in it
    ]
    one = tmp_path / "one"
    train(load_recipe(QUICKSTART, [*common, "training.micro_batch_size=4", f"output_dir={one}"]))
    dirs = train_ddp_and_fsdp_and_resume(common, tmp_path)
    reference = _losses(one)
    for strategy in ("ddp", "fsdp"):
        assert_losses_close(_losses(dirs[strategy]), reference, FP32_RTOL, strategy)
        again, first = _losses(dirs[f"{strategy}-resumed"]), _losses(dirs[strategy])
        assert sorted(again) == [3, 4] and all(again[s] == first[s] for s in (3, 4)), (strategy, again, first)
        # The fused loss ran on every micro-batch with the adapter's widened weight: vocab × (hidden + r).
        calls = json.loads((dirs[strategy] / "flce-rank0.json").read_text())
        assert calls and all(shape == [2048, 64 + 8] for shape in calls), calls
    state = json.loads((dirs["fsdp"] / "checkpoints" / "step-2" / "state.json").read_text())
    assert (state["format"], state["world_size"]) == ("dcp", 2)


@pytest.mark.slow
def test_compare_on_the_lora_quickstart(tmp_path):
    from ligertune.tools.compare import compare_command
    from tests.test_compare import quiet_console

    overrides = [
        *TINY_MODEL,
        "data.validation_fraction=0.0",
        "training.micro_batch_size=2",
        "logging.log_every=1",
    ]
    status = compare_command(
        QUICKSTART_LORA,
        overrides,
        quiet_console(),
        out=tmp_path,
        steps=3,
        kernels="rms_norm,swiglu,fused_linear_cross_entropy",
    )
    report = json.loads((tmp_path / "compare.json").read_text())
    assert status == 0 and report["verdict"]["parity"] is True, report["comparisons"]
    off, on = (a["losses"] for a in report["arms"])
    assert len(on) == 3 and off[0] != off[-1]
