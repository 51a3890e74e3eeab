"""Model patching on tiny random models of every family, fp32, Triton kernels under the CPU interpreter.

The reference is always the same model unpatched (Hugging Face's own modules, fp32 PyTorch).
Tolerance: 1e-5 relative (‖patched − HF‖ / ‖HF‖) for loss, eval logits and every gradient;
1e-4 relative per step for 20-step AdamW loss curves. Norm weights and biases are perturbed
away from their init (ones/zeros) so that a kernel ignoring the weight or the Gemma ``1 + w``
offset cannot pass.

Shapes stay tiny (batch 2 × 8 tokens, 2 layers) because the interpreter's cost grows with the
number of programs and launches.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama import modeling_llama
from typer.testing import CliRunner

import ligertune.kernels.rms_norm as rms_kernel
from ligertune.catalog.kernels import KERNEL_NAMES
from ligertune.cli import app
from ligertune.patching import patch_model
from ligertune.tools.check import FP32_TOL, parity_check
from tests.kernels.helpers import rel_err

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
VOCAB, BATCH, SEQ, LAYERS, STEPS = 1000, 2, 8, 2, 20
CURVE_TOL = 1e-4

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Per family: extra config, RMSNorm modules per decoder layer (read off the HF modeling files:
# input/post-attention norms, plus q_norm/k_norm and pre/post-feedforward norms where present),
# and the gated kernel its activation needs.
FAMILIES = {
    "llama": ({}, 2, "swiglu"),
    "mistral": ({}, 2, "swiglu"),
    "qwen2": ({}, 2, "swiglu"),  # q/k/v biases
    "qwen3": ({}, 4, "swiglu"),  # + q_norm, k_norm
    "gemma": ({}, 2, "geglu"),  # (1 + w) norms, tied embeddings
    # A softcap of 0.5 bends the ~0.2-sized logits of a fresh model well beyond 1e-5.
    "gemma2": (dict(final_logit_softcapping=0.5, query_pre_attn_scalar=16), 4, "geglu"),
    "gemma3_text": (
        dict(
            final_logit_softcapping=0.5,
            query_pre_attn_scalar=16,
            sliding_window=4,  # < SEQ: the local layer really is local
            layer_types=["sliding_attention", "full_attention"],
        ),
        6,
        "geglu",
    ),
    "phi3": (dict(partial_rotary_factor=0.5), 2, "swiglu"),  # fused gate_up_proj, 8 of 16 dims rotate
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tests run thousands of tiny ops; with other processes on the machine, torch's
    intra-op thread pool spends most of their time waiting (measured: 40× slower matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(model_type: str, **changes) -> nn.Module:
    extra, _, _ = FAMILIES.get(model_type, ({}, 0, ""))
    config = AutoConfig.for_model(model_type, **{**TINY, **extra, **changes})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights and biases: away from ones/zeros
                p.add_(0.2 * torch.randn_like(p))
    return model


def random_batch(num_items: bool = False, batch: int = BATCH) -> dict:
    input_ids = torch.randint(3, VOCAB, (batch, SEQ))
    labels = input_ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[-1, torch.randint(3, SEQ, (2,))] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    if num_items:  # gradient-accumulation normalisation: sum / count over a larger window
        batch["num_items_in_batch"] = torch.tensor(int((labels[:, 1:] != -100).sum()) + 5)
    return batch


def expected_counts(model_type: str) -> dict[str, int]:
    _, norms_per_layer, gated = FAMILIES[model_type]
    counts = dict.fromkeys(KERNEL_NAMES, 0)
    counts.update(rms_norm=LAYERS * norms_per_layer + 1, rope=LAYERS, fused_linear_cross_entropy=1)
    counts[gated] = LAYERS
    return counts


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def eval_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def train(model: nn.Module, batches: list[dict]) -> list[float]:
    """AdamW over the batches; the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------------------------
