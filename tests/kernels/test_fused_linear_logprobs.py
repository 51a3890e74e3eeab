"""The chunked log-prob and distillation losses against float64 references with the logits
materialised: values and gradients, several chunks (a tiny memory budget), ignored targets, and
a hand-written closed form of the forward-KL gradient as an independent check. The one-pass mode
(a loss of groups of rows, its gradient computed in the forward) against the same reference
with the group loss applied to all groups at once, on odd shapes and several chunkings.

The GPU tests run at real sizes (Llama-3's vocabulary) on inputs at a trained model's scale
(`_realistic`), against float64 computed in row chunks from the same rounded inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ligertune.kernels.fused_linear_logprobs import (
    GroupLoss,
    fused_linear_distillation,
    fused_linear_distillation_reference,
    fused_linear_logprobs,
    fused_linear_logprobs_reference,
)
from tests.kernels.helpers import fresh_randn, rel_err


def _inputs(n=37, h=16, v=300, dtype=torch.float32, device="cpu"):
    hidden = fresh_randn(n, h, dtype=dtype, device=device)
    weight = fresh_randn(v, h, dtype=dtype, device=device, scale=0.3)
    target = torch.randint(0, v, (n,), device=device)
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


# --------------------------------------------------------------------------------------------
# One pass: a loss of groups of rows
# --------------------------------------------------------------------------------------------


def _grouped_inputs(rows, seq, h, v, bias):
    hidden = fresh_randn(rows * seq, h)
    weight = fresh_randn(v, h, scale=0.3)
    b = fresh_randn(v, scale=0.5) if bias else None
    target = torch.randint(0, v, (rows * seq,))
    target[::5] = -100  # scattered prompt and padding tokens
    target[-seq:] = -100  # a row without labels: Σ log-probs 0, no gradient
    return hidden, weight, b, target


def _margin_loss(ref, weights, size, calls=None, extras=True):
    """A DPO-like loss per group: member 0's log-prob ratio to a per-row constant against the
    other members' mean ratio, through log σ, weighted per group. Nonlinear in the log-probs,
    reading per-row and per-group constants through the chunk's slice; records the slices."""

    def fn(row_logps, groups):
        if calls is not None:
            calls.append(groups)
        ratio = row_logps - ref.to(row_logps.dtype).view(size, -1)[:, groups]
        margin = ratio[0] - ratio[1:].mean(0)
        loss = -(weights.to(row_logps.dtype)[groups] * F.logsigmoid(0.2 * margin)).sum()
        return (loss, {"margin": margin, "first": row_logps[0]}) if extras else loss

    return fn


