"""Cross entropy kernel vs independent float64 oracles.

The oracle for every option is built from ``torch.nn.functional.cross_entropy`` in float64:
soft-capping is applied to the logits before it (autograd supplies the chain rule), the z-loss
is added from ``torch.logsumexp``, and the mean's denominator is the one PyTorch documents for the
cross entropy, the non-ignored token count for the z-loss (``kernels/cross_entropy.py``,
"Reductions"). So neither the kernel nor ``cross_entropy_reference`` is checked against itself.

CPU shapes stay small (the Triton interpreter pays per program and per loop iteration); under
the interpreter the kernel loops over blocks of 1024 columns, so vocabularies 1000, 3001 and 4093
cover one partial block and several blocks with a partial last one.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ligertune.kernels.cross_entropy import (
    CrossEntropyLoss,
    CrossEntropyOutput,
    check_options,
    cross_entropy,
    cross_entropy_reference,
    launch_cross_entropy,
)
from tests.kernels.helpers import assert_close, fresh_randn, poison_, rel_err

IMPLS = {"triton": cross_entropy, "reference": cross_entropy_reference}


def _targets(n_rows, n_cols, ignore_index=-100, n_ignored=3, device="cpu"):
    """Random targets with `n_ignored` rows set to ignore_index (and none of the others equal to it)."""
    t = torch.randint(0, n_cols, (n_rows,), device=device)
    t = torch.where(t == ignore_index, (t + 1) % n_cols, t)
    t[torch.randperm(n_rows, device=device)[:n_ignored]] = ignore_index
    return t


def oracle(
    logits,
    target,
    *,
    weight=None,
    ignore_index=-100,
    label_smoothing=0.0,
    lse_square_scale=0.0,
    softcap=None,
    reduction="mean",
    num_items_in_batch=None,
):
    """float64 loss from F.cross_entropy plus the documented extras (differentiable)."""
    z = logits.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    w = None if weight is None else weight.double()
    per_token = F.cross_entropy(
        z, target, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = target != ignore_index
    z_loss = torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return per_token + z_loss
    if num_items_in_batch is not None:
        return (per_token.sum() + z_loss.sum()) / float(num_items_in_batch)
    if reduction == "sum":
        return per_token.sum() + z_loss.sum()
    denom = valid.sum() if w is None else w[target[valid]].sum()
    return per_token.sum() / denom + z_loss.sum() / valid.sum()


def _run(fn, logits, target, upstream=None, **kwargs):
    """(output, logits.grad) for fn on a fresh leaf copy of `logits`, backpropagating `upstream`."""
    x = logits.detach().clone().requires_grad_()
    out = fn(x, target, **kwargs)
    loss = out.loss if isinstance(out, CrossEntropyOutput) else out
    if upstream is None:
        loss.sum().backward()
    else:
        (loss * upstream).sum().backward()
    return out, x.grad


def _assert_within_4_bf16_ulps(grad, ref, rows_per_chunk: int = 1024):
    """The bound for a bf16 gradient rounded twice (forward, then times a non-unit upstream).
    Compared in row chunks: float64 copies of an 8192 × 256000 gradient (16 GiB each) would not
    fit an 80 GB GPU next to the test's own tensors."""
    scale = sum(chunk.double().abs().sum() for chunk in ref.split(rows_per_chunk)) / ref.numel()
    bad = 0
    for g, r in zip(grad.split(rows_per_chunk), ref.split(rows_per_chunk), strict=True):
        r = r.double()
        bad += int(((g.double() - r).abs() > 2.0**-6 * (r.abs() + scale)).sum())
    assert bad == 0, f"grad: {bad} of {ref.numel()} elements outside 4 bf16 ulps"


def _upstream(reduction, n_rows):
    # Never exactly 1 for a scalar: the backward's rescaling kernel must run (1 is its skip path).
    if reduction == "none":
        return torch.randn(n_rows, dtype=torch.float64)
    return torch.rand((), dtype=torch.float64) + 0.5


