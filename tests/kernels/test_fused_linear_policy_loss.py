"""The fused GRPO-family policy loss against a float64 oracle written here from the papers'
formulas (a loop over completions, the clip as the papers' case analysis rather than a min of two
products), with the logits materialised: loss, metrics and the gradients of hidden, weight and
bias, for every loss type, with and without the KL term, on fresh random inputs and awkward
shapes (odd vocabularies, one row, completions of every length including none, several chunks,
a softcap), with ratios spread across both clip edges, and exactly on them.

Kept away from the edges in the random cases: a ratio within 1e-3 of 1 ± ε would be clipped
on one side of fp32 rounding and not on the other, moving the gradient by a whole term. The
exact edges are tested where they can be exact: ε = 0 with one update (ratio 1 = both edges),
and `policy_losses` on float64 log-ratios whose exponential is exactly 1 ± ε.

The GPU test runs Qwen2.5's vocabulary (151,936) on 8 × 1024 completion tokens in bf16 against
float64 computed in row chunks."""

from __future__ import annotations

import math

import pytest
import torch

from ligertune.kernels.fused_linear_policy_loss import (
    LOSS_TYPES,
    PolicyLoss,
    fused_linear_policy_loss,
    fused_linear_policy_loss_reference,
    policy_losses,
)
from tests.kernels.helpers import fresh_randn, rel_err

EDGE_MARGIN = 1e-3


def _clip_case(r, a, low, high):
    """The clipped surrogate −min(r·A, clip(r)·A) per the papers' case analysis: clipped (a
    constant, no gradient) when r < 1 − ε with A < 0 or r > 1 + ε_high with A > 0, else −A·r."""
    lower = (r < low) & torch.tensor(a < 0)
    upper = (r > high) & torch.tensor(a > 0)
    kept = torch.where(lower, torch.full_like(r, low), torch.where(upper, torch.full_like(r, high), r))
    return -a * kept, lower, upper