# Every family: parity and training curves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_parity(model_type):
    """Counts, state_dict keys, eval logits, and the training loss and every gradient of one step."""
    hf = tiny_model(model_type)
    ours = copy.deepcopy(hf)
    report = patch_model(ours, "all")
    assert report.patched == expected_counts(model_type), str(report)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    if model_type == "phi3":
        rotary_dim = 2 * ours.model.rotary_emb.inv_freq.numel()
        assert rotary_dim < ours.config.hidden_size // ours.config.num_attention_heads, (
            "phi3 test must be partial"
        )
    if model_type.startswith("gemma"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight, "gemma test must cover tied embeddings"

    ids = random_batch()["input_ids"]
    err = rel_err(eval_logits(ours, ids), eval_logits(hf, ids))
    assert err <= FP32_TOL, f"eval logits: relative error {err:.3g}"

    batch = random_batch(num_items=True)
    hf.train()
    ours.train()
    ref, out = hf(**batch), ours(**batch)
    assert out.logits is None, "training with labels must take the fused path (no logits)"
    assert rel_err(out.loss, ref.loss) <= FP32_TOL, f"loss {out.loss.item()} vs HF {ref.loss.item()}"
    ref.loss.backward()
    out.loss.backward()
    hf_grads, our_grads = grads(hf), grads(ours)
    assert our_grads.keys() == hf_grads.keys()
    for name, g in hf_grads.items():
        err = rel_err(our_grads[name], g)
        assert err <= FP32_TOL, f"grad {name}: relative error {err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_training_curve(model_type):
    """20 AdamW steps, loss normalised by num_items_in_batch on every other step. One layer and one
    sequence per batch: each interpreted kernel launch costs tens of milliseconds on CPU."""
    one_layer = {"num_hidden_layers": 1}
    if "layer_types" in FAMILIES[model_type][0]:
        one_layer["layer_types"] = ["full_attention"]
    hf = tiny_model(model_type, **one_layer)
    ours = copy.deepcopy(hf)
    patch_model(ours, "all")
    # Four batches seen five times each: the model memorises them, so the loss falls steeply.
    distinct = [random_batch(num_items=i % 2 == 1, batch=1) for i in range(4)]
    batches = [distinct[i % 4] for i in range(STEPS)]
    hf_losses, our_losses = train(hf, batches), train(ours, batches)
    for step, (a, b) in enumerate(zip(our_losses, hf_losses, strict=True)):
        assert abs(a - b) <= CURVE_TOL * abs(b), f"step {step}: patched loss {a} vs HF {b}"
    assert hf_losses[-1] < 0.5 * hf_losses[0], "the curve must move for the comparison to mean something"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patched_forward_keeps_hf_signature(model_type):
    model = tiny_model(model_type)
    hf_params = list(inspect.signature(type(model).forward).parameters)[1:]
    patch_model(model, "all")
    assert (
        list(inspect.signature(model.forward).parameters) == hf_params
    )  # generate() and the trainer inspect it (logits_to_keep, kwargs)


# --------------------------------------------------------------------------------------------
# Patching semantics
# --------------------------------------------------------------------------------------------


def test_patch_twice_is_a_noop():
    model = tiny_model("qwen3")
    first = patch_model(model, "all")
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    second = patch_model(model, "all")
    assert sum(second.patched.values()) == 0
    assert second.already_patched == {k: n for k, n in first.patched.items() if n}
    assert "already patched" in str(second)
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()} == forwards


def _shared_functions():
    """The module- and class-level functions every Llama (and every nn.Linear) in the process uses."""
    return (
        modeling_llama.apply_rotary_pos_emb,
        modeling_llama.LlamaRMSNorm.forward,
        modeling_llama.LlamaMLP.forward,
        modeling_llama.LlamaAttention.forward,
        modeling_llama.LlamaForCausalLM.forward,
        nn.Linear.forward,
        nn.functional.cross_entropy,
    )


def test_other_models_in_the_process_are_unaffected():
    originals = _shared_functions()
    patched = tiny_model("llama")
    bystander = copy.deepcopy(patched)
    batch = random_batch()
    bystander.train()
    before = bystander(**batch)

    patch_model(patched, "all")
    patched.train()
    patched(**batch).loss.backward()

    after = bystander(**batch)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.loss, before.loss)
    assert not any("forward" in m.__dict__ for m in bystander.modules())
    assert _shared_functions() == originals


def test_kernels_none_patches_nothing():
    model = tiny_model("gemma2")
    report = patch_model(model, "none")
    assert sum(report.patched.values()) == 0 and not report.already_patched
    assert report.skipped == dict.fromkeys(KERNEL_NAMES, "off in the recipe")
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "_loss_function" not in model.__dict__


def test_report_text_names_every_kernel_and_why():
    report = patch_model(tiny_model("gemma"), {"rope": False, "cross_entropy": False})
    text = str(report)
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert set(lines) == set(KERNEL_NAMES)
    assert "GemmaForCausalLM" in text.splitlines()[0] and "gemma" in text.splitlines()[0]
    assert "5 modules patched" in lines["rms_norm"]
    assert "2 modules patched" in lines["geglu"]
    assert "1 module patched" in lines["fused_linear_cross_entropy"]
    assert "off in the recipe" in lines["rope"]
    assert "no nn.LayerNorm" in lines["layer_norm"]
    assert "geglu" in lines["swiglu"]  # says which gated kernel this model uses instead
    assert report.skipped["rope"] == "off in the recipe"


