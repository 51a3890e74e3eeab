"""scripts/moe_bench.py: its dry run (every provider on tiny CPU shapes) and its FLOP count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scripts import moe_bench

# Under the interpreter tl.sigmoid's exp(-x) can overflow to inf (the right limit); the
# interpreter reads loaded scalars through one-element arrays, which numpy deprecates.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def test_dry_run_runs_every_provider_on_both_layouts():
    """Qwen3 (gate/up halves) and gpt-oss (interleaved, biases); Mixtral is the halves layout
    again. The full pass runs each provider's forward and backward."""
    lines = []
    shapes = ("qwen3-30b-a3b", "gpt-oss-20b")
    rows = moe_bench.main(["--dry-run", "--shapes", ",".join(shapes), "--passes", "full"], log=lines.append)
    assert {(r["shape"], r["provider"]) for r in rows} == {
        (s, p) for s in shapes for p in moe_bench.PROVIDERS
    }
    for r in rows:
        if r["provider"] == "liger":
            assert r["status"].startswith("unavailable"), r  # CUDA only
            continue
        assert r["status"] == "ok", r
        # fp32 on the CPU: every provider computes HF's eager result up to summation order.
        assert r["mismatch"] <= 1e-5, r
        assert r["full"]["ms"] > 0 and r["full"]["peak_extra_mib"] is None and "fwd" not in r
    assert len(lines) == len(rows) + 1 and lines[0].startswith("device: cpu")


@pytest.mark.parametrize("name", moe_bench.SHAPES)
def test_gemm_flops_match_torch_flop_counter(name):
    """The SOL floor's FLOPs equal what torch counts for HF's eager experts (forward, and forward
    plus backward), at each shape's layout and arity on a small size."""
    full = moe_bench.SHAPES[name]
    shape = moe_bench.Shape(24, full.experts if full.experts <= 8 else 8, min(full.top_k, 4), 16, full.layout)
    inputs = moe_bench.make_inputs(shape, 10, torch.float32, torch.device("cpu"))
    fn = moe_bench.build("hf_eager", shape, inputs, "eager")
    wrt = [t for t in inputs.values() if t.requires_grad]
    with FlopCounterMode(display=False) as fwd_counter:
        out = fn()
    with FlopCounterMode(display=False) as bwd_counter:
        torch.autograd.grad(out, wrt, torch.randn_like(out))
    flops = moe_bench.gemm_flops(shape, 10)
    assert fwd_counter.get_total_flops() == flops["fwd"]
    assert fwd_counter.get_total_flops() + bwd_counter.get_total_flops() == flops["full"]
