"""LoRA on the routed experts (``lora.target_parameters``, peft's adapters on 3-D parameters) on
tiny Qwen3-MoE, GPT-OSS and DeepSeek-V3 models: recipe errors, our experts kernel against transformers'
forward under the same adapters, the merge against peft's own, the adapter-count the plan uses
against what peft creates, and a training run's checkpoints, resume and both exports loaded back
by peft and by transformers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from ligertune.cli import app
from ligertune.config import load_recipe
from ligertune.config.schema import KernelsSection
from ligertune.errors import RecipeError
from ligertune.kernels import moe as moe_kernel
from ligertune.lora import apply_lora, merged_state_dict
from ligertune.models.build import build_model
from ligertune.models.shape import expert_lora_params, lora_params
from ligertune.patching import patch_model
from ligertune.run.checkpoint import load_checkpoint
from ligertune.run.metrics import count_label
from ligertune.training import train
from ligertune.training.export import merged_directory
from tests.helpers import QUICKSTART
from tests.test_lora import lora_recipe, train_ddp_and_fsdp_and_resume
from tests.test_moe import moe_overrides, moe_recipe, tiny_moe
from tests.test_patching import one_torch_thread, random_batch  # noqa: F401 - autouse fixture

peft = pytest.importorskip("peft")

ATTENTION = "lora.target_modules=[q_proj, k_proj, v_proj, o_proj]"
# DeepSeek-V3's multi-head latent attention: the latents' projections and o_proj.
ATTENTION_OF = {
    "deepseek_v3": "lora.target_modules=[q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj]"
}
EXPERTS = ["lora.r=4", "lora.dropout=0", "lora.target_parameters=experts"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.dropout=0.05"], "lora.dropout: 0.05 is not supported with lora.target_parameters"),
        (
            ["lora.dropout=0", "lora.use_dora=true"],
            "lora.use_dora: not supported with lora.target_parameters",
        ),
        (
            ["lora.dropout=0", "model.quantize=4bit"],
            "model.quantize: 4bit is not supported with lora.target_parameters",
        ),
        (["lora.target_parameters=[]"], "lora.target_parameters"),
    ],
)
def test_recipe_errors(overrides, message):
    with pytest.raises(RecipeError) as info:
        lora_recipe("lora.target_parameters=experts", *overrides)
    assert any(message in p for p in info.value.problems), info.value.problems


def test_model_errors_name_the_key():
    with pytest.raises(RecipeError, match="lora.target_parameters: LlamaForCausalLM has no routed experts"):
        apply_lora(build_model(lora_recipe(), torch.device("cpu")), lora_recipe(*EXPERTS))
    with pytest.raises(
        RecipeError,
        match="'up_proj' is not a weight of Qwen3MoeExperts; its weights are: gate_up_proj, down_proj",
    ):
        apply_lora(tiny_moe("qwen3_moe"), lora_recipe("lora.dropout=0", "lora.target_parameters=[up_proj]"))


def test_peft_retargeting_of_dense_mlp_names_is_refused():
    """peft 0.21 turns gate_proj/up_proj/down_proj of a Qwen3-MoE model into expert adapters; the
    tiny model's dense layer (mlp_only_layers) would lose its MLP adapters without a word."""
    with pytest.raises(
        RecipeError, match="peft retargets down_proj, gate_proj, up_proj of Qwen3MoeForCausalLM"
    ):
        apply_lora(tiny_moe("qwen3_moe"), lora_recipe("lora.dropout=0"))


