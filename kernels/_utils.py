"""Shared launch helpers for the Triton kernels.

Every kernel in this package runs in one of three ways:

* compiled Triton on a CUDA tensor (the real thing);
* Triton's CPU interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported
  (how CI checks the kernels on a machine without a GPU);
* otherwise, on a CPU tensor, the pure-PyTorch reference that sits beside each kernel.

`use_triton` makes that choice in one place so every op behaves the same way.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The largest block of columns one program keeps in registers. 64 KiB of fp32 per row is the
# point past which Triton spills; rows wider than this are processed in a loop.
MAX_FUSED_SIZE = 65536


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton path can run on these tensors (CUDA, or CPU under the interpreter)."""
    return all(t.is_cuda for t in tensors) or (INTERPRET and all(t.device.type == "cpu" for t in tensors))


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)


def num_warps_for(block_size: int) -> int:
    """Warps for a row-wise kernel whose widest block is `block_size` elements."""
    if block_size >= 32768:
        return 32
    if block_size >= 8192:
        return 16
    if block_size >= 2048:
        return 8
    return 4


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors, or a small stand-in on CPU (interpreter)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def max_offset(t: torch.Tensor) -> int:
    """Largest element offset from ``t.data_ptr()`` that indexing ``t`` through its strides reaches."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0


def offsets_need_int64(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel indexing these tensors through their strides needs int64 offsets.

    Stride-aware, unlike counting elements: a strided view of a large buffer (every other row of
    it, one head of a fused projection) can reach offsets past 2**31 - 1 while holding few
    elements. ``None`` entries (optional tensors) are skipped.
    """
    return any(t is not None and max_offset(t) >= 2**31 - 1 for t in tensors)