def _run_grouped(fn, hidden, weight, bias, target, dtype, upstream=1.0, **kw):
    """(output, grads of hidden, weight, bias) of `fn` on fresh leaves in `dtype`."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    out = fn(leaves[0], leaves[1], target, leaves[2], **kw)
    (out.loss * upstream).backward()
    return out, [None if t is None else t.grad for t in leaves]


GROUPED_CASES = [
    # rows, size, seq, vocab, hidden, bias, softcap, budget (bytes), the chunks' group counts
    pytest.param(6, 2, 7, 257, 24, True, None, None, [3], id="pairs-one-chunk"),
    pytest.param(6, 2, 7, 257, 24, True, 4.0, 1, [1, 1, 1], id="pairs-softcap-chunk-per-pair"),
    pytest.param(6, 2, 5, 300, 16, False, None, 25_000, [2, 1], id="pairs-uneven-chunks"),
    pytest.param(6, 3, 5, 131, 8, True, None, 1, [1, 1], id="triples"),
    pytest.param(8, 2, 16, 300, 32, False, 2.0, 80_000, [2, 2], id="pairs-two-per-chunk"),
]


@pytest.mark.parametrize(
    ("rows", "size", "seq", "vocab", "dim", "bias", "softcap", "budget", "chunks"), GROUPED_CASES
)
def test_grouped_matches_float64_reference(rows, size, seq, vocab, dim, bias, softcap, budget, chunks):
    hidden, weight, b, target = _grouped_inputs(rows, seq, dim, vocab, bias)
    ref_logps, weights = fresh_randn(rows, scale=3.0), fresh_randn(rows // size).abs() + 0.5
    calls = []
    with_extras = size == 2  # the triples' loss returns the loss alone
    ours, grads = _run_grouped(
        fused_linear_logprobs,
        hidden,
        weight,
        b,
        target,
        torch.float32,
        upstream=1.7,
        softcap=softcap,
        memory_budget_bytes=budget,
        group_loss=GroupLoss(_margin_loss(ref_logps, weights, size, calls, with_extras), rows, size),
    )
    ref, ref_grads = _run_grouped(
        fused_linear_logprobs_reference,
        hidden,
        weight,
        b,
        target,
        torch.float64,
        upstream=1.7,
        softcap=softcap,
        group_loss=GroupLoss(_margin_loss(ref_logps, weights, size, extras=with_extras), rows, size),
    )
    assert [c.stop - c.start for c in calls] == chunks and calls[0].start == 0
    assert ours.loss.dtype == ours.row_logps.dtype == torch.float32
    torch.testing.assert_close(ours.loss.double(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.row_logps.double(), ref.row_logps, rtol=1e-5, atol=1e-5)
    assert ours.row_logps[-1] == 0 and ours.row_tokens[-1] == 0
    assert torch.equal(ours.row_tokens, (target != -100).view(rows, seq).sum(-1))
    assert ours.extras.keys() == ref.extras.keys() == ({"margin", "first"} if with_extras else set())
    for key, value in ours.extras.items():  # differences of row log-probs (up to ~60, fp32): atol
        assert value.shape == (rows // size,) and not value.requires_grad
        torch.testing.assert_close(value.double(), ref.extras[key], rtol=1e-5, atol=5e-5)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        if r is None:
            assert g is None
            continue
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-6, msg=name)


def test_grouped_several_chunks_equal_one_chunk():
    """The chunking changes nothing but rounding: one pair per chunk against all in one."""
    hidden, weight, b, target = _grouped_inputs(8, 9, 16, 211, bias=True)
    group_loss = GroupLoss(_margin_loss(fresh_randn(8), fresh_randn(4).abs(), 2), rows=8)
    one, one_grads = _run_grouped(
        fused_linear_logprobs, hidden, weight, b, target, torch.float32, group_loss=group_loss
    )
    many, many_grads = _run_grouped(
        fused_linear_logprobs,
        hidden,
        weight,
        b,
        target,
        torch.float32,
        group_loss=group_loss,
        memory_budget_bytes=1,
    )
    torch.testing.assert_close(many.loss, one.loss)
    torch.testing.assert_close(many.row_logps, one.row_logps)
    for key in one.extras:
        torch.testing.assert_close(many.extras[key], one.extras[key])
    for g, r in zip(many_grads, one_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_grouped_bf16_several_chunks():
    """bf16 inputs, one pair per chunk: the dW sum over chunks goes through the fp32 accumulator
    (on CPU in slices of the weight's rows). Within the fused cross entropy's bf16 CPU
    tolerances of float64 (2e-2 normwise for gradients, the interpreter truncating its bf16
    stores; 2e-3 for the loss)."""
    hidden, weight, _, target = _grouped_inputs(8, 9, 32, 300, bias=False)
    group_loss = GroupLoss(_margin_loss(fresh_randn(8), torch.ones(4), 2), rows=8)
    kw = dict(group_loss=group_loss)
    ours, grads = _run_grouped(
        fused_linear_logprobs, hidden, weight, None, target, torch.bfloat16, memory_budget_bytes=1, **kw
    )
    bf16 = [x.bfloat16() for x in (hidden, weight)]
    ref, ref_grads = _run_grouped(fused_linear_logprobs_reference, *bf16, None, target, torch.float64, **kw)
    assert abs(ours.loss.item() - ref.loss.item()) <= 2e-3 * abs(ref.loss.item())
    for g, r in zip(grads[:2], ref_grads[:2], strict=True):
        assert g.dtype == torch.bfloat16 and rel_err(g, r) <= 2e-2, rel_err(g, r)


def test_grouped_without_gradients_and_backward_once():
    """Under no_grad (evaluation, a frozen model) the same loss, log-probs and extras and no
    gradient pass; with gradients, the stored ones are scaled in place, so a second backward
    through the same forward is refused rather than scaling them twice."""
    hidden, weight, _, target = _grouped_inputs(4, 6, 8, 97, bias=False)
    group_loss = GroupLoss(_margin_loss(fresh_randn(4), torch.ones(2), 2), rows=4)
    with torch.no_grad():
        evaluated = fused_linear_logprobs(hidden, weight, target, group_loss=group_loss)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    trained = fused_linear_logprobs(h, w, target, group_loss=group_loss)
    assert not evaluated.loss.requires_grad and trained.loss.requires_grad
    torch.testing.assert_close(evaluated.loss, trained.loss.detach())
    torch.testing.assert_close(evaluated.row_logps, trained.row_logps)
    torch.testing.assert_close(evaluated.extras["margin"], trained.extras["margin"])
    trained.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        trained.loss.backward()


@pytest.mark.parametrize(
    ("tokens", "rows", "size", "message"),
    [
        (12, 5, 1, "do not split into group_loss.rows=5 rows"),
        (12, 3, 2, "rows a multiple of size"),
        (2, 4, 2, "do not split"),
    ],
)
def test_grouped_bad_shapes_are_named(tokens, rows, size, message):
    group_loss = GroupLoss(lambda lp, groups: lp.sum(), rows, size)
    with pytest.raises(ValueError, match=message):
        fused_linear_logprobs(
            fresh_randn(tokens, 4),
            fresh_randn(10, 4),
            torch.zeros(tokens, dtype=torch.long),
            group_loss=group_loss,
        )


# --------------------------------------------------------------------------------------------
# Distillation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("budget", [None, 20_000])
def test_distillation_matches_float64_reference(divergence, budget):
    hidden, weight, target = _inputs()
    teacher_hidden, teacher_weight, _ = _inputs(h=24)
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
    t_hidden, t_weight, _ = _inputs(n=6, v=40)
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


# --------------------------------------------------------------------------------------------
# GPU, real sizes
#
# Tolerances. The inputs are rounded to the test's dtype once, and the float64 reference starts
# from those same values, so what remains is the kernels' own rounding. In bf16 that is the
# logits (cuBLAS accumulates h·Wᵀ in fp32 and rounds the result to bf16: a relative error of at
# most u = 2⁻⁸ per logit), the logits' gradient (rounded to bf16 before the dX/dW matmuls) and
# the outputs. Moving every logit z_j by at most u·|z_j| moves log p(y) = z_y − lse(z) by at most
# u·(|z_y| + Σ_j p_j·|z_j|) to first order (lse's derivative is the softmax): the per-token bound
# checked below, plus 1e-3 for the fp32 accumulation over H = 2048 (~√H · 2⁻²⁴ · |z|, 1e-5 here).
# Emulating that rounding in float64 on CPU (these scales, V = 128256) gives errors at most 0.42×
# the bound, 0.015 at the worst token. The gradients are compared normwise: the bf16 roundings of
# the logits' gradient and of the result each add ≤ u (3.9e-3) per element, the logits' rounding
# moves each probability by ~u·|z_j|, mostly cancelling over the vocabulary; the emulation gives
# 2.3e-3, and we allow 1e-2 (as the fused cross entropy's GPU tests). In fp32 (TF32 off) the
# logits carry only the matmul's accumulation error, ~√H · 2⁻²⁴ · |z| ≈ 5e-6: 2e-4 per token, and
# as it moves each probability by about as much (relative), 3e-5 normwise for the gradients.
# --------------------------------------------------------------------------------------------

U_BF16 = 2.0**-8
BF16_GRAD_REL = 1e-2
FP32_GRAD_REL = 3e-5


def _realistic(n, h, v, dtype, device="cuda"):
    """Final hidden states ~N(0, 1) per feature (what the last RMSNorm feeds the lm_head) and an
    lm_head ~N(0, 0.05²): logits of std 0.05·√h (2.3 at h = 2048), the largest of 128256 about
    11, the range of a trained LM's; targets random, every fifth ignored."""
    hidden = fresh_randn(n, h, dtype=dtype, device=device)
    weight = fresh_randn(v, h, dtype=dtype, device=device, scale=0.05)
    target = torch.randint(0, v, (n,), device=device)
    target[::5] = -100
    return hidden, weight, target


def _float64_reference(hidden, weight, target, upstream, rows=512):
    """float64 per-token log-probs, the first-order bf16 bound u·(|z_y| + Σ p·|z|) per token, and
    the gradients of Σ_t upstream_t · log p_t w.r.t. hidden and weight, computed in row chunks
    from the same (rounded) inputs: the float64 logits of all tokens would take 4-8 GB."""
    w = weight.double()
    n = hidden.shape[0]
    logp = torch.zeros(n, dtype=torch.float64, device=hidden.device)
    bound = torch.zeros_like(logp)
    dh = torch.empty(hidden.shape, dtype=torch.float64, device=hidden.device)
    dw = torch.zeros_like(w)
    for start in range(0, n, rows):
        h, y = hidden[start : start + rows].double(), target[start : start + rows]
        valid, safe = y != -100, y.clamp_min(0)[:, None]
        z = h @ w.T
        log_p = z.log_softmax(-1)
        p = log_p.exp()
        logp[start : start + rows] = torch.where(valid, log_p.gather(-1, safe)[:, 0], 0.0)
        bound[start : start + rows] = U_BF16 * (z.gather(-1, safe)[:, 0].abs() + (p * z.abs()).sum(-1))
        g = torch.where(valid, upstream[start : start + rows].double(), 0.0)
        dz = p.mul_(-g[:, None]).scatter_add_(-1, safe, g[:, None])  # g · (onehot − p)
        dh[start : start + rows] = dz @ w
        dw.addmm_(dz.T, h)
        del z, log_p, p, dz
    return logp, bound, dh, dw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprobs_real_size_gpu(dtype):
    """Llama-3 vocabulary, 2 × 2048 tokens, hidden 2048, a random upstream gradient per token
    (what a sequence loss feeds back): against float64 (tolerances above)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hidden, weight, target = _realistic(4096, 2048, 128256, dtype)
    upstream = fresh_randn(4096, device="cuda")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = fused_linear_logprobs(h, w, target)
    (ours * upstream).sum().backward()
    ref, bound, ref_dh, ref_dw = _float64_reference(hidden, weight, target, upstream)
    assert ours.dtype == torch.float32 and (ours[target == -100] == 0).all()
    err = (ours.double() - ref).abs()
    tol = bound + 1e-3 if dtype == torch.bfloat16 else torch.full_like(bound, 2e-4)
    assert (err <= tol).all(), f"{int((err > tol).sum())} tokens out of bounds; worst {err.max().item():.3g}"
    grad_rel = BF16_GRAD_REL if dtype == torch.bfloat16 else FP32_GRAD_REL
    assert rel_err(h.grad, ref_dh) <= grad_rel, rel_err(h.grad, ref_dh)
    assert rel_err(w.grad, ref_dw) <= grad_rel, rel_err(w.grad, ref_dw)


@pytest.mark.gpu
def test_grouped_real_size_gpu():
    """The DPO shape of scripts/dpo_bench.py: 4 pairs × 2 rows × 1024 tokens (the first quarter
    a prompt), hidden 2048, vocabulary 128256, bf16; default budget (one pair per chunk). The
    group loss is DPO's at β = 0.1 with reference log-probs set so that β·Δ is of order 1.

    Row log-probs against float64: each token's error is bounded above (≤ 0.04, 0.003 on
    average in the emulation), i.e. ≤ 3e-3 and on average 2e-4 of |log p| ≈ 14; the rows sum
    ~770 of them, so 1e-3 of |Σ log p| holds with 5× room even if the average error did not
    cancel at all (it mostly does: independent roundings). The loss is then the group loss of
    those row log-probs (float64, tight). The gradients: float64 with the upstream gradient of
    each row taken from the group loss at our row log-probs, so that only the kernel's
    gradient pass is compared (normwise, tolerances above). Finally the recompute path (the
    per-token log-probs, the same loss by autograd): the same logits' roundings, so the two
    agree to about one bf16 rounding (u)."""
    rows, seq, beta = 8, 1024, 0.1
    hidden, weight, target = _realistic(rows * seq, 2048, 128256, torch.bfloat16)
    target.view(rows, seq)[:, : seq // 4] = -100
    target.view(rows, seq)[:, -1] = -100
    tokens = (target != -100).view(rows, seq).sum(-1)
    ref_token, _, _, _ = _float64_reference(hidden, weight, target, torch.zeros(rows * seq, device="cuda"))
    ref_rows = ref_token.view(rows, seq).sum(-1)
    ref_logps = ref_rows + fresh_randn(rows, device="cuda", dtype=torch.float64, scale=5.0)

    def dpo(row_logps, pairs):
        ratio = row_logps - ref_logps.to(row_logps.dtype).view(2, -1)[:, pairs]
        margin = ratio[0] - ratio[1]
        return -F.logsigmoid(beta * margin).sum() / (rows // 2), {"margin": margin}

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = fused_linear_logprobs(h, w, target, group_loss=GroupLoss(dpo, rows))
    ours.loss.backward()
    assert torch.equal(ours.row_tokens, tokens)
    assert ((ours.row_logps.double() - ref_rows).abs() <= 1e-3 * ref_rows.abs()).all(), (
        ours.row_logps,
        ref_rows,
    )
    at_ours = ours.row_logps.double().requires_grad_()
    loss64 = dpo(at_ours.view(2, -1), slice(0, rows // 2))[0]
    # The kernel evaluates the group loss in fp32 on row log-probs of magnitude ~1e4, whose ulp
    # is ~1e-3: β·(differences of them) carries ~1e-4 of absolute error into a loss of ~0.7
    # (1.2e-5 relative measured on an H100); float64 here. 2e-4 relative bounds that.
    torch.testing.assert_close(ours.loss.double(), loss64.detach(), rtol=2e-4, atol=1e-6)
    (row_grad,) = torch.autograd.grad(loss64, at_ours)
    _, _, ref_dh, ref_dw = _float64_reference(hidden, weight, target, row_grad.repeat_interleave(seq))
    assert rel_err(h.grad, ref_dh) <= BF16_GRAD_REL, rel_err(h.grad, ref_dh)
    assert rel_err(w.grad, ref_dw) <= BF16_GRAD_REL, rel_err(w.grad, ref_dw)
    del ref_dh, ref_dw

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    token = fused_linear_logprobs(h2, w2, target)
    recomputed, _ = dpo(token.view(rows, seq).sum(-1).view(2, -1), slice(0, rows // 2))
    recomputed.backward()
    torch.testing.assert_close(ours.loss, recomputed.detach(), rtol=1e-3, atol=1e-4)
    assert rel_err(h.grad, h2.grad) <= U_BF16 and rel_err(w.grad, w2.grad) <= U_BF16


@pytest.mark.gpu
def test_distillation_real_size_gpu():
    """2048 tokens, student hidden 2048 and teacher 3072, vocabulary 128256, bf16, against float64
    in row chunks. The loss is a mean over tokens of α·CE + (1 − α)·T²·KL, each moved per token
    by the bf16 logits of both models (as log p above; emulated: ≤ 0.025, 0.0023 on average)
    against a loss of ~8.4 here: 5e-3 relative holds with 18× room even if nothing cancelled.
    Gradients: as above."""
    hidden, weight, target = _realistic(2048, 2048, 128256, torch.bfloat16)
    t_hidden, t_weight, _ = _realistic(2048, 3072, 128256, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, _ = fused_linear_distillation(h, w, t_hidden, t_weight, target, num_items=2048)
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    t_w64 = t_weight.double()
    ref = 0.0
    for start in range(0, 2048, 256):
        part = slice(start, start + 256)
        ref_part, _, _ = fused_linear_distillation_reference(
            h64[part], w64, t_hidden[part].double(), t_w64, target[part], num_items=2048
        )
        ref_part.backward()  # Σ of the chunks' losses: each is already divided by the 2048 items
        ref += ref_part.item()
    assert abs(loss.item() - ref) <= 5e-3 * abs(ref), (loss.item(), ref)
    assert rel_err(h.grad, h64.grad) <= BF16_GRAD_REL, rel_err(h.grad, h64.grad)
    assert rel_err(w.grad, w64.grad) <= BF16_GRAD_REL, rel_err(w.grad, w64.grad)
