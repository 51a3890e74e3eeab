"""Fused linear cross entropy vs a float64 oracle that materialises the logits.

The oracle is ``F.linear`` + ``torch.nn.functional.cross_entropy`` in float64, with the cap,
z-loss and normalisers added as documented (``oracle`` from the cross-entropy tests), so the
chunked path is never compared with itself. Gradients for hidden, weight and bias come from
autograd through the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ligertune.kernels.cross_entropy import CrossEntropyOutput
from ligertune.kernels.fused_linear_cross_entropy import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    _matmul_into,
    _mixed_matmul_supported,
    chunk_rows,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
    sweep_rows,
)
from tests.kernels.helpers import assert_close, fresh_randn, rel_err
from tests.kernels.test_cross_entropy import _targets, _upstream, oracle, weighted_mean_written_out

# bf16 inputs: the logits are rounded to bf16 (as an lm_head in bf16 would), the in-place
# gradient of the logits is rounded to bf16, and each matmul output once more. Each rounding is
# ≤ 2**-8 relative (2**-7 with the interpreter's truncation), so the norm-relative error of a
# gradient stays near 1e-2 at worst; we allow 2e-2. The loss sees only the logits' rounding,
# which mostly averages out over tokens: 2e-3 relative.
BF16_GRAD_REL = 2e-2
BF16_LOSS_REL = 2e-3


def _linear_oracle(hidden, weight, target, bias=None, *, class_weight=None, **kw):
    return oracle(F.linear(hidden, weight, bias), target, weight=class_weight, **kw)


def _run(fn, hidden, weight, target, bias=None, upstream=None, **kw):
    """(output, (grad_hidden, grad_weight, grad_bias)) on fresh leaf copies."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    out = fn(leaves[0], leaves[1], target, leaves[2], **kw)
    loss = out.loss if isinstance(out, CrossEntropyOutput) else out
    (loss.sum() if upstream is None else (loss * upstream).sum()).backward()
    return out, tuple(None if t is None else t.grad for t in leaves)


def _fused_vs_oracle(hidden, weight, target, bias, upstream, fused_kw, **kw):
    """``_run`` the fused op (with its own arguments ``fused_kw``: budget, accumulation dtype) and
    the float64 oracle on the same inputs, options ``kw`` and upstream gradient:
    ``(out, grads), (ref, ref_grads)``."""
    fused = _run(fused_linear_cross_entropy, hidden, weight, target, bias, upstream.float(), **fused_kw, **kw)
    ref = _run(_linear_oracle, hidden.double(), weight.double(), target, _double(bias), upstream, **kw)
    return fused, ref


def _inputs(n_rows, n_hidden, n_cols, dtype=torch.float32, bias=True, device="cpu"):
    hidden = fresh_randn(n_rows, n_hidden, dtype=dtype, device=device)
    # Logits of order 1-3, as in a trained model.
    weight = fresh_randn(n_cols, n_hidden, dtype=dtype, device=device, scale=2.0 / math.sqrt(n_hidden))
    b = fresh_randn(n_cols, dtype=dtype, device=device, scale=0.5) if bias else None
    return hidden, weight, b


def _check_fp32(out, grads, ref, ref_grads):
    assert_close(out, ref, torch.float32, "loss")
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        if r is not None:
            assert_close(g, r, torch.float32, f"grad {name}")


ALL_OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=4.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("options", ["plain", "all"])
def test_fp32_matches_oracle(reduction, with_bias, options):
    n_rows, n_hidden, n_cols = 17, 32, 1000
    hidden, weight, bias = _inputs(n_rows, n_hidden, n_cols, bias=with_bias)
    target = _targets(n_rows, n_cols)
    kw = dict(reduction=reduction)
    if options == "all":
        kw.update(ALL_OPTIONS, class_weight=torch.rand(n_cols) + 0.5)
    upstream = _upstream(reduction, n_rows)
    # A budget of 8 rows: chunks of 8, 8 and a last one of 1.
    (out, grads), (ref, ref_grads) = _fused_vs_oracle(
        hidden, weight, target, bias, upstream, dict(memory_budget_bytes=8 * n_cols * 4), **kw
    )
    _check_fp32(out, grads, ref, ref_grads)


