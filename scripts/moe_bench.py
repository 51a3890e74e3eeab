"""The MoE experts block on one GPU: ours against Hugging Face's two paths, compile and Liger.

Providers, all on the same inputs (bf16 hidden states, weights, routing weights; a uniform
random top-k routing):

- ``ligertune``:      `ligertune.kernels.moe.moe_experts` (grouped_mm, fused activation, gather
                      combine; docs/perf-notes.md "MoE experts");
- ``hf_eager``:       transformers' own ``Experts`` module, its per-expert loop
                      (``Qwen3MoeExperts`` for the gate/up-halves layout, ``GptOssExperts`` for
                      gpt-oss), ``config._experts_implementation = "eager"``;
- ``hf_grouped_mm``:  the same module with ``_experts_implementation = "grouped_mm"``
                      (transformers.integrations.moe: sort, grouped_mm, index-and-sum combine);
- ``compile_ref``:    ``torch.compile`` of `moe_experts_reference` (the per-expert loop; its
                      data-dependent token selection breaks the graph once per expert);
- ``liger``:          Liger-Kernel's ``LigerFusedMoEFunction`` (``liger_kernel.ops.fused_moe``,
                      recent releases) when importable, on CUDA, for the halves layout only (it
                      takes no biases and no interleaved gate/up).

Shapes (``--shapes``), T = ``--tokens`` (8192):

- ``qwen3-30b-a3b``: H 2048, E 128, k 8, I 768, gate/up halves, SiLU;
- ``gpt-oss-20b``:   H 2880, E 32, k 4, I 2880, gpt-oss layout (interleaved, biases, clamped);
- ``mixtral-8x7b``:  H 4096, E 8, k 2, I 14336, gate/up halves, SiLU.

Passes: ``fwd`` (the forward with autograd recording), ``bwd`` (``torch.autograd.grad`` after an
untimed forward), ``full`` (both). Time: `ligertune.tools.bench.timing.Timer` (median of CUDA
events, cold L2, a GPU spin queued ahead so launch latency is hidden). Memory: peak allocated
above what existed before the call (the inputs), minus the storage of the gradients returned
(`peak_extra_mib`). Speed of light: the three GEMMs' FLOPs, ``6·T·k·H·I`` forward, three times
that for forward + backward (two each for the input and weight gradients), at
``--peak-tflops`` (989: H100 SXM dense bf16); "% SOL" is that floor over the measured time.
"mismatch" is each provider's forward relative to ``hf_eager``'s (fp32 norms), as a sanity flag.

    python scripts/moe_bench.py --out runs/moe-bench.json
    python scripts/moe_bench.py --dry-run      # tiny shapes on the CPU (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

if "--dry-run" in sys.argv:
    # The dry run takes the kernel path on CPU tensors; the interpreter must be chosen before
    # triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from ligertune.kernels.moe import moe_experts, moe_experts_reference
from ligertune.tools.bench.timing import Timer, peak_extra_mib


@dataclass(frozen=True)
class Shape:
    hidden: int
    experts: int
    top_k: int
    inter: int
    layout: str


SHAPES = {
    "qwen3-30b-a3b": Shape(2048, 128, 8, 768, "gate_up_halves"),
    "gpt-oss-20b": Shape(2880, 32, 4, 2880, "gpt_oss"),
    "mixtral-8x7b": Shape(4096, 8, 2, 14336, "gate_up_halves"),
}
# The dry run keeps each shape's layout and routing arity, at sizes the interpreter runs in seconds.
DRY_SHAPE = {"hidden": 32, "experts": 3, "inter": 16, "tokens": 8}
PROVIDERS = ("ligertune", "hf_grouped_mm", "liger", "hf_eager", "compile_ref")
PASSES = ("fwd", "bwd", "full")


class Unavailable(Exception):
    """The provider cannot run here; reported in its row."""


def hf_module(shape: Shape, implementation: str, dtype, device) -> torch.nn.Module:
    if shape.layout == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        config = GptOssConfig(
            hidden_size=shape.hidden,
            intermediate_size=shape.inter,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
        )
        module_class = GptOssExperts
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(
            hidden_size=shape.hidden,
            moe_intermediate_size=shape.inter,
            num_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
        )
        module_class = Qwen3MoeExperts
    config._experts_implementation = implementation
    return module_class(config).to(device=device, dtype=dtype)


def make_inputs(shape: Shape, tokens: int, dtype, device) -> dict[str, torch.Tensor]:
    """Hidden states, a uniform random top-k routing, softmax routing weights, and the experts'
    parameters in the layout's shapes (std 1/√fan-in; biases std 0.1), all leaves requiring grad
    except the index."""
    e, h, i = shape.experts, shape.hidden, shape.inter
    if shape.layout == "gpt_oss":
        shapes = {
            "gate_up_proj": (e, h, 2 * i),
            "down_proj": (e, i, h),
            "gate_up_bias": (e, 2 * i),
            "down_bias": (e, h),
        }
    else:
        shapes = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
    scales = {"gate_up_proj": h**-0.5, "down_proj": i**-0.5, "gate_up_bias": 0.1, "down_bias": 0.1}
    logits = torch.randn(tokens, e, device=device)
    top_values, index = logits.topk(shape.top_k, dim=-1)
    leaf = lambda size, scale: (torch.randn(size, device=device) * scale).to(dtype).requires_grad_()  # noqa: E731
    return {
        "hidden": leaf((tokens, h), 1.0),
        "top_k_index": index,
        "top_k_weights": torch.softmax(top_values, dim=-1).to(dtype).requires_grad_(),
        **{name: leaf(size, scales[name]) for name, size in shapes.items()},
    }


def _ours(shape: Shape, t: dict) -> Callable[[], torch.Tensor]:
    biases = {k: t[k] for k in ("gate_up_bias", "down_bias") if k in t}
    return lambda: moe_experts(
        t["hidden"], t["top_k_index"], t["top_k_weights"], t["gate_up_proj"], t["down_proj"],
        layout=shape.layout, **biases,
    )  # fmt: skip


def _reference(shape: Shape, t: dict, compile_backend: str) -> Callable[[], torch.Tensor]:
    biases = {k: t[k] for k in ("gate_up_bias", "down_bias") if k in t}
    compiled = torch.compile(moe_experts_reference, backend=compile_backend)
    return lambda: compiled(
        t["hidden"], t["top_k_index"], t["top_k_weights"], t["gate_up_proj"], t["down_proj"],
        layout=shape.layout, **biases,
    )  # fmt: skip


def _hf(shape: Shape, t: dict, implementation: str) -> Callable[[], torch.Tensor]:
    """HF's module whose parameters are the bench's leaves (so autograd.grad reaches them)."""
    module = hf_module(shape, implementation, t["hidden"].dtype, t["hidden"].device)
    names = {"gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
    if shape.layout == "gpt_oss":
        names |= {"gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}
    for ours, theirs in names.items():
        delattr(module, theirs)
        setattr(module, theirs, t[ours])
    return lambda: module(t["hidden"], t["top_k_index"], t["top_k_weights"])


def _liger(shape: Shape, t: dict) -> Callable[[], torch.Tensor]:
    if shape.layout != "gate_up_halves":
        raise Unavailable("Liger's fused MoE has no gpt-oss layout (biases, interleaved gate/up)")
    if not t["hidden"].is_cuda:
        raise Unavailable("liger-kernel needs a CUDA device")
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as e:
        raise Unavailable(f"this liger-kernel has no fused MoE op ({e})") from None
    index = t["top_k_index"].to(torch.int32)  # what its own tests pass
    return lambda: LigerFusedMoEFunction.apply(
        t["hidden"], t["gate_up_proj"], t["down_proj"], index, t["top_k_weights"]
    )


def build(provider: str, shape: Shape, t: dict, compile_backend: str) -> Callable[[], torch.Tensor]:
    if provider == "ligertune":
        return _ours(shape, t)
    if provider == "hf_eager":
        return _hf(shape, t, "eager")
    if provider == "hf_grouped_mm":
        return _hf(shape, t, "grouped_mm")
    if provider == "compile_ref":
        return _reference(shape, t, compile_backend)
    return _liger(shape, t)


def gemm_flops(shape: Shape, tokens: int) -> dict[str, int]:
    fwd = 6 * tokens * shape.top_k * shape.hidden * shape.inter
    return {"fwd": fwd, "bwd": 2 * fwd, "full": 3 * fwd}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def measure(fn, wrt, dout, pass_: str, timer: Timer) -> tuple[float, float | None]:
    """(median ms, peak extra MiB or None off CUDA) of one pass."""

    def backward(out):
        # allow_unused: a provider that gives some input no gradient is timed for what it does.
        return torch.autograd.grad(out, wrt, dout, allow_unused=True)

    on_cuda = dout.is_cuda
    if pass_ == "bwd":
        mib = None
        if on_cuda:
            out = fn()
            mib = peak_extra_mib(lambda: backward(out), returns_grads=True)
            del out
        return timer.after(fn, backward), mib
    run = fn if pass_ == "fwd" else lambda: backward(fn())
    return timer(run), peak_extra_mib(run, returns_grads=pass_ == "full") if on_cuda else None


def run_shape(name: str, shape: Shape, tokens: int, opts, device, timer: Timer, log) -> list[dict]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = make_inputs(shape, tokens, dtype, device)
    wrt = [t for t in inputs.values() if t.requires_grad]
    dout = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
    flops = gemm_flops(shape, tokens)
    rows = []
    # The mismatch's reference, made once before any provider: the fast providers run (and print)
    # first, so a time limit that stops the slow per-expert loops still leaves their rows.
    with torch.no_grad():
        baseline = build("hf_eager", shape, inputs, opts.compile_backend)().detach()
    for provider in opts.providers:
        row = {"shape": name, "provider": provider, "tokens": tokens, **shape.__dict__}
        try:
            fn = build(provider, shape, inputs, opts.compile_backend)
            out = fn()  # warm-up: Triton JIT, torch.compile
            row["mismatch"] = rel_err(out, baseline)
            del out
            for pass_ in opts.passes:
                ms, mib = measure(fn, wrt, dout, pass_, timer)
                sol_ms = flops[pass_] / (opts.peak_tflops * 1e12) * 1e3
                row[pass_] = {"ms": ms, "peak_extra_mib": mib, "sol_pct": 100.0 * sol_ms / ms}
            row["status"] = "ok"
        except Unavailable as e:
            row["status"] = f"unavailable: {e}"
        except torch.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:  # a provider that fails is reported; the others still run
            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(format_row(row, opts.passes))
        rows.append(row)
    return rows


def format_row(row: dict, passes) -> str:
    head = f"{row['shape']:<14} {row['provider']:<14}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    cells = []
    for p in passes:
        m = row[p]
        mem = "" if m["peak_extra_mib"] is None else f" {m['peak_extra_mib']:8.0f} MiB"
        cells.append(f"{p} {m['ms']:9.3f} ms{mem} {m['sol_pct']:5.1f}% SOL")
    mismatch = f"  mismatch {row['mismatch']:.1e}"
    return f"{head} " + " | ".join(cells) + mismatch


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument(
        "--providers", default=",".join(PROVIDERS), help=f"comma-separated, of {', '.join(PROVIDERS)}"
    )
    parser.add_argument("--passes", default=",".join(PASSES), help="comma-separated, of fwd, bwd, full")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the matmul rate of the SOL floor")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--warmup-ms", type=float, default=100.0)
    parser.add_argument("--rep-ms", type=float, default=500.0)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU (fp32, Triton's interpreter, compile with aot_eager, wall-clock "
        "times that mean nothing): checks that every provider runs",
    )
    opts = parser.parse_args(argv)
    for field, allowed in (("shapes", SHAPES), ("providers", PROVIDERS), ("passes", PASSES)):
        values = tuple(v for v in getattr(opts, field).split(",") if v)
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            parser.error(f"--{field}: {', '.join(unknown) or 'empty'}; choose from {', '.join(allowed)}")
        setattr(opts, field, values)
    return opts


def main(argv=None, log: Callable[[str], None] = print) -> list[dict]:
    opts = parse_args(argv)
    if opts.dry_run:
        device = torch.device("cpu")
        opts.compile_backend, opts.rep_ms = "aot_eager", 0.0
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --dry-run")
    timer = Timer(device, warmup_ms=opts.warmup_ms, rep_ms=opts.rep_ms)
    log(
        f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (dry run)'}; torch {torch.__version__}"
    )
    rows = []
    for name in opts.shapes:
        shape, tokens = SHAPES[name], opts.tokens
        if opts.dry_run:
            top_k = min(shape.top_k, DRY_SHAPE["experts"])
            shape = Shape(DRY_SHAPE["hidden"], DRY_SHAPE["experts"], top_k, DRY_SHAPE["inter"], shape.layout)
            tokens = DRY_SHAPE["tokens"]
        rows += run_shape(name, shape, tokens, opts, device, timer, log)
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