def oracle(hidden, weight, bias, target, advantages, old, ref, spec, softcap=None):
    """float64 (loss, metrics) of the module docstring's formulas, written as the papers state
    them, row by row; differentiable in hidden, weight and bias (float64 leaves)."""
    rows = advantages.shape[0]
    z = hidden @ weight.T + (0 if bias is None else bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = (target != -100).view(rows, -1)
    logp = z.log_softmax(-1).gather(-1, target.clamp_min(0)[:, None])[:, 0].view(rows, -1)
    low, high = 1 - spec.epsilon, 1 + spec.high
    total = torch.zeros((), dtype=torch.float64)
    sums = {"kl": 0.0, "clip_fraction": 0.0, "clip_low_fraction": 0.0, "clip_high_fraction": 0.0}
    tokens = int(valid.sum())
    for i in range(rows):
        t = valid[i].nonzero()[:, 0]
        a = float(advantages[i])
        lp = logp[i, t]
        old_i = lp.detach() if old is None else old[i, t].double()
        n_i = len(t)
        kl = torch.exp(ref[i, t].double() - lp) - (ref[i, t].double() - lp) - 1 if ref is not None else None
        per_item = 1.0 / max(n_i, 1) if spec.loss_type != "dapo" else 1.0

        if spec.loss_type == "gspo":
            if n_i == 0:
                continue
            s = torch.exp((lp - old_i).sum() / n_i)
            term, lower, upper = _clip_case(s[None], a, low, high)
            term = term[0] + (spec.beta * kl.sum() / n_i if spec.beta else 0)
            lower, upper = lower.double().expand(n_i), upper.double().expand(n_i)
        else:
            term_t, lower, upper = _clip_case(torch.exp(lp - old_i), a, low, high)
            if spec.beta:
                term_t = term_t + spec.beta * kl
            term = term_t.sum()
            if spec.loss_type == "grpo":
                term = term / max(n_i, 1)
            elif spec.loss_type == "dr_grpo":
                term = term / (spec.max_completion_length or valid.shape[1])
        total = total + term
        lower, upper = lower.double(), upper.double()
        sums["clip_low_fraction"] += float(lower.sum()) * per_item
        sums["clip_high_fraction"] += float(upper.sum()) * per_item
        sums["clip_fraction"] += float((lower + upper).sum()) * per_item
        if kl is not None:
            sums["kl"] += float(kl.sum()) * per_item
    n = tokens if spec.loss_type == "dapo" else rows
    n = max(n, 1)
    metrics = {k: v / n for k, v in sums.items() if k != "kl" or ref is not None}
    return total / n, metrics


def _inputs(rows, seq, vocab, dim, bias, empty_row):
    hidden = fresh_randn(rows * seq, dim)
    weight = fresh_randn(vocab, dim, scale=0.3)
    b = fresh_randn(vocab, scale=0.5) if bias else None
    target = torch.randint(0, vocab, (rows * seq,))
    lengths = torch.randint(1, seq + 1, (rows,))
    lengths[0] = seq  # one full row
    if empty_row:
        lengths[-1] = 0  # a completion that is all padding: no loss, no gradient
    pad = torch.arange(seq)[None, :] >= lengths[:, None]
    target.view(rows, seq)[pad] = -100
    return hidden, weight, b, target


def _float64_logps(hidden, weight, bias, target, rows, softcap=None):
    z = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z.log_softmax(-1).gather(-1, target.clamp_min(0)[:, None])[:, 0].view(rows, -1)


def _away_from_edges(logps, old, spec):
    """Shift old log-probs whose ratio falls within EDGE_MARGIN of a clip edge (see the module
    docstring); token ratios for the token-level losses."""
    low, high = 1 - spec.epsilon, 1 + spec.high
    for _ in range(5):
        ratio = torch.exp(logps - old)
        near = ((ratio - low).abs() < EDGE_MARGIN) | ((ratio - high).abs() < EDGE_MARGIN)
        if not near.any():
            break
        old = torch.where(near, old + 0.01, old)
    return old


def _leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


CASES = [
    # rows, seq, vocab, hidden, bias, softcap, budget (bytes), empty row
    pytest.param(5, 7, 257, 24, True, None, None, True, id="one-chunk-empty-row"),
    pytest.param(1, 9, 131, 8, False, None, None, False, id="one-row"),
    pytest.param(6, 4, 1001, 16, True, None, 1, True, id="chunk-per-row-odd-vocab"),
    pytest.param(4, 6, 300, 16, False, 3.0, 20_000, False, id="softcap-two-rows-per-chunk"),
]


# Every shape with old log-probs of a previous update (ratios across both edges); one update
# (old = the current log-probs, ratio 1) on two of them.
ONE_UPDATE = ("one-chunk-empty-row", "chunk-per-row-odd-vocab")
GRID = [
    pytest.param(loss_type, beta, with_old, *case.values, id=f"{case.id}-{loss_type}-beta{beta}-{label}")
    for case in CASES
    for loss_type in LOSS_TYPES
    for beta in (0.0, 0.04)
    for with_old, label in ((True, "old"), (False, "one-update"))
    if with_old or case.id in ONE_UPDATE
]


@pytest.mark.parametrize(
    (
        "loss_type",
        "beta",
        "with_old",
        "rows",
        "seq",
        "vocab",
        "dim",
        "bias",
        "softcap",
        "budget",
        "empty_row",
    ),
    GRID,
)
def test_matches_float64_oracle(
    loss_type, beta, with_old, rows, seq, vocab, dim, bias, softcap, budget, empty_row
):
    spec = PolicyLoss(loss_type, epsilon=0.2, epsilon_high=0.28 if loss_type == "dapo" else None, beta=beta)
    hidden, weight, b, target = _inputs(rows, seq, vocab, dim, bias, empty_row)
    logps = _float64_logps(hidden, weight, b, target, rows, softcap)
    advantages = fresh_randn(rows)
    advantages[rows // 2] = 0.0  # a completion that no reward told apart
    old = None
    if with_old:
        noise = fresh_randn(rows, seq, dtype=torch.float64, scale=0.3 if loss_type != "gspo" else 1.0)
        old = _away_from_edges(logps, logps + noise, spec).float()
        if loss_type == "gspo":  # the sequence ratio, kept from the edges likewise
            valid = (target != -100).view(rows, -1)
            mean = ((logps - old.double()) * valid).sum(-1) / valid.sum(-1).clamp_min(1)
            shift = _away_from_edges(mean, torch.zeros_like(mean), spec)
            old = (old.double() + shift[:, None]).float()
    ref = (logps + fresh_randn(rows, seq, dtype=torch.float64, scale=0.2)).float() if beta else None
    h, w, bb = _leaves((hidden, weight, b), torch.float32)
    ours = fused_linear_policy_loss(
        h, w, target, advantages, old, ref, bb, spec=spec, softcap=softcap, memory_budget_bytes=budget
    )
    (ours.loss * 1.7).backward()
    h64, w64, b64 = _leaves((hidden, weight, b), torch.float64)
    expected, metrics = oracle(h64, w64, b64, target, advantages, old, ref, spec, softcap)
    (expected * 1.7).backward()
    assert ours.loss.dtype == torch.float32
    torch.testing.assert_close(ours.loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert set(ours.metrics) == set(metrics)
    for key, value in metrics.items():
        torch.testing.assert_close(
            ours.metrics[key].double(), torch.tensor(value, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    if bias:
        torch.testing.assert_close(bb.grad.double(), b64.grad, rtol=1e-4, atol=1e-6)
    if empty_row:  # the all-padding completion's hidden states get no gradient
        assert (h.grad.view(rows, seq, -1)[-1] == 0).all()


def test_clipping_happened_on_both_sides():
    """The random cases reach both clip edges (else the comparisons above would not test the
    clip): with ratios spread by noise of std 0.3, both fractions average ~0.11 of the tokens.
    One draw of 16 × 8 tokens (some of them padding) can fall near zero by chance (0.012 was
    seen once), so the fractions are averaged over four fresh draws."""
    spec = PolicyLoss("dapo", epsilon=0.2, epsilon_high=0.28)
    rows, seq, draws = 16, 8, 4
    low = high = 0.0
    for _ in range(draws):
        hidden, weight, _, target = _inputs(rows, seq, 257, 16, False, False)
        logps = _float64_logps(hidden, weight, None, target, rows)
        advantages = torch.cat([torch.ones(rows // 2), -torch.ones(rows // 2)])
        old = (logps + fresh_randn(rows, seq, dtype=torch.float64, scale=0.3)).float()
        out = fused_linear_policy_loss(hidden, weight, target, advantages, old, spec=spec)
        low += out.metrics["clip_low_fraction"].item() / draws
        high += out.metrics["clip_high_fraction"].item() / draws
    assert low > 0.04 and high > 0.04, (low, high)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_ratio_one_is_on_both_edges_at_epsilon_zero(loss_type):
    """ε = ε_high = 0 and one update (old = current): every ratio is exactly 1, on both clip
    edges. The gradient flows there (the formula's limit from inside), as the oracle's strict
    inequalities say: the plain policy gradient −A·∇log p, scaled per item."""
    spec = PolicyLoss(loss_type, epsilon=0.0, epsilon_high=0.0)
    rows, seq = 4, 5
    hidden, weight, b, target = _inputs(rows, seq, 211, 12, True, True)
    advantages = fresh_randn(rows)
    h, w, bb = _leaves((hidden, weight, b), torch.float32)
    ours = fused_linear_policy_loss(h, w, target, advantages, None, None, bb, spec=spec)
    ours.loss.backward()
    h64, w64, b64 = _leaves((hidden, weight, b), torch.float64)
    expected, metrics = oracle(h64, w64, b64, target, advantages, None, None, spec)
    expected.backward()
    assert metrics["clip_fraction"] == 0.0 and float(ours.metrics["clip_fraction"]) == 0.0
    torch.testing.assert_close(ours.loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    assert h.grad.abs().sum() > 0
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("side", ["high", "low"])
def test_exact_edges_in_float64(side):
    """`policy_losses` on float64 log-ratios whose exponential is exactly 1 + ε_high (A > 0) or
    1 − ε (A < 0): not clipped, gradient −A·r/|o| per token (grpo); 1e-12 of log-ratio
    further out: clipped, no gradient. Checked against the derivative written out by hand."""
    eps, eps_high = 0.2, 0.28
    edge = 1 + eps_high if side == "high" else 1 - eps
    a = 1.5 if side == "high" else -1.5
    log_edge = math.log(edge)
    assert (
        math.exp(log_edge) == edge and torch.exp(torch.tensor(log_edge, dtype=torch.float64)).item() == edge
    )
    # A hair further out (one ulp of the log-ratio would round back to the edge in exp).
    outward = log_edge + (1e-12 if side == "high" else -1e-12)
    assert math.exp(outward) != edge
    logps = torch.tensor([[log_edge, outward, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    spec = PolicyLoss("grpo", epsilon=eps, epsilon_high=eps_high)
    row, metrics = policy_losses(logps, mask, torch.tensor([a], dtype=torch.float64), old, None, spec)
    row.sum().backward()
    expected = torch.tensor([[-a * edge / 2, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(logps.grad, expected), logps.grad
    assert metrics["clip_fraction"].item() == 0.5
    assert metrics[f"clip_{side}_fraction"].item() == 0.5


def test_all_masked_batch_is_zero():
    """No completion token at all: loss 0, gradients 0 (not NaN), metrics 0."""
    rows, seq = 3, 4
    hidden, weight, _, target = _inputs(rows, seq, 97, 8, False, False)
    target[:] = -100
    h, w = _leaves((hidden, weight), torch.float32)
    old = fresh_randn(rows, seq)
    out = fused_linear_policy_loss(
        h, w, target, fresh_randn(rows), old, old, spec=PolicyLoss("dapo", beta=0.1)
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert (h.grad == 0).all() and (w.grad == 0).all()
    assert all(v.item() == 0.0 for v in out.metrics.values())


def test_reference_path_is_the_oracle_too():
    """The materialised fallback (what runs without Triton) agrees with the oracle as well."""
    spec = PolicyLoss("gspo", epsilon=0.2, beta=0.04)
    rows, seq = 3, 5
    hidden, weight, _, target = _inputs(rows, seq, 150, 8, False, False)
    ref = fresh_randn(rows, seq)
    advantages = fresh_randn(rows)
    h, w = _leaves((hidden, weight), torch.float64)
    out = fused_linear_policy_loss_reference(h, w, target, advantages, None, ref, spec=spec)
    out.loss.backward()
    h64, w64 = _leaves((hidden, weight), torch.float64)
    expected, metrics = oracle(h64, w64, None, target, advantages, None, ref, spec)
    expected.backward()
    torch.testing.assert_close(out.loss, expected.detach())
    torch.testing.assert_close(h.grad, h64.grad)
    # The metrics are float32 by design (logged values, summed in fp32): fp32's resolution, not fp64's.
    kl = torch.tensor(metrics["kl"], dtype=torch.float64)
    torch.testing.assert_close(out.metrics["kl"].double(), kl, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (dict(advantages=torch.zeros(3)), "expected [R·T, H], [R·T] and [R]"),
        (dict(old=torch.zeros(2, 3)), "old_logps has shape (2, 3)"),
        (dict(beta=0.1), "needs ref_logps"),
    ],
)
def test_bad_inputs_are_named(shape, message):
    hidden, weight, _, target = _inputs(2, 4, 50, 8, False, False)
    advantages = shape.get("advantages", torch.zeros(2))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        fused_linear_policy_loss(
            hidden, weight, target, advantages, shape.get("old"), spec=PolicyLoss(beta=shape.get("beta", 0.0))
        )


# --------------------------------------------------------------------------------------------
# GPU, real size
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_real_size_gpu(loss_type):
    """8 completions × 1024 tokens (8k completion tokens), hidden 1536 and Qwen2.5's vocabulary
    151,936, bf16, β = 0.04, old log-probs of a previous update (ratios spread over both clip
    edges, kept 0.1 from them: a bf16 log-prob is off by ≤ 0.04, which moves a ratio by ≤ 4%).
    The reference: float64 log-probs and gradients in row chunks from the same rounded inputs
    (`tests.kernels.test_fused_linear_logprobs._float64_reference`), the loss's per-token
    gradient taken from `policy_losses` in float64 at those log-probs."""
    from tests.kernels.test_fused_linear_logprobs import BF16_GRAD_REL, _float64_reference, _realistic

    torch.backends.cuda.matmul.allow_tf32 = False
    rows, seq = 8, 1024
    hidden, weight, _ = _realistic(rows * seq, 1536, 151936, torch.bfloat16)
    target = torch.randint(0, 151936, (rows * seq,), device="cuda")
    lengths = torch.randint(seq // 2, seq + 1, (rows,), device="cuda")
    target.view(rows, seq)[torch.arange(seq, device="cuda")[None] >= lengths[:, None]] = -100
    logps64, _, _, _ = _float64_reference(hidden, weight, target, torch.zeros(rows * seq, device="cuda"))
    logps64 = logps64.view(rows, seq)
    spec = PolicyLoss(loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.04)
    old = logps64 + fresh_randn(rows, seq, device="cuda", dtype=torch.float64, scale=0.3)
    for _ in range(10):  # 0.1 from the edges
        ratio = torch.exp(logps64 - old)
        near = ((ratio - 0.8).abs() < 0.1) | ((ratio - 1.28).abs() < 0.1)
        old = torch.where(near, old + 0.25, old)
    ref = logps64 + fresh_randn(rows, seq, device="cuda", dtype=torch.float64, scale=0.1)
    advantages = fresh_randn(rows, device="cuda")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = fused_linear_policy_loss(h, w, target, advantages, old.float(), ref.float(), spec=spec)
    ours.loss.backward()
    at = logps64.clone().requires_grad_()
    mask = (target != -100).view(rows, seq)
    rows_loss, _ = policy_losses(at, mask, advantages.double(), old, ref, spec)
    n = mask.sum() if loss_type == "dapo" else rows
    loss64 = rows_loss.sum() / n
    (upstream,) = torch.autograd.grad(loss64, at)
    torch.testing.assert_close(ours.loss.double(), loss64.detach(), rtol=1e-2, atol=1e-4)
    _, _, ref_dh, ref_dw = _float64_reference(hidden, weight, target, upstream.view(-1))
    assert rel_err(h.grad, ref_dh) <= BF16_GRAD_REL, rel_err(h.grad, ref_dh)
    assert rel_err(w.grad, ref_dw) <= BF16_GRAD_REL, rel_err(w.grad, ref_dw)
