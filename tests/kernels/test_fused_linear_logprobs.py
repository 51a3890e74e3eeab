"""The chunked log-prob and distillation losses against float64 references with the logits
materialised: values and gradients, several chunks (a tiny memory budget), ignored targets, and
a hand-written closed form of the forward-KL gradient as an independent check."""

from __future__ import annotations

import pytest
import torch

from ligertune.kernels.fused_linear_logprobs import (
    fused_linear_distillation,
    fused_linear_distillation_reference,
    fused_linear_logprobs,
    fused_linear_logprobs_reference,
)


def _inputs(n=37, h=16, v=300, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(device, dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3).to(device, dtype)
    target = torch.randint(0, v, (n,), generator=g).to(device)
    target[::5] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), target


@pytest.mark.parametrize("budget", [None, 4096])  # one chunk; many chunks of a few rows
def test_logprobs_match_float64_reference(budget):
    hidden, weight, target = _inputs()
    upstream = torch.randn(hidden.shape[0], dtype=torch.float64)
    ours = fused_linear_logprobs(hidden, weight, target, memory_budget_bytes=budget)
    (ours.double() * upstream).sum().backward()
    h64, w64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    ref = fused_linear_logprobs_reference(h64, w64, target)
    (ref * upstream).sum().backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    assert (ours[target == -100] == 0).all()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_logprobs_are_log_softmax_at_the_target():
    """Independent of the kernel: exp(logp) summed over every class is 1 for each row."""
    hidden, weight, _ = _inputs(n=4, v=50)
    rows = torch.arange(4).repeat_interleave(50)
    classes = torch.arange(50).repeat(4)
    logp = fused_linear_logprobs(hidden.detach()[rows], weight.detach(), classes)
    torch.testing.assert_close(logp.exp().view(4, 50).sum(-1), torch.ones(4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("budget", [None, 20_000])
def test_distillation_matches_float64_reference(divergence, budget):
    hidden, weight, target = _inputs()
    teacher_hidden, teacher_weight, _ = _inputs(h=24, seed=1)
    options = dict(divergence=divergence, temperature=2.0, jsd_beta=0.3, ce_weight=0.4)
    loss, ce, div = fused_linear_distillation(
        hidden,
        weight,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        target,
        num_items=7,
        memory_budget_bytes=budget,
        **options,
    )
    (loss * 3).backward()
    h64, w64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    ref, ref_ce, ref_div = fused_linear_distillation_reference(
        h64,
        w64,
        teacher_hidden.detach().double(),
        teacher_weight.detach().double(),
        target,
        num_items=7,
        **options,
    )
    (ref * 3).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce.double(), ref_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(div.double(), ref_div, rtol=1e-5, atol=1e-6)
    assert div > 0
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_forward_kl_gradient_closed_form():
    """Independent check (Hinton et al. 2015): d/dz_s [T²·KL(p‖q)] = T·(q − p) per token, and the
    CE part softmax(z_s) − onehot; the student hidden gradient is that times W."""
    hidden, weight, target = _inputs(n=6, v=40)
    target = target.clamp_min(0)
    t_hidden, t_weight, _ = _inputs(n=6, v=40, seed=3)
    T, alpha = 1.7, 0.25
    loss, _, _ = fused_linear_distillation(
        hidden, weight, t_hidden.detach(), t_weight.detach(), target, temperature=T, ce_weight=alpha
    )
    loss.backward()
    with torch.no_grad():
        zs, zt = (hidden @ weight.T).double(), (t_hidden @ t_weight.T).double()
        q, p = (zs / T).softmax(-1), (zt / T).softmax(-1)
        dz = alpha * (zs.softmax(-1) - torch.nn.functional.one_hot(target, 40)) + (1 - alpha) * T * (q - p)
    torch.testing.assert_close(hidden.grad.double(), dz @ weight.detach().double(), rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprobs_real_size_gpu(dtype):
    """Llama-3 vocabulary, 2 × 1024-token pair rows: against the materialised fp32 reference."""
    hidden, weight, target = _inputs(n=4096, h=2048, v=128256, dtype=dtype, device="cuda")
    ours = fused_linear_logprobs(hidden, weight, target)
    ours.sum().backward()
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    ref = fused_linear_logprobs_reference(h32, w32, target)
    ref.sum().backward()
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(hidden.grad.float(), h32.grad, **tol)


@pytest.mark.gpu
def test_distillation_real_size_gpu():
    hidden, weight, target = _inputs(n=2048, h=2048, v=128256, dtype=torch.bfloat16, device="cuda")
    t_hidden, t_weight, _ = _inputs(n=2048, h=3072, v=128256, dtype=torch.bfloat16, seed=1, device="cuda")
    loss, _, _ = fused_linear_distillation(
        hidden, weight, t_hidden.detach(), t_weight.detach(), target, num_items=2048
    )
    loss.backward()
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    ref, _, _ = fused_linear_distillation_reference(
        h32, w32, t_hidden.detach().float(), t_weight.detach().float(), target, num_items=2048
    )
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(hidden.grad.float(), h32.grad, rtol=5e-2, atol=5e-3)