def test_activation_checkpointing_recomputes_patched_layers():
    """Non-reentrant checkpointing (how the loop runs it) recomputes the patched forwards in
    backward; the gated kernel's in-place backward then writes over recomputed gate/up halves."""
    hf = tiny_model("phi3")
    ours = copy.deepcopy(hf)
    patch_model(ours, "all")
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = random_batch()
    hf.train()
    ours.train()
    ref, out = hf(**batch), ours(**batch)
    ref.loss.backward()
    out.loss.backward()
    assert rel_err(out.loss, ref.loss) <= FP32_TOL
    for name, g in grads(hf).items():
        assert rel_err(grads(ours)[name], g) <= FP32_TOL, name


# --------------------------------------------------------------------------------------------
# Loss paths
# --------------------------------------------------------------------------------------------

FLCE_ONLY = {k: k == "fused_linear_cross_entropy" for k in KERNEL_NAMES}


def test_fused_loss_options_match_hf():
    """Tied lm_head, shift_labels given by the caller, an int num_items_in_batch, return_dict=False."""
    hf = tiny_model("llama", tie_word_embeddings=True)
    ours = copy.deepcopy(hf)
    assert patch_model(ours, FLCE_ONLY).patched["fused_linear_cross_entropy"] == 1
    batch = random_batch()
    shift = torch.full_like(batch["labels"], -100)
    shift[:, :-2] = batch["labels"][:, 2:]  # predict two tokens ahead: not what labels would give
    kwargs = dict(
        input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=shift, num_items_in_batch=11
    )
    for model in (hf, ours):
        model.train()
    ref = hf(**kwargs)
    ref.loss.backward()
    out = ours(**kwargs, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0  # (loss, ...) with no logits
    out[0].backward()
    assert rel_err(out[0], ref.loss) <= FP32_TOL
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    for name, g in grads(hf).items():
        assert rel_err(grads(ours)[name], g) <= FP32_TOL, name


def test_fused_loss_runs_inside_the_lm_head_call():
    """FSDP2 and ZeRO-3 gather the lm_head weight in its forward hooks: the loss must run under them."""
    model = tiny_model("llama")
    patch_model(model, FLCE_ONLY)
    seen = []
    model.lm_head.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True
    )
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.dim()))
    model.train()
    out = model(**random_batch())
    assert out.logits is None
    assert seen == [["ignore_index", "num_items_in_batch", "softcap", "target"], 0]


def test_eval_and_generation_follow_hf():
    hf = tiny_model("llama")
    ours = copy.deepcopy(hf)
    patch_model(ours, "all")
    batch = random_batch()
    hf.eval()
    ours.eval()
    with torch.no_grad():
        ref, out = hf(**batch), ours(**batch)  # eval with labels: HF's path, logits and loss
    assert out.logits is not None and rel_err(out.logits, ref.logits) <= FP32_TOL
    assert rel_err(out.loss, ref.loss) <= FP32_TOL
    prompt = batch["input_ids"][:1, :4]
    new = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **new), hf.generate(prompt, **new))


class LowRankHead(nn.Module):
    """A stand-in for a LoRA-wrapped lm_head: base(x) + B(A(x))."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


def test_wrapped_lm_head_keeps_working():
    hf = tiny_model("llama")
    ours = copy.deepcopy(hf)
    patch_model(ours, FLCE_ONLY)
    hf.lm_head = LowRankHead(hf.lm_head)
    ours.lm_head = LowRankHead(ours.lm_head)  # wrapped after patching, as PEFT would
    ours.lm_head.load_state_dict(hf.lm_head.state_dict())
    batch = random_batch()
    hf.train()
    ours.train()
    ref, out = hf(**batch), ours(**batch)
    assert out.logits is not None, "a wrapped lm_head must fall back to HF's path"
    assert rel_err(out.loss, ref.loss) <= FP32_TOL

    wrapped = tiny_model("llama")  # wrapped before patching: reported, not patched
    wrapped.lm_head = LowRankHead(wrapped.lm_head)
    report = patch_model(wrapped, FLCE_ONLY)
    assert report.patched["fused_linear_cross_entropy"] == 0
    assert "LowRankHead, not a plain nn.Linear" in report.skipped["fused_linear_cross_entropy"]


def test_cross_entropy_kernel_path():
    kernels = {k: k == "cross_entropy" for k in KERNEL_NAMES}
    model = tiny_model("gemma2")  # the CE kernel sees HF's already-softcapped logits
    result = parity_check(model, random_batch(num_items=True), kernels)
    assert result.report.patched["cross_entropy"] == 1
    assert result.ok, str(result)


# --------------------------------------------------------------------------------------------
# Families missing from the table
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type, offset_family", [("llama", "Llama"), ("gemma", "Gemma")])
def test_unknown_family_uses_probed_generic_kernels(model_type, offset_family):
    """A Llama/Gemma renamed to an unknown model_type: norms and MLPs are found by probing."""
    model = tiny_model(model_type)
    model.config.model_type = "mystery"
    kernels = {**dict.fromkeys(KERNEL_NAMES, True), "fused_linear_cross_entropy": False}
    result = parity_check(model, random_batch(), kernels)
    report = result.report
    assert not report.known_family and "not in the family table" in str(report)
    gated = "swiglu" if model_type == "llama" else "geglu"
    assert report.patched == {**dict.fromkeys(KERNEL_NAMES, 0), "rms_norm": 5, gated: 2, "cross_entropy": 1}
    assert "family entry" in report.skipped["rope"]
    assert result.ok, str(result)


def test_unknown_family_layer_norm_and_loss():
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    torch_model = AutoModelForCausalLM.from_config(config)
    kernels = {**dict.fromkeys(KERNEL_NAMES, True), "fused_linear_cross_entropy": False}
    result = parity_check(torch_model, random_batch(), kernels)
    report = result.report
    assert report.patched == {**dict.fromkeys(KERNEL_NAMES, 0), "layer_norm": 5, "cross_entropy": 1}
    assert "no module whose class name ends in RMSNorm" in report.skipped["rms_norm"]
    assert result.ok, str(result)


class MeanAbsNorm(nn.Module):
    """Named like an RMSNorm but normalises by mean |x|: the probe must refuse it."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


