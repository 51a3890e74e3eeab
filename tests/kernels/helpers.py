"""Shared checks for kernel tests: fresh random inputs, poisoned outputs, stated tolerances.

Tolerances (against a float64 reference computed from the same, already-rounded inputs):

* fp32: ``‖out − ref‖ / ‖ref‖ ≤ 1e-5``. fp32 arithmetic with fp32 accumulation lands around
  1e-7; 1e-5 leaves room for different summation orders over rows of several thousand.
* bf16: every element within ``2**-7 · (|ref| + mean|ref|)``. A correctly rounded bf16 result
  is within 2**-9 of the exact value; we allow two units in the last place (2**-7 relative)
  because the CPU interpreter truncates fp32→bf16 instead of rounding (one extra step,
  docs/architecture.md) and because the HF modules we match round an intermediate to bf16 as well.
  The ``mean|ref|`` floor covers elements that are small only through cancellation (their
  error scales with the terms that cancelled, not with the result).

An op that rounds an intermediate as well (Llama-style RMSNorm rounds ``x·rstd`` before the
weight) passes its derived extra term through ``assert_close(extra_tol=...)``.
"""

from __future__ import annotations

import pytest
import torch

FP32_REL_TOL = 1e-5
BF16_ULP_TOL = 2.0**-7


def fresh_randn(*shape, dtype=torch.float32, device="cpu", scale=1.0, requires_grad=False) -> torch.Tensor:
    """Random normal values from the global RNG (never seeded to a fixed value inside tests)."""
    t = (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (or the int minimum) so any element a kernel forgets to write is caught."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


@pytest.fixture(name="poisoned_allocations")
def poisoned_allocations_fixture(monkeypatch):
    """Make torch.empty/empty_like return NaN-filled tensors while the test runs.

    Test modules import this function (``# noqa: F401``) and request the fixture by its name,
    ``poisoned_allocations``, which therefore shadows no imported name.
    """
    for name in ("empty", "empty_like"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _f=original, **kw: poison_(_f(*a, **kw)))


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise unit in the last place of `dtype` at the magnitude of `t` (float64 result).

    ``|t| = m·2**e`` with ``m`` in [0.5, 1) has neighbours ``2**(e - p)`` apart, ``p`` the
    significand bits of `dtype` (8 for bf16, 11 for fp16, 24 for fp32).
    """
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    _, e = torch.frexp(t.detach().double())
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e - p)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype,
    what: str = "output",
    extra_tol: torch.Tensor | None = None,
) -> None:
    """Compare `out` with a float64 reference under the tolerance stated for `dtype`.

    ``extra_tol`` (bf16/fp16 only): an elementwise allowance added to the 2-ulp bound, for an
    op-specific error term the caller derives (never a blanket loosening).
    """
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), f"{what}: non-finite values (unwritten or overflowed elements)"
    if dtype == torch.bfloat16 or dtype == torch.float16:
        tol = BF16_ULP_TOL * (ref64.abs() + ref64.abs().mean())
        if extra_tol is not None:
            tol = tol + extra_tol.detach().double().cpu()
        bad = (out64 - ref64).abs() > tol
        assert not bad.any(), (
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside 2 bf16 ulps; "
            f"worst |diff| {(out64 - ref64).abs().max().item():.3g}"
        )
    else:
        err = rel_err(out64, ref64)
        assert err <= FP32_REL_TOL, f"{what}: relative error {err:.3g} > {FP32_REL_TOL}"
