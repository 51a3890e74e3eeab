"""Training with the fused linear cross entropy follows training with lm_head + F.cross_entropy.

A small Llama (random init from LlamaConfig) is trained twice from the same initial weights on
the same batches: once computing the loss from materialised logits, once with
``fused_linear_cross_entropy`` on the final hidden states. The per-step losses must agree to
1e-3 relative over 200 bf16 steps on the GPU. The models' own ``.model`` gives the hidden states,
so this test does not depend on the patching code.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from ligertune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy


def _batches(n_steps, batch, seq, vocab, seed=1234):
    """Token batches from a fixed generator: Zipf-distributed tokens whose second half repeats
    the first, so the loss has something to learn (unigram statistics, then copying)."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 10.0)
    half = seq // 2
    for _ in range(n_steps):
        first = torch.multinomial(probs, batch * half, replacement=True, generator=gen).view(batch, half)
        yield torch.cat([first, first], dim=1)


def _train(model, use_flce, *, n_steps, batch, seq, device, lr):
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for ids in _batches(n_steps, batch, seq, model.config.vocab_size):
        ids = ids.to(device)
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        target = ids[:, 1:].reshape(-1)
        if use_flce:
            loss = fused_linear_cross_entropy(hidden, model.lm_head.weight, target)
        else:
            loss = F.cross_entropy(model.lm_head(hidden).float(), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), model


def _model(vocab, hidden, layers, dtype, device):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    # Eager attention: deterministic backward, so the two runs differ only in the loss.
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _compare(losses_ref, losses_flce, rel_tol):
    rel = (losses_flce - losses_ref).abs() / losses_ref.abs()
    worst = int(rel.argmax())
    assert rel.max() <= rel_tol, (
        f"step {worst}: fused {losses_flce[worst]:.6f} vs reference {losses_ref[worst]:.6f} "
        f"(relative {rel[worst]:.2e} > {rel_tol})"
    )


def test_cpu_smoke_fp32():
    """The same comparison, tiny and in fp32, so CI exercises the training wiring. Too few steps
    to see learning through the noise of fresh batches, so it also checks that the weights moved
    and ended up the same in both runs."""
    model = _model(vocab=512, hidden=64, layers=1, dtype=torch.float32, device="cpu")
    kw = dict(n_steps=4, batch=2, seq=16, device="cpu", lr=1e-2)
    (ref, ref_model), (ours, our_model) = _train(model, False, **kw), _train(model, True, **kw)
    _compare(ref, ours, 1e-5)
    for name, p0 in model.named_parameters():
        p_ref, p_ours = ref_model.get_parameter(name), our_model.get_parameter(name)
        assert (p_ref - p0).norm() > 1e-3 * p0.norm(), f"{name} did not train"
        assert (p_ours - p_ref).norm() <= 1e-4 * (p_ref - p0).norm(), f"{name} trained differently"


@pytest.mark.gpu
def test_200_steps_bf16_llama():
    model = _model(vocab=32000, hidden=256, layers=2, dtype=torch.bfloat16, device="cuda")
    kw = dict(n_steps=200, batch=8, seq=256, device="cuda", lr=1e-3)
    (ref, _), (ours, _) = _train(model, False, **kw), _train(model, True, **kw)
    # From ln(32000) ≈ 10.4 towards the data's unigram entropy (8.4) and below (copying).
    assert ref[-10:].mean() < ref[0] - 0.5, f"the reference run should learn: {ref[0]:.3f} → {ref[-1]:.3f}"
    _compare(ref, ours, 1e-3)