def test_z_loss_with_class_weights_divides_by_token_count():
    """The chunked path shares the normalisers of ``cross_entropy``: with class weights the cross
    entropy is divided by Σ w_y and the z-loss by the token count (the written-out float64
    formula of the cross-entropy tests on the float64 logits), over several chunks."""
    n_rows, n_hidden, n_cols = 17, 32, 1000
    hidden, weight, bias = _inputs(n_rows, n_hidden, n_cols)
    target = _targets(n_rows, n_cols, n_ignored=4)
    class_weight = 3.0 * torch.rand(n_cols) + 0.25
    kw = dict(label_smoothing=0.1, lse_square_scale=0.05)
    upstream = _upstream("mean", n_rows)
    out, grads = _run(
        fused_linear_cross_entropy,
        hidden,
        weight,
        target,
        bias,
        upstream.float(),
        class_weight=class_weight,
        return_z_loss=True,
        memory_budget_bytes=8 * n_cols * 4,
        **kw,
    )
    leaves = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    ref, ref_z = weighted_mean_written_out(F.linear(*leaves), target, class_weight, **kw)
    (ref * upstream).backward()
    assert_close(out.loss, ref, torch.float32, "loss")
    assert_close(out.z_loss, ref_z, torch.float32, "z_loss")
    for name, g, leaf in zip(("hidden", "weight", "bias"), grads, leaves, strict=True):
        assert_close(g, leaf.grad, torch.float32, f"grad {name}")


def _double(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("n_cols, budget", [(3001, None), (4093, 1)])
def test_odd_shapes_one_chunk_and_many(n_cols, budget):
    """Odd vocab, odd hidden size, odd rows; the default budget (one chunk) and a 1-row budget."""
    n_rows, n_hidden = 13, 19
    hidden, weight, bias = _inputs(n_rows, n_hidden, n_cols)
    target = _targets(n_rows, n_cols)
    upstream = _upstream("mean", n_rows)
    (out, grads), (ref, ref_grads) = _fused_vs_oracle(
        hidden, weight, target, bias, upstream, dict(memory_budget_bytes=budget)
    )
    _check_fp32(out, grads, ref, ref_grads)


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16(accum_dtype, reduction):
    """bf16 inputs against the float64 oracle on the same bf16 values (bounds at the top), in
    four chunks so both dW accumulations (fp32 via slices on CPU, and bf16) run: with more than
    2·H rows, one chunk would need more memory than the fp32 accumulator (`sweep_rows`)."""
    n_rows, n_hidden, n_cols = 48, 16, 2000
    hidden, weight, bias = _inputs(n_rows, n_hidden, n_cols, dtype=torch.bfloat16)
    target = _targets(n_rows, n_cols)
    kw = dict(ALL_OPTIONS, reduction=reduction)
    upstream = _upstream(reduction, n_rows)
    (out, grads), (ref, ref_grads) = _fused_vs_oracle(
        hidden,
        weight,
        target,
        bias,
        upstream,
        dict(accum_dtype=accum_dtype, memory_budget_bytes=12 * n_cols * 2),
        **kw,
    )
    assert rel_err(out, ref) <= BF16_LOSS_REL
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.isfinite(g).all()
        assert rel_err(g, r) <= BF16_GRAD_REL, f"grad {name}: {rel_err(g, r):.3g}"


def test_fp32_accumulation_beats_bf16_over_many_chunks():
    """128 one-row chunks. With positive hidden states every non-target dW entry is a sum of
    same-signed terms, the case where a bf16 running sum drifts (rounded 128 times) while the
    fp32 one is rounded once."""
    n_rows, n_hidden, n_cols = 128, 16, 1000
    hidden = (fresh_randn(n_rows, n_hidden).abs() + 1.0).bfloat16()
    weight = fresh_randn(n_cols, n_hidden, scale=0.25).bfloat16()
    target = _targets(n_rows, n_cols, n_ignored=0)
    _, ref_grads = _run(_linear_oracle, hidden.double(), weight.double(), target)
    errs = {}
    for accum in (torch.float32, torch.bfloat16):
        _, grads = _run(
            fused_linear_cross_entropy, hidden, weight, target, accum_dtype=accum, memory_budget_bytes=1
        )
        errs[accum] = rel_err(grads[1], ref_grads[1])
    # Measured on CPU over 8 fresh draws: fp32 0.40-0.50%, bf16 1.5-2.3% (ratio 3.4-5.1; at 48
    # chunks the ratio went as low as 1.5, too close to call). The fp32 floor is the bf16
    # rounding of the logits' gradient.
    assert errs[torch.float32] <= BF16_GRAD_REL / 2, errs
    assert errs[torch.float32] < errs[torch.bfloat16] / 2, errs


def test_mixed_precision_accumulation_sums_in_fp32():
    """The dW accumulation helper on its own: 64 positive bf16 products summed into an fp32
    accumulator stay within ~one bf16 rounding of the float64 sum; a bf16 accumulator drifts."""
    a = [fresh_randn(300, 4).abs().bfloat16() for _ in range(64)]
    b = [fresh_randn(4, 12).abs().bfloat16() for _ in range(64)]
    exact = sum(x.double() @ y.double() for x, y in zip(a, b, strict=True))
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        acc = torch.empty(300, 12, dtype=dtype)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _matmul_into(acc, x, y, accumulate=i > 0, slice_rows=70)
        errs[dtype] = rel_err(acc, exact)
    assert errs[torch.float32] <= 2.0**-8, errs
    assert errs[torch.float32] < errs[torch.bfloat16] / 4, errs


def test_tied_embedding_weight_gets_both_contributions():
    """One Parameter as the input embedding and the lm_head: its gradient is the sum of both paths."""
    n_cols, n_hidden, batch, seq = 1000, 24, 2, 9
    ids = torch.randint(0, n_cols, (batch, seq))
    target = _targets(batch * seq, n_cols)
    proj = fresh_randn(n_hidden, n_hidden, scale=n_hidden**-0.5)
    init = fresh_randn(n_cols, n_hidden)

    def grads(loss_fn, dtype):
        emb = torch.nn.Embedding(n_cols, n_hidden, dtype=dtype)
        with torch.no_grad():
            emb.weight.copy_(init)
        hidden = torch.tanh(emb(ids) @ proj.to(dtype)).reshape(-1, n_hidden)
        loss_fn(hidden, emb.weight, target).backward()
        return emb.weight.grad

    ours = grads(
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, memory_budget_bytes=5 * n_cols * 4), torch.float32
    )
    ref = grads(lambda h, w, t: _linear_oracle(h, w, t), torch.float64)
    assert_close(ours, ref, torch.float32, "tied weight grad")


