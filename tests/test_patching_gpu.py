"""Model patching at a mid size on the GPU: parity (fp32 and bf16), memory, 100-step convergence.

Every family at hidden 1024, 4 layers, 16 heads (4 KV heads, head_dim 64), intermediate 2816,
vocab 32000, batch 4 × 512 tokens. Tolerances:

* fp32 parity: 1e-5 relative (``ligertune.tools.check.FP32_TOL``) on loss, eval logits and every
  gradient. TF32 is off (PyTorch's default for matmuls), so both models compute in true fp32.
* bf16 parity: both models are compared with an fp32 run of the same (bf16-valued) weights; the
  patched model's relative error must be ≤ 2 × HF's own + 2⁻⁸ (``parity_check``'s 16-bit rule).
* bf16 convergence: 100 AdamW steps from the same init on a learnable synthetic task, HF bf16,
  patched bf16 and HF fp32. The patched curve's mean relative distance to the fp32 curve must
  be ≤ 2 × HF bf16's + 1%, and the loss must fall below 60% of its start.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ligertune.patching import patch_model
from ligertune.tools.check import FP32_TOL, parity_check

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
VOCAB, BATCH, SEQ, STEPS = 32000, 4, 512, 100
MID = dict(
    vocab_size=VOCAB,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "gemma2": dict(final_logit_softcapping=30.0, query_pre_attn_scalar=64, sliding_window=128),
    "gemma3_text": dict(
        query_pre_attn_scalar=64,
        sliding_window=128,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        final_logit_softcapping=30.0,
    ),
    "phi3": dict(partial_rotary_factor=0.75),
}


def mid_model(model_type: str, dtype: torch.dtype) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **MID, **FAMILIES[model_type])
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # norm weights and biases away from their init
                    p.add_(0.2 * torch.randn_like(p))
    return model.to(dtype)


def random_batch() -> dict:
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), device=DEVICE)
    labels = input_ids.clone()
    labels[:, :64] = -100  # masked prompts
    return {"input_ids": input_ids, "labels": labels}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_gpu_parity(model_type, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    result = parity_check(mid_model(model_type, dtype), random_batch(), "all", dtype)
    print(result.report, result, sep="\n")
    assert result.report.patched["rope"] == 4 and result.report.patched["fused_linear_cross_entropy"] == 1
    assert result.ok, str(result)
    if dtype == torch.float32:
        assert all(c.tolerance == FP32_TOL for c in result.checks)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_gpu_fused_loss_never_holds_the_logits(model_type):
    """Peak memory of one bf16 training step: the fused path saves at least one fp32 copy of the
    [tokens, vocab] logits that HF's loss makes (HF holds bf16 logits, their fp32 upcast and its
    gradient)."""
    hf = mid_model(model_type, torch.bfloat16)
    ours = copy.deepcopy(hf)
    patch_model(ours, "all")
    batch = random_batch()
    peaks = []
    for model in (hf, ours):
        model.train()
        model(**batch).loss.backward()  # warm-up: allocator caches, gradients allocated
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(**batch).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        model.zero_grad(set_to_none=True)
    logits_fp32 = BATCH * SEQ * VOCAB * 4
    print(
        f"{model_type}: peak above the inputs HF {peaks[0] / 2**20:.0f} MiB, patched {peaks[1] / 2**20:.0f} MiB"
    )
    assert peaks[1] <= peaks[0] - logits_fp32


def learnable_batches(n: int) -> list[dict]:
    """Sequences over 100 token ids where the next token is a fixed function of the current one
    90% of the time: a model learns the unigram and then the rule, so the loss falls far."""
    rule = torch.randperm(100, device=DEVICE) + 3
    batches = []
    for _ in range(n):
        ids = torch.empty(BATCH, SEQ, dtype=torch.long, device=DEVICE)
        ids[:, 0] = torch.randint(3, 103, (BATCH,), device=DEVICE)
        for t in range(1, SEQ):
            follow = rule[ids[:, t - 1] - 3]
            noise = torch.randint(3, 103, (BATCH,), device=DEVICE)
            ids[:, t] = torch.where(torch.rand(BATCH, device=DEVICE) < 0.9, follow, noise)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def train(model: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model.train()
    losses = []
    for step in range(STEPS):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    return torch.stack(losses).cpu()


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_gpu_convergence_bf16(model_type):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = mid_model(model_type, torch.bfloat16)
    ours = copy.deepcopy(hf)
    patch_model(ours, "all")
    reference = copy.deepcopy(hf).float()  # fp32 run of the same bf16-valued weights
    batches = learnable_batches(8)
    curves = {
        name: train(model, batches) for name, model in (("fp32", reference), ("hf", hf), ("ours", ours))
    }
    dist = {
        name: ((curves[name] - curves["fp32"]).abs() / curves["fp32"]).mean().item()
        for name in ("hf", "ours")
    }
    print(
        f"{model_type}: loss {curves['ours'][0]:.3f} -> {curves['ours'][-10:].mean():.3f}; mean relative distance "
        f"to fp32: HF bf16 {dist['hf']:.4f}, patched bf16 {dist['ours']:.4f}"
    )
    assert curves["ours"][-10:].mean() < 0.6 * curves["ours"][0], "the patched model must learn"
    assert dist["ours"] <= 2 * dist["hf"] + 0.01
