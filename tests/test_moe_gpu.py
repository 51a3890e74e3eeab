"""Mixture-of-experts families at a mid size on the GPU: fp32 parity with the router's
balancing loss on, every kernel patched (the routed experts on our ``moe_experts``: grouped_mm
and its Triton activation and combine) against the unpatched model (transformers' grouped_mm).

Each family at hidden 1024, 2 layers, 16 heads (4 KV heads, head_dim 64), 8 experts of width
704 with 2 per token, vocab 32000, batch 2 × 256 tokens, router loss coefficient 0.02
(Mixtral's). Tolerance 1e-5 relative (``FP32_TOL``) on the loss, the eval logits and every
gradient, TF32 off. Few tokens on purpose: top-k routing is discontinuous, and the patched and
HF runs differ by rounding (~1e-7 relative), so a token whose second and third experts' scores
lie that close is routed differently by the two, which moves its experts' gradients by about
one token's share (1/128 here), far beyond 1e-5. The chance grows with the routed tokens
(about 1e-5 per token and layer); at 512 tokens × 2 layers it is about 1%. No bf16 parity here
for the same reason, many times over; the CPU tests check bf16 on seeded batches.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ligertune.tools.check import parity_check

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
VOCAB, BATCH, SEQ, LAYERS = 32000, 2, 256, 2
MID = dict(
    vocab_size=VOCAB,
    hidden_size=1024,
    num_hidden_layers=LAYERS,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
    num_experts_per_tok=2,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
QWEN = dict(num_experts=8, moe_intermediate_size=704, intermediate_size=2816)
FAMILIES = {
    "qwen3_moe": dict(**QWEN, norm_topk_prob=True),
    "qwen2_moe": dict(**QWEN, shared_expert_intermediate_size=1408),
    "mixtral": dict(num_local_experts=8, intermediate_size=704),
    "gpt_oss": dict(
        num_local_experts=8,
        intermediate_size=704,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # Multi-head latent attention (its head widths replace MID's), every layer sparse (the dense
    # first layers are checked on the CPU), 2 groups of 4 experts.
    "deepseek_v3": dict(
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=704,
        n_shared_experts=1,
        first_k_dense_replace=0,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        head_dim=32,
        num_key_value_heads=16,
    ),
}


def mid_model(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**MID, **FAMILIES[model_type]})
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and "sinks" not in name:  # norm weights and biases away from their init
                    p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_gpu_moe_parity(model_type):
    torch.backends.cuda.matmul.allow_tf32 = False
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), device=DEVICE)
    labels = input_ids.clone()
    labels[:, :32] = -100  # masked prompts
    result = parity_check(
        mid_model(model_type), {"input_ids": input_ids, "labels": labels}, {"moe_experts": True}
    )  # kernels: all and the experts kernel
    print(result.report, result, sep="\n")
    patched = result.report.patched
    assert patched["rope"] == patched["moe_experts"] == LAYERS and patched["fused_linear_cross_entropy"] == 1
    assert any(n.startswith("experts: ours (moe_experts)") for n in result.report.notes)
    assert result.ok, str(result)