def test_num_items_in_batch_micro_batches_add_up():
    n_rows, n_hidden, n_cols = 30, 16, 1000
    hidden, weight, bias = _inputs(n_rows, n_hidden, n_cols)
    target = _targets(n_rows, n_cols, n_ignored=6)
    big, big_grads = _run(fused_linear_cross_entropy, hidden, weight, target, bias, **ALL_OPTIONS)
    count = int((target != -100).sum())
    parts = [
        _run(
            fused_linear_cross_entropy,
            hidden[h],
            weight,
            target[h],
            bias,
            num_items_in_batch=count,
            **ALL_OPTIONS,
        )
        for h in (slice(0, 11), slice(11, n_rows))
    ]
    assert_close(parts[0][0] + parts[1][0], big, torch.float32, "loss")
    assert_close(torch.cat([p[1][0] for p in parts]), big_grads[0], torch.float32, "grad hidden")
    assert_close(parts[0][1][1] + parts[1][1][1], big_grads[1], torch.float32, "grad weight")
    assert_close(parts[0][1][2] + parts[1][1][2], big_grads[2], torch.float32, "grad bias")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_all_ignored_gives_zero_loss_and_grads(reduction):
    hidden, weight, bias = _inputs(7, 16, 1000)
    out, grads = _run(
        fused_linear_cross_entropy,
        hidden,
        weight,
        torch.full((7,), -100),
        bias,
        _upstream(reduction, 7).float(),
        reduction=reduction,
        **ALL_OPTIONS,
    )
    assert torch.equal(out, torch.zeros_like(out))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_frozen_weight_and_extras():
    """A frozen lm_head (LoRA): no weight gradient is computed; z-loss and accuracy come along."""
    n_rows, n_hidden, n_cols = 12, 16, 1000
    hidden, weight, _ = _inputs(n_rows, n_hidden, n_cols, bias=False)
    target = _targets(n_rows, n_cols)
    h = hidden.clone().requires_grad_()
    out = fused_linear_cross_entropy(
        h, weight, target, return_z_loss=True, return_token_accuracy=True, lse_square_scale=1e-2
    )
    out.loss.backward()
    assert weight.grad is None
    h64 = hidden.double().requires_grad_()
    ref = _linear_oracle(h64, weight.double(), target, lse_square_scale=1e-2)
    ref.backward()
    assert_close(out.loss, ref, torch.float32, "loss")
    assert_close(h.grad, h64.grad, torch.float32, "grad hidden")
    logits = hidden.double() @ weight.double().T
    valid = target != -100
    assert_close(out.z_loss, 1e-2 * (torch.logsumexp(logits[valid], -1) ** 2).mean(), torch.float32, "z_loss")
    acc = (logits.argmax(-1)[valid] == target[valid]).double().mean()
    assert out.token_accuracy.item() == pytest.approx(acc.item(), abs=1e-6)