# --------------------------------------------------------------------------------------------
# Against torch.nn.functional.cross_entropy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_torch_cross_entropy(impl, reduction, label_smoothing, weighted):
    n_rows, n_cols = 19, 3001
    logits = fresh_randn(n_rows, n_cols, scale=3.0)
    target = _targets(n_rows, n_cols)
    weight = torch.rand(n_cols) + 0.25 if weighted else None
    upstream = _upstream(reduction, n_rows)
    kw = dict(weight=weight, label_smoothing=label_smoothing, reduction=reduction)

    out, grad = _run(IMPLS[impl], logits, target, upstream.float(), **kw)
    ref, ref_grad = _run(
        lambda x, t, **k: F.cross_entropy(
            x,
            t,
            weight=None if weight is None else weight.double(),
            label_smoothing=label_smoothing,
            reduction=reduction,
        ),
        logits.double(),
        target,
        upstream,
    )
    assert out.dtype == torch.float32
    assert_close(out, ref, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.float32, "grad")


# --------------------------------------------------------------------------------------------
# Every combination of smoothing, z-loss, softcap, ignore_index and reduction
# --------------------------------------------------------------------------------------------

COMBOS = list(itertools.product([0.0, 0.2], [0.0, 1e-2], [None, 2.5], [-100, 5], ["mean", "sum", "none"]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("label_smoothing, lse_square_scale, softcap, ignore_index, reduction", COMBOS)
def test_option_combinations(impl, label_smoothing, lse_square_scale, softcap, ignore_index, reduction):
    n_rows, n_cols = 10, 1000
    logits = fresh_randn(n_rows, n_cols, scale=4.0)
    # ignore_index=5 is also a valid class: only rows whose target is 5 are ignored.
    target = _targets(n_rows, n_cols, ignore_index=ignore_index)
    kw = dict(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        reduction=reduction,
    )
    upstream = _upstream(reduction, n_rows)
    out, grad = _run(IMPLS[impl], logits, target, upstream.float(), **kw)
    ref, ref_grad = _run(oracle, logits.double(), target, upstream, **kw)
    assert_close(out, ref, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.float32, "grad")


@pytest.mark.parametrize(
    "dtype, unit_upstream", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]
)
@pytest.mark.parametrize("n_cols", [1000, 3001, 4093])
def test_odd_vocab_all_options(dtype, unit_upstream, n_cols):
    """Every option at once (class weights too), odd row count, fp32 and bf16 logits.

    bf16: the kernel reads the bf16 values exactly and computes in fp32, so the loss meets the
    fp32 bound against the float64 oracle on the same values. The gradient is rounded to bf16
    once in the forward: with a unit upstream gradient (``loss.backward()``) it meets the helpers'
    2-ulp bound. With any other upstream gradient the backward multiplies the stored bf16
    gradient and rounds again; each rounding costs up to one ulp of a value up to 2× the result
    (upstream in [0.5, 1.5]), so the bound there is 4 ulps: 2**-6 · (|ref| + mean|ref|).
    """
    n_rows = 21
    logits = fresh_randn(n_rows, n_cols, scale=3.0, dtype=dtype)
    target = _targets(n_rows, n_cols)
    kw = dict(weight=torch.rand(n_cols) + 0.5, label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0)
    upstream = None if unit_upstream else _upstream("mean", n_rows)
    out, grad = _run(
        cross_entropy,
        logits,
        target,
        None if unit_upstream else upstream.float(),
        return_z_loss=True,
        return_token_accuracy=True,
        **kw,
    )
    ref, ref_grad = _run(oracle, logits.double(), target, upstream, **kw)
    assert grad.dtype == dtype
    assert_close(out.loss, ref, torch.float32, "loss")
    if dtype == torch.float32 or unit_upstream:
        assert_close(grad, ref_grad, dtype, "grad")
    else:
        _assert_within_4_bf16_ulps(grad, ref_grad)

    valid = target != -100
    z64 = 5.0 * torch.tanh(logits.double() / 5.0)
    assert_close(out.z_loss, (1e-3 * torch.logsumexp(z64[valid], -1) ** 2).mean(), torch.float32, "z_loss")
    expected_acc = (logits.argmax(-1)[valid] == target[valid]).double().mean()
    assert out.token_accuracy.item() == pytest.approx(expected_acc.item(), abs=1e-6)


# --------------------------------------------------------------------------------------------
# Ignored tokens, normalisers, upstream gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_all_ignored_batch_is_zero_not_nan(impl, reduction, weighted):
    n_rows, n_cols = 6, 1000
    logits = fresh_randn(n_rows, n_cols)
    target = torch.full((n_rows,), -100)
    out, grad = _run(
        IMPLS[impl],
        logits,
        target,
        _upstream(reduction, n_rows).float(),
        weight=torch.rand(n_cols) if weighted else None,
        label_smoothing=0.1,
        lse_square_scale=1e-3,
        reduction=reduction,
        return_z_loss=True,
        return_token_accuracy=True,
    )
    for name, t in zip(("loss", "z_loss", "token_accuracy"), out, strict=True):
        assert torch.equal(t, torch.zeros_like(t)), f"{name} of an all-ignored batch: {t}"
    assert torch.equal(grad, torch.zeros_like(grad))


def test_fully_ignored_sequence_with_reduction_none():
    """A [batch, seq] batch where one sequence is all padding: its per-token losses and its
    gradient rows are exactly 0, and the other sequences match the oracle."""
    batch, seq, n_cols = 3, 7, 1000
    logits = fresh_randn(batch * seq, n_cols, scale=2.0)
    target = _targets(batch * seq, n_cols, n_ignored=2).view(batch, seq)
    target[1] = -100
    target = target.reshape(-1)
    upstream = torch.randn(batch * seq, dtype=torch.float64)
    out, grad = _run(cross_entropy, logits, target, upstream.float(), reduction="none", label_smoothing=0.1)
    ref, ref_grad = _run(oracle, logits.double(), target, upstream, reduction="none", label_smoothing=0.1)
    padded = slice(seq, 2 * seq)
    assert torch.equal(out[padded], torch.zeros(seq))
    assert torch.equal(grad[padded], torch.zeros(seq, n_cols))
    assert_close(out, ref, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.float32, "grad")


@pytest.mark.parametrize("count_as", ["int", "tensor"])
@pytest.mark.parametrize("weighted", [False, True])
def test_num_items_in_batch_makes_micro_batches_add_up(count_as, weighted):
    """Two micro-batches, each divided by the step's total count, sum to the one big batch:
    same loss and same gradient rows."""
    n_rows, n_cols = 24, 1000
    logits = fresh_randn(n_rows, n_cols, scale=2.0)
    target = _targets(n_rows, n_cols, n_ignored=5)
    weight = torch.rand(n_cols) + 0.5 if weighted else None
    # With class weights the big batch divides its cross entropy by Σ w_y and its z-loss by the
    # token count: one count cannot reproduce both, so the weighted case has no z-loss (the
    # semantics of a count with weights and a z-loss: test_z_loss_with_class_weights_*).
    kw = dict(weight=weight, label_smoothing=0.1, lse_square_scale=0.0 if weighted else 1e-3)
    big, big_grad = _run(cross_entropy, logits, target, **kw)

    valid = target != -100
    total = weight[target[valid]].sum() if weighted else valid.sum()  # the big batch's mean denominator
    if count_as == "tensor":
        count = total
    else:
        count = float(total) if weighted else int(total)
    halves = [slice(0, 10), slice(10, n_rows)]
    parts = [_run(cross_entropy, logits[h], target[h], num_items_in_batch=count, **kw) for h in halves]
    assert_close(parts[0][0] + parts[1][0], big, torch.float32, "summed micro-batch loss")
    assert_close(torch.cat([p[1] for p in parts]), big_grad, torch.float32, "micro-batch grads")
    ref, _ = _run(
        oracle, logits[halves[0]].double(), target[halves[0]], num_items_in_batch=float(total), **kw
    )
    assert_close(parts[0][0], ref, torch.float32, "micro-batch loss vs oracle")


def weighted_mean_written_out(logits, target, weight, label_smoothing, lse_square_scale, num_items=None):
    """float64 class-weighted, label-smoothed mean cross entropy plus z-loss, each term written
    out (no F.cross_entropy): the cross entropy divided by Σ w_y over non-ignored tokens, the
    z-loss by their count T (``num_items`` replaces both)."""
    x = logits.double()
    w = weight.double()
    valid = target != -100
    lse = torch.logsumexp(x[valid], dim=-1)
    logp = x[valid] - lse[:, None]  # float64: the rounding of lse is negligible here
    y = target[valid]
    nll = -logp[torch.arange(len(y)), y] * w[y]
    smooth = -(logp * w).sum(-1)
    ce = ((1 - label_smoothing) * nll + label_smoothing / x.shape[1] * smooth).sum()
    z = lse_square_scale * (lse**2).sum()
    if num_items is not None:
        return (ce + z) / num_items, z / num_items
    return ce / w[y].sum() + z / valid.sum(), z / valid.sum()


@pytest.mark.parametrize("impl", IMPLS)
def test_z_loss_with_class_weights_divides_by_token_count(impl):
    """reduction="mean" with class weights and a z-loss: cross entropy over Σ w_y (PyTorch's
    weighted mean), z-loss over the token count (module docstring: why). Loss, gradient and the
    reported z_loss against the written-out float64 formula; and the consequence the choice is
    made for: multiplying every class weight by 10 changes nothing."""
    n_rows, n_cols = 14, 1000
    logits = fresh_randn(n_rows, n_cols, scale=3.0)
    target = _targets(n_rows, n_cols, n_ignored=4)
    weight = torch.rand(n_cols) + 0.25
    kw = dict(label_smoothing=0.1, lse_square_scale=0.05)  # z-loss ≈ 20 % of the loss: visible
    upstream = _upstream("mean", n_rows)

    out, grad = _run(IMPLS[impl], logits, target, upstream.float(), weight=weight, return_z_loss=True, **kw)
    x64 = logits.double().requires_grad_()
    ref, ref_z = weighted_mean_written_out(x64, target, weight, **kw)
    (ref * upstream).backward()
    assert_close(out.loss, ref, torch.float32, "loss")
    assert_close(out.z_loss, ref_z, torch.float32, "z_loss")
    assert_close(grad, x64.grad, torch.float32, "grad")

    scaled, scaled_grad = _run(
        IMPLS[impl], logits, target, upstream.float(), weight=10.0 * weight, return_z_loss=True, **kw
    )
    assert_close(scaled.loss, ref, torch.float32, "loss with weights × 10")
    assert_close(scaled_grad, x64.grad, torch.float32, "grad with weights × 10")


@pytest.mark.parametrize("impl", IMPLS)
def test_z_loss_with_class_weights_and_num_items(impl):
    """With num_items_in_batch the one given count divides both terms."""
    n_rows, n_cols = 9, 1000
    logits = fresh_randn(n_rows, n_cols, scale=3.0)
    target = _targets(n_rows, n_cols, n_ignored=2)
    weight = torch.rand(n_cols) + 0.25
    kw = dict(label_smoothing=0.1, lse_square_scale=0.05)
    out, grad = _run(
        IMPLS[impl], logits, target, weight=weight, num_items_in_batch=23, return_z_loss=True, **kw
    )
    x64 = logits.double().requires_grad_()
    ref, ref_z = weighted_mean_written_out(x64, target, weight, num_items=23, **kw)
    ref.backward()
    assert_close(out.loss, ref, torch.float32, "loss")
    assert_close(out.z_loss, ref_z, torch.float32, "z_loss")
    assert_close(grad, x64.grad, torch.float32, "grad")


# Logits of magnitude ~300: spread (a few hundred apart, one class dominates) or offset (all
# near 300, a flat softmax), each with and without label smoothing and class weights.
LARGE_LOGITS = {
    "spread": lambda n, v: fresh_randn(n, v, scale=100.0),
    "offset": lambda n, v: 300.0 + fresh_randn(n, v, scale=3.0),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", LARGE_LOGITS)
@pytest.mark.parametrize("smoothed", [False, True])
def test_large_logits_keep_fp32_accuracy(impl, kind, smoothed):
    """At |logits| ~ 300 the softmax must not inherit the rounding of lse (half an fp32 ulp of
    300 is 1.5e-5): loss and gradient errors vs float64 are bounded by a small multiple of what
    PyTorch's own fp32 cross entropy achieves on the same inputs (floored at one fp32 epsilon, as
    PyTorch's error can be near zero when one class takes all the mass)."""
    n_rows, n_cols = 16, 3001
    logits = LARGE_LOGITS[kind](n_rows, n_cols)
    target = _targets(n_rows, n_cols, n_ignored=2)
    weight = torch.rand(n_cols) + 0.5 if smoothed else None
    smoothing = 0.1 if smoothed else 0.0

    def torch_ce(x, t, weight=None, **_):
        w = None if weight is None else weight.to(x.dtype)
        return F.cross_entropy(x, t, weight=w, label_smoothing=smoothing)

    ref, ref_grad = _run(torch_ce, logits.double(), target, weight=weight)
    torch_out, torch_grad = _run(torch_ce, logits, target, weight=weight)
    out, grad = _run(IMPLS[impl], logits, target, weight=weight, label_smoothing=smoothing)
    eps32 = torch.finfo(torch.float32).eps
    for what, ours, theirs in (("loss", out, torch_out), ("grad", grad, torch_grad)):
        bound = 4.0 * max(rel_err(theirs, ref if what == "loss" else ref_grad), eps32)
        err = rel_err(ours, ref if what == "loss" else ref_grad)
        assert err <= bound, f"{what}: relative error {err:.3g} > 4 × PyTorch fp32's ({bound / 4:.3g})"


def test_backward_with_unit_upstream_gradient_is_the_forward_gradient():
    """loss.backward() (upstream exactly 1): the device-side skip leaves the stored gradient as is."""
    logits = fresh_randn(9, 1000)
    target = _targets(9, 1000)
    _, grad = _run(cross_entropy, logits, target)
    _, ref_grad = _run(oracle, logits.double(), target)
    assert_close(grad, ref_grad, torch.float32, "grad")


# --------------------------------------------------------------------------------------------
# In-place gradient, accuracy, edge values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_backward_writes_the_gradient_over_the_logits(reduction):
    n_rows, n_cols = 11, 3001
    logits = fresh_randn(n_rows, n_cols, scale=2.0)
    target = _targets(n_rows, n_cols)
    upstream = _upstream(reduction, n_rows).float()
    x = logits.clone().requires_grad_()
    hidden_logits = x * 1.0  # a non-leaf, like an lm_head output
    loss = cross_entropy(hidden_logits, target, reduction=reduction, inplace_backward=True)
    (loss * upstream).sum().backward()
    _, ref_grad = _run(oracle, logits.double(), target, upstream.double(), reduction=reduction)
    assert_close(x.grad, ref_grad, torch.float32, "grad")
    assert torch.equal(hidden_logits.detach(), x.grad), "the logits' buffer should hold the gradient"


def test_accuracy_breaks_ties_like_argmax_within_and_across_blocks():
    """Rows with two equal maxima — in one 1024-wide block, and in different blocks: the first
    one counts, as torch.argmax picks it."""
    n_cols = 3001
    logits = fresh_randn(4, n_cols)
    for row, (first, second) in enumerate([(10, 20), (100, 2500), (10, 20), (100, 2500)]):
        logits[row, first] = logits[row, second] = 50.0
    target = torch.tensor([10, 100, 20, 2500])
    out = cross_entropy(logits, target, reduction="none", return_token_accuracy=True)
    assert torch.equal(out.token_accuracy, torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert torch.equal(out.token_accuracy, (logits.argmax(-1) == target).float())


def test_masked_vocabulary_minus_inf_logits():
    """A −inf prefix covering a whole block (and part of the next) keeps the online max finite."""
    n_rows, n_cols = 5, 3001
    logits = fresh_randn(n_rows, n_cols, scale=2.0)
    logits[:, :1500] = float("-inf")
    target = torch.randint(1500, n_cols, (n_rows,))
    out, grad = _run(cross_entropy, logits, target, lse_square_scale=1e-3)
    ref, ref_grad = _run(oracle, logits.double(), target, lse_square_scale=1e-3)
    assert_close(out, ref, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.float32, "grad")


def test_kernel_writes_every_gradient_element_and_marks_bad_targets_nan():
    """Direct launch on a NaN-poisoned gradient buffer, with ignored rows and targets outside
    [0, V) (which the public CPU path rejects up front; on a GPU they reach the kernel)."""
    n_rows, n_cols = 8, 3001
    logits = fresh_randn(n_rows, n_cols)
    target = torch.randint(0, n_cols, (n_rows,))
    target[0], target[1] = n_cols + 3, -7
    target[2] = target[5] = -100
    opts = check_options(
        n_rows,
        n_cols,
        logits.device,
        torch.zeros(n_rows, dtype=torch.long),
        None,
        ignore_index=-100,
        label_smoothing=0.0,
        lse_square_scale=0.0,
        softcap=None,
        reduction="sum",
        num_items_in_batch=None,
        return_z_loss=False,
        return_token_accuracy=False,
    )
    grad, loss_rows, z_rows = poison_(torch.empty_like(logits)), torch.empty(n_rows), torch.empty(n_rows)
    launch_cross_entropy(
        logits,
        target,
        None,
        opts,
        loss_rows=loss_rows,
        z_rows=z_rows,
        correct_rows=None,
        grad=grad,
        grad_scale=torch.ones(()),
    )
    assert loss_rows[:2].isnan().all()
    good = torch.arange(n_rows) >= 2
    assert torch.isfinite(grad[good]).all() and torch.isfinite(loss_rows[good]).all()
    ref, ref_grad = _run(oracle, logits[good].double(), target[good], reduction="none")
    assert_close(loss_rows[good], ref, torch.float32, "loss rows")
    assert_close(grad[good], ref_grad, torch.float32, "grad rows")


def test_empty_batch():
    x = fresh_randn(0, 1000, requires_grad=True)
    loss = cross_entropy(x, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (0, 1000)


def test_no_grad_and_non_differentiable_extras():
    logits = fresh_randn(7, 1000, requires_grad=True)
    target = _targets(7, 1000)
    with torch.no_grad():
        out = cross_entropy(logits, target, return_z_loss=True, lse_square_scale=1e-3)
    assert not out.loss.requires_grad
    assert_close(out.loss, oracle(logits.detach(), target, lse_square_scale=1e-3), torch.float32, "loss")
    out = cross_entropy(logits, target, return_z_loss=True, return_token_accuracy=True, lse_square_scale=1e-3)
    assert out.loss.requires_grad and not out.z_loss.requires_grad and not out.token_accuracy.requires_grad


def test_second_backward_is_refused():
    logits = fresh_randn(4, 1000, requires_grad=True)
    loss = cross_entropy(logits, _targets(4, 1000, n_ignored=0))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_module_wrapper():
    logits = fresh_randn(6, 1000)
    target = _targets(6, 1000)
    weight = torch.rand(1000) + 0.5
    module = CrossEntropyLoss(weight=weight, label_smoothing=0.1, softcap=3.0)
    assert_close(
        module(logits, target),
        oracle(logits, target, weight=weight, label_smoothing=0.1, softcap=3.0),
        torch.float32,
        "module loss",
    )


def test_reference_returns_the_same_structure():
    logits = fresh_randn(6, 1000)
    target = _targets(6, 1000)
    kw = dict(reduction="none", return_z_loss=True, return_token_accuracy=True, lse_square_scale=1e-2)
    ours, ref = cross_entropy(logits, target, **kw), cross_entropy_reference(logits, target, **kw)
    for a, b in zip(ours, ref, strict=True):
        assert_close(a, b, torch.float32)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits_shape, target, kwargs, message",
    [
        ((2, 3, 10), torch.zeros(6, dtype=torch.long), {}, "flatten"),
        ((4, 10), torch.zeros(3, dtype=torch.long), {}, "expected \\[4\\]"),
        ((4, 10), torch.zeros(4), {}, "must be integers"),
        ((4, 10), torch.tensor([0, 1, 10, 2]), {}, "outside \\[0, 10\\)"),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"reduction": "avg"}, "reduction='avg'"),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"label_smoothing": 1.5}, "label_smoothing"),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"softcap": 0.0}, "pass None to disable"),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"lse_square_scale": -1.0}, "z-loss scale"),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"weight": torch.ones(9)}, "one weight per class"),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"num_items_in_batch": 0}, "positive"),
        (
            (4, 10),
            torch.zeros(4, dtype=torch.long),
            {"num_items_in_batch": 8, "reduction": "sum"},
            "denominator",
        ),
        ((4, 10), torch.zeros(4, dtype=torch.long), {"num_items_in_batch": torch.tensor(0)}, "positive"),
    ],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_input_is_named(impl, logits_shape, target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        IMPLS[impl](fresh_randn(*logits_shape), target, **kwargs)


# --------------------------------------------------------------------------------------------
# GPU sizes (H200)
# --------------------------------------------------------------------------------------------


def _chunked_fp32_reference(logits, target, upstream, chunk=1024, **kw):
    """Summed loss and gradient over row chunks in fp32 (the full fp32 graph would not fit)."""
    valid = target != kw.get("ignore_index", -100)
    scale = 1.0 / valid.sum().float()
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    grad = torch.empty_like(logits, dtype=torch.float32)
    for start in range(0, logits.shape[0], chunk):
        x = logits[start : start + chunk].float().requires_grad_()
        loss = cross_entropy_reference(x, target[start : start + chunk], reduction="sum", **kw)
        (loss * scale * upstream).backward()
        total += loss.double()
        grad[start : start + chunk] = x.grad
    return total * scale, grad


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [128256, 256000])
def test_gpu_benchmark_shapes_bf16(n_cols):
    """8192 × V bf16 (V = 256000 puts offsets past 2³¹), every option, in-place gradient."""
    n_rows = 8192
    logits = fresh_randn(n_rows, n_cols, dtype=torch.bfloat16, device="cuda", scale=4.0)
    target = _targets(n_rows, n_cols, n_ignored=500, device="cuda")
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)
    upstream = torch.rand((), device="cuda") + 0.5
    ref_loss, ref_grad = _chunked_fp32_reference(logits, target, upstream, **kw)

    valid = target != -100
    expected_acc = (
        (logits.argmax(-1)[valid] == target[valid]).float().mean()
    )  # before the logits are overwritten

    x = logits.requires_grad_()
    out = cross_entropy(x, target, inplace_backward=True, return_token_accuracy=True, **kw)
    (out.loss * upstream).backward()
    assert_close(out.loss, ref_loss, torch.float32, "loss")
    _assert_within_4_bf16_ulps(x.grad, ref_grad)
    assert out.token_accuracy.item() == pytest.approx(expected_acc.item(), abs=1e-6)


@pytest.mark.gpu
def test_gpu_fp32_logits_and_weights():
    n_rows, n_cols = 4096, 128256
    logits = fresh_randn(n_rows, n_cols, device="cuda", scale=3.0)
    target = _targets(n_rows, n_cols, n_ignored=100, device="cuda")
    weight = torch.rand(n_cols, device="cuda") + 0.5
    upstream = torch.randn(n_rows, device="cuda", dtype=torch.float64)
    out, grad = _run(cross_entropy, logits, target, upstream.float(), weight=weight, reduction="none")
    ref, ref_grad = _run(oracle, logits.double(), target, upstream, weight=weight, reduction="none")
    assert_close(out, ref, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.float32, "grad")


@pytest.mark.gpu
def test_gpu_bad_target_gives_nan_not_a_crash():
    logits = fresh_randn(64, 32000, device="cuda")
    target = _targets(64, 32000, device="cuda")
    target[3] = 32000 + 5
    loss = cross_entropy(logits, target, reduction="none")
    assert loss[3].isnan() and torch.isfinite(loss[torch.arange(64, device="cuda") != 3]).all()