def _adapted_pair(model_type: str):
    """(transformers' experts, ours) under equal adapters with B nonzero, and our report."""
    torch.manual_seed(0)
    base = tiny_moe(model_type)
    recipe = lora_recipe(*EXPERTS, ATTENTION_OF.get(model_type, ATTENTION))
    plain, _ = apply_lora(copy.deepcopy(base), recipe)
    patched_base = copy.deepcopy(base)
    patch_model(patched_base, KernelsSection(moe_experts=True))
    patched, report = apply_lora(patched_base, recipe)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    patched.load_state_dict(plain.state_dict())
    return plain, patched, report


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_expert_adapters_through_our_kernel_match_transformers(model_type, monkeypatch):
    """fp32: the loss and every adapter gradient with moe_experts computing the experts equal
    transformers' experts forward reading the same peft-parametrized weights."""
    plain, patched, report = _adapted_pair(model_type)
    batch = random_batch(num_items=True)
    results = []
    calls = []
    real = moe_kernel.moe_experts

    def spy(*args, **kwargs):
        calls.append(args[3].requires_grad)  # the weight handed in is W + s·B·A, part of the graph
        return real(*args, **kwargs)

    for model in (plain, patched):
        if model is patched:
            monkeypatch.setattr(moe_kernel, "moe_experts", spy)
        model.train()
        output = model(**batch)
        output.loss.backward()
        results.append((output.loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert calls and all(calls)
    (expected, expected_grads), (got, got_grads) = results
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == expected_grads.keys()
    sparse = 2 if model_type == "gpt_oss" else 1  # the tiny Qwen3-MoE's layer 1 is dense, DeepSeek's 0
    assert len([n for n in expected_grads if ".experts." in n]) == sparse * 2 * 2  # 2 weights × (A, B)
    for name, grad in expected_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    cls = {"qwen3_moe": "Qwen3MoeExperts", "gpt_oss": "GptOssExperts", "deepseek_v3": "DeepseekV3Experts"}[
        model_type
    ]
    assert (
        f"experts: LoRA on down_proj/gate_up_proj of {sparse} {cls} modules, one rank-4 adapter per expert; "
        "W + s·B·A made by peft at each call, read by our moe_experts" in report
    ), report


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_merge_matches_peft_and_counts_match_the_plan(model_type):
    """Our merged state dict equals peft's merge_and_unload (GPT-OSS's [E, H, 2I] gate_up_proj
    included), the merged plain model gives the adapted model's logits, and the plan's adapter
    count is what peft trains."""
    base = tiny_moe(model_type)
    attention = ATTENTION_OF.get(model_type, ATTENTION)
    recipe = lora_recipe(*EXPERTS, attention)
    linear = lora_params(base, 4, attention.split("[")[1].rstrip("]").split(", "))
    experts = expert_lora_params(base, 4, "experts")
    adapted, _ = apply_lora(base, recipe)
    trained = [(n, p) for n, p in adapted.named_parameters() if p.requires_grad]
    assert sum(p.numel() for n, p in trained if ".experts." in n) == experts
    assert sum(p.numel() for _, p in trained) == linear + experts
    with torch.no_grad():
        for _, p in trained:
            p.add_(0.05 * torch.randn_like(p))
    ours = merged_state_dict(adapted, adapted.state_dict())
    reference_model = copy.deepcopy(adapted).merge_and_unload()
    reference = reference_model.state_dict()
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)
    plain = tiny_moe(model_type)
    plain.load_state_dict(ours)
    input_ids = torch.randint(0, plain.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = adapted.eval()(input_ids=input_ids).logits
        torch.testing.assert_close(plain.eval()(input_ids=input_ids).logits, expected, rtol=1e-5, atol=1e-5)


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["event"] == "train"}


def test_run_checkpoints_resume_and_exports(tmp_path):
    """A tiny Qwen3-MoE run with expert adapters: checkpoints hold the adapters only, a resume
    is exact, final/ loads with PeftModel.from_pretrained on the base and final-merged/ with
    transformers, both giving the trained model's logits; `ligertune plan` counts them."""
    section = "lora={r: 4, alpha: 8, dropout: 0, target_modules: all-linear, target_parameters: experts}"
    common = [
        section,
        "kernels=none",
        "logging.progress=plain",
        "logging.log_every=1",
        "data.validation_fraction=0.0",
        "training.max_steps=4",
        "training.micro_batch_size=2",
        "training.warmup_steps=1",
        "training.eval_every=null",
        "checkpoint.every_steps=2",
    ]
    straight = moe_recipe(tmp_path / "straight", *common)
    result = train(straight)
    trained = {n for n, p in result.model.named_parameters() if p.requires_grad}
    assert any(".experts.lora_" in n for n in trained) and any(
        ".experts.base_layer.lora_" in n for n in trained
    )
    assert set(load_checkpoint(straight.run_dir / "checkpoints" / "step-2").model) == trained

    split = [*common, "checkpoint.export_hf=true", "export.merge_lora=true"]
    train(moe_recipe(tmp_path / "split", *split), on_step_end=lambda record: record.step == 2)
    recipe = moe_recipe(tmp_path / "split", *split)
    resumed = train(recipe)
    expected, got = _losses(straight.run_dir), _losses(recipe.run_dir)
    assert [got[s] for s in (3, 4)] == [expected[s] for s in (3, 4)]

    adapted = resumed.model.eval()
    input_ids = torch.randint(3, 2000, (2, 12))
    with torch.no_grad():
        logits = adapted(input_ids=input_ids).logits
    final = recipe.run_dir / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj" in config["target_parameters"]
    loaded = peft.PeftModel.from_pretrained(build_model(recipe, torch.device("cpu")), final).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_directory(final)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=input_ids).logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=input_ids).logits, logits, rtol=1e-4, atol=1e-5)

    plan = CliRunner().invoke(app, ["plan", str(QUICKSTART), *moe_overrides(tmp_path / "plan", *common)])
    assert plan.exit_code == 0, plan.output
    on_experts = sum(p.numel() for n, p in adapted.named_parameters() if p.requires_grad and ".experts." in n)
    total = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert (
        f"LoRA r=4: {count_label(total)} adapter parameters, {count_label(on_experts)} of them on the routed experts"
        in " ".join(plan.output.split())
    ), plan.output


