"""The results of `ligertune bench`: one `Row` per (kernel, shape, dtype, pass, provider), and the run's metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ligertune.errors import UsageError

SCHEMA = "ligertune-bench/1"
CPU_LABEL = "CPU — not meaningful"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (warmup ms, rep ms) for do_bench. rep 50 ms is hundreds of samples for a sub-ms kernel; the
# run's wall time is dominated by compilation, not by these (see scripts/gpu_check.sh).
TIMING = {"full": (10.0, 50.0), "quick": (5.0, 25.0), "cpu": (0.0, 20.0)}
# A provider whose forward output differs from eager's by more than this (relative L2) is flagged.
MISMATCH_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
TABLE_WIDTH = 150
FILES = (
    "bench.json",
    "bench.csv",
    "bench.md",
    "bench_time.png",
    "bench_memory.png",
    "flce_memory_vs_vocab.png",
)

DEFINITIONS = {
    "ms": "median device time of one call (CUDA events, cold L2, launches queued behind a GPU spin); bwd times the backward alone, after a fresh forward",
    "peak_extra_mib": (
        "max allocated during one call minus allocated before it (inputs, upstream grads, and for bwd "
        "the forward's outputs and saved tensors), minus the storage of the returned gradients that "
        "the call allocated (bwd, full): their final home"
    ),
    "gbps": "minimal bytes (each input read once, each output written once) / time",
    "pct_sol": "speed-of-light time / time; SOL = max(minimal bytes / copy bandwidth, minimal FLOPs / matmul rate)",
    "speedup_vs_eager": "eager time / this time, same kernel, shape and pass",
    "losses": "cross_entropy and fused_linear_cross_entropy (liger's and ours) compute the gradient during the forward: compare the full pass",
}


class BenchError(UsageError):
    """A bad option; the message names it and says what is accepted."""


@dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    pass_: str
    provider: str
    status: str  # ok | unavailable | error | oom | skipped
    note: str = ""
    ms: float | None = None
    peak_extra_mib: float | None = None
    bytes: int = 0
    flops: int = 0
    gbps: float | None = None
    tflops: float | None = None
    pct_sol: float | None = None
    speedup_vs_eager: float | None = None
    rel_err_vs_eager: float | None = None
    case_wall_s: float | None = None  # wall time of this provider on this shape, all passes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        d = dict(d)
        d["pass_"] = d.pop("pass")
        return cls(**d)


@dataclass
class BenchResult:
    meta: dict
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**self.meta, "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> BenchResult:
        if data.get("schema") != SCHEMA:
            raise BenchError(f"not a {SCHEMA} file (schema {data.get('schema')!r})")
        meta = {k: v for k, v in data.items() if k != "rows"}
        return cls(meta, [Row.from_dict(r) for r in data["rows"]])


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]