def test_autocast_casts_like_linear():
    """fp32 parameters under bf16 autocast: computed in bf16 like F.linear would, fp32 gradients."""
    hidden, weight, bias = _inputs(10, 32, 1000)
    target = _targets(10, 1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _run(fused_linear_cross_entropy, hidden, weight, target, bias)
    bf = [t.bfloat16().double() for t in (hidden, weight, bias)]
    ref, ref_grads = _run(_linear_oracle, *bf[:2], target, bf[2])
    assert rel_err(out, ref) <= BF16_LOSS_REL
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.float32 and rel_err(g, r) <= BF16_GRAD_REL


def test_reference_matches_oracle():
    hidden, weight, bias = _inputs(9, 16, 1000)
    target = _targets(9, 1000)
    kw = dict(ALL_OPTIONS, reduction="sum")
    out, grads = _run(
        fused_linear_cross_entropy_reference, hidden.double(), weight.double(), target, bias.double(), **kw
    )
    ref, ref_grads = _run(_linear_oracle, hidden.double(), weight.double(), target, bias.double(), **kw)
    _check_fp32(out, grads, ref, ref_grads)


def test_second_backward_is_refused():
    hidden, weight, _ = _inputs(4, 8, 1000, bias=False)
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, _targets(4, 1000, n_ignored=0))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize(
    "n_rows, n_cols, elem, budget",
    [
        (8192, 128256, 2, DEFAULT_MEMORY_BUDGET_BYTES),
        (8192, 256000, 2, 2**30),
        (37, 1000, 4, 8 * 4000),
        (5, 7, 4, 1),
    ],
)
def test_chunk_rows_fits_the_budget_and_balances(n_rows, n_cols, elem, budget):
    rows = chunk_rows(n_rows, n_cols, elem, budget)
    n_chunks = math.ceil(n_rows / rows)
    assert rows >= 1
    assert rows * n_cols * elem <= max(budget, n_cols * elem), "buffer over budget"
    assert (n_chunks - 1) * rows < n_rows, "an empty chunk"
    # Balanced: no smaller chunk count would fit the budget.
    assert n_chunks == math.ceil(n_rows / max(1, budget // (n_cols * elem)))


@pytest.mark.parametrize(
    "n_rows, n_hidden, n_cols, acc, expected",
    [
        # Hand-counted peaks (bf16 in and out, fp32 accumulator, default 768 MiB budget):
        # one chunk 8192·128256·2 + 128256·4096·2 = 3.15e9 B; chunks 128256·4096·4 + max(2752·128256·2,
        # 128256·4096·2) = 3.15e9 B: equal, so one chunk.
        (8192, 4096, 128256, 4, 8192),
        # One chunk 16384·128256·2 + 128256·2048·2 = 4.73e9 B against 1.05e9 + 0.71e9 B: 6 chunks.
        (16384, 2048, 128256, 4, 2752),
        # No accumulator (bf16 accumulation): the budget alone decides, 3 chunks.
        (8192, 4096, 128256, 0, 2752),
        # One row more than 2·H: the single chunk's buffer outgrows the accumulator.
        (8193, 4096, 128256, 4, 2752),
    ],
)
def test_sweep_rows_takes_one_chunk_when_it_needs_no_more_memory(n_rows, n_hidden, n_cols, acc, expected):
    rows = sweep_rows(
        n_rows, n_cols, n_hidden, 2, DEFAULT_MEMORY_BUDGET_BYTES, accumulator_bytes=acc, weight_bytes=2
    )
    assert rows == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden=fresh_randn(2, 3, 8)), "flatten"),
        (dict(weight=fresh_randn(100, 9)), "expected \\[V, 8\\]"),
        (dict(bias=fresh_randn(99)), "bias has shape"),
        (dict(weight=fresh_randn(100, 8, dtype=torch.bfloat16)), "cast them to one dtype"),
        (dict(accum_dtype=torch.float16), "accum_dtype"),
        (dict(memory_budget_bytes=0), "memory_budget_bytes"),
        (dict(target=torch.tensor([0, 1, 2, 100])), "outside \\[0, 100\\)"),
        (dict(class_weight=torch.ones(7)), "class_weight"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    args = dict(hidden=fresh_randn(4, 8), weight=fresh_randn(100, 8), target=torch.zeros(4, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("target"), **args)


# --------------------------------------------------------------------------------------------
# GPU sizes (H200)
# --------------------------------------------------------------------------------------------


def _chunked_fp32_oracle(hidden, weight, target, upstream, chunk=1024, **kw):
    """fp32 loss and gradients over token chunks (fp32 logits of all tokens would not fit)."""
    n_valid = (target != -100).sum()
    w = weight.float().requires_grad_()
    total, grad_hidden = 0.0, torch.empty_like(hidden, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk].float().requires_grad_()
        loss = oracle(h @ w.T, target[start : start + chunk], reduction="sum", **kw) / n_valid
        (loss * upstream).backward()
        total += loss.detach()
        grad_hidden[start : start + chunk] = h.grad
    return total, grad_hidden, w.grad


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [128256, 256000])
def test_gpu_benchmark_shapes(n_cols):
    """BT 8192, H 4096, bf16, every option; gradients against a chunked fp32 oracle (run with
    fp32 logits: the oracle's double() happens per chunk)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    n_rows, n_hidden = 8192, 4096
    hidden, weight, _ = _inputs(n_rows, n_hidden, n_cols, dtype=torch.bfloat16, bias=False, device="cuda")
    target = _targets(n_rows, n_cols, n_ignored=300, device="cuda")
    kw = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)
    upstream = 0.75
    ref_loss, ref_dh, ref_dw = _chunked_fp32_oracle(hidden, weight, target, upstream, **kw)
    out, (dh, dw, _) = _run(fused_linear_cross_entropy, hidden, weight, target, None, upstream, **kw)
    assert rel_err(out, ref_loss) <= BF16_LOSS_REL
    # GPU roundings are to nearest (no truncation): half the CPU bound.
    assert rel_err(dh, ref_dh) <= BF16_GRAD_REL / 2
    assert rel_err(dw, ref_dw) <= BF16_GRAD_REL / 2


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
def test_gpu_extra_memory(accum_dtype):
    """Peak memory above inputs and gradients at BT 8192, H 4096, V 128256, bf16: the chunk
    buffer (≤ the budget) plus, with fp32 accumulation, the V × H × 4-byte dW accumulator."""
    n_rows, n_hidden, n_cols = 8192, 4096, 128256
    hidden, weight, _ = _inputs(n_rows, n_hidden, n_cols, dtype=torch.bfloat16, bias=False, device="cuda")
    target = _targets(n_rows, n_cols, device="cuda")
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def step():
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, target, accum_dtype=accum_dtype).backward()

    step()  # warm-up: cuBLAS workspace, Triton compilation
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = h.numel() * 2 + w.numel() * 2
    extra = torch.cuda.max_memory_allocated() - base - grads
    allowed = DEFAULT_MEMORY_BUDGET_BYTES + 64 * 2**20
    if accum_dtype == torch.float32:
        allowed += w.numel() * 4
    else:
        assert extra <= 2**30, f"{extra / 2**30:.2f} GiB above inputs and grads"
    assert extra <= allowed, f"{extra / 2**30:.2f} GiB above inputs and grads"


@pytest.mark.gpu
def test_gpu_fp32_accumulation_runs_in_cublas():
    """The default fp32 dW accumulation should be cuBLAS's bf16 × bf16 → fp32 addmm. If this
    torch lacks it, the sliced fallback runs instead: correct, but ~3× the accumulation traffic."""
    assert _mixed_matmul_supported("cuda"), (
        f"torch {torch.__version__} has no addmm(out_dtype=float32) with an fp32 accumulator on CUDA: "
        "FLCE falls back to sliced accumulation (slower); use accum_dtype=torch.bfloat16 or a newer torch"
    )