@pytest.mark.slow
def test_ddp_and_fsdp_with_expert_adapters_match_one_process_resume_and_export(tmp_path):
    """Expert adapters under ddp and fsdp (2 gloo ranks; fsdp with sharded init, the default):
    the losses and gradient norms of one process, with our experts kernel; a resume from step 2
    gives the same steps 3 and 4; fsdp's merged export (gathered from the shards) loads with
    transformers and gives the one-process run's logits."""
    from tests.test_distributed import FP32_RTOL, assert_losses_close, losses

    section = (
        "lora={r: 4, alpha: 8, dropout: 0, target_modules: [q_proj, v_proj], target_parameters: experts}"
    )
    common = [
        *moe_overrides(tmp_path / "unused"),
        section,
        "kernels=all",
        "kernels.rope=false",  # no adapter in it, and seconds a step under the interpreter
        "logging.progress=plain",
        "logging.log_every=1",
        "data.validation_fraction=0.0",
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.eval_every=null",
        "checkpoint.every_steps=2",
        "checkpoint.export_hf=true",
        "export.merge_lora=true",
    ]
    one = tmp_path / "one"
    train(load_recipe(QUICKSTART, [*common, "training.micro_batch_size=4", f"output_dir={one}"]))
    dirs = train_ddp_and_fsdp_and_resume(common, tmp_path)
    for strategy in ("ddp", "fsdp"):
        assert_losses_close(losses(dirs[strategy]), losses(one), FP32_RTOL, strategy)
        grad_norms = losses(dirs[strategy], key="grad_norm")
        assert_losses_close(grad_norms, losses(one, key="grad_norm"), FP32_RTOL, f"{strategy} grad norm")
        again, first = losses(dirs[f"{strategy}-resumed"]), losses(dirs[strategy])
        assert sorted(again) == [3, 4] and all(again[s] == first[s] for s in (3, 4)), (strategy, again, first)
    input_ids = torch.randint(3, 2000, (2, 12))
    logits = {}
    for name in ("one", "fsdp"):
        merged = AutoModelForCausalLM.from_pretrained(merged_directory(tmp_path / name / "final")).eval()
        with torch.no_grad():
            logits[name] = merged(input_ids=input_ids).logits
    torch.testing.assert_close(logits["fsdp"], logits["one"], rtol=1e-4, atol=1e-5)