MeanAbsNorm.__name__ = "ToyRMSNorm"


class ReluGated(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(n, 2 * n),
            nn.Linear(n, 2 * n),
            nn.Linear(2 * n, n),
        )
        self.act_fn = nn.ReLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_unknown_family_with_nothing_to_patch():
    toy = nn.Sequential(MeanAbsNorm(8), ReluGated(8))
    toy.config = SimpleNamespace(model_type="toy")
    rng = torch.get_rng_state()
    report = patch_model(toy, "all")
    assert torch.equal(torch.get_rng_state(), rng), "probing must not move the global RNG (seeded runs)"
    assert sum(report.patched.values()) == 0
    assert "none of the enabled kernels applies" in str(report)
    assert "0: ToyRMSNorm its output matches neither" in report.skipped["rms_norm"]
    assert "1: ReluGated act_fn ReLU has no fused kernel" in report.skipped["swiglu"]
    assert not any("forward" in m.__dict__ for m in toy.modules())


# --------------------------------------------------------------------------------------------
# Bad input, parity self-check, CLI
# --------------------------------------------------------------------------------------------


def test_bad_input_is_explained():
    with pytest.raises(TypeError, match="config.model_type"):
        patch_model(nn.Linear(2, 2), "all")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="'all', 'none'"):
        patch_model(model, "most")
    with pytest.raises(ValueError, match="rms_nrom"):
        patch_model(model, {"rms_nrom": True})
    with pytest.raises(ValueError, match="input_ids"):
        parity_check(model, {"labels": torch.zeros(1, 4, dtype=torch.long)}, "none")


def test_parity_check_catches_a_wrong_kernel(monkeypatch):
    real = rms_kernel.rms_norm
    monkeypatch.setattr(rms_kernel, "rms_norm", lambda *a, **k: real(*a, **k) * (1 + 1e-3))
    result = parity_check(tiny_model("mistral"), random_batch(), {k: k == "rms_norm" for k in KERNEL_NAMES})
    assert not result.ok and "FAIL" in str(result)
    failed = {c.name for c in result.failures}
    assert "logits (eval)" in failed and any(name.startswith("grad ") for name in failed)


def test_parity_check_bf16_catches_a_wrong_kernel(monkeypatch):
    """The 16-bit tolerance (3× HF's own error) still fails a kernel that is 5% off."""
    real = rms_kernel.rms_norm
    monkeypatch.setattr(rms_kernel, "rms_norm", lambda *a, **k: real(*a, **k) * 1.05)
    result = parity_check(tiny_model("qwen3"), random_batch(), "all", dtype=torch.bfloat16)
    assert not result.ok and "logits (eval)" in {c.name for c in result.failures}, str(result)


def test_parity_check_bf16():
    """16-bit: patched and HF are both compared with an fp32 run of the same weights."""
    result = parity_check(tiny_model("qwen3"), random_batch(), "all", dtype=torch.bfloat16)
    assert all(c.hf_error is not None and c.hf_error > 0 for c in result.checks)
    assert result.ok, str(result)


def test_cli_validate_check():
    runner = CliRunner()
    args = [
        "validate",
        str(RECIPES / "quickstart.yaml"),
        "--check",
        "-f",
        "none",
        "kernels=all",
        "data.max_seq_len=8",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "fused_linear_cross_entropy  1 module patched" in result.output
    assert "PASS" in result.output


def test_cli_validate_check_refuses_huge_models():
    recipe = str(RECIPES / "llama3-8b-alpaca-bench.yaml")
    result = CliRunner().invoke(app, ["validate", recipe, "--check", "-f", "none"])
    assert result.exit_code == 2
    assert "config_overrides" in result.output and "8.0B parameters" in result.output
