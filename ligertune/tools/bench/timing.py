"""Timing and peak memory of device work: the one GPU timer every benchmark uses.

`Timer` gives the median device time of a call (CUDA events; wall clock on the CPU), following
``triton.testing.do_bench``'s protocol with two changes explained in its docstring. The memory
helpers measure the peak a call allocates above what existed before it, minus the storage of
gradients it returns (their final home, which any implementation needs). `measure_rates` times
the two ceilings of the speed of light: device-to-device copy bandwidth and a dense matmul.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timer:
    """Median milliseconds of a call's device work (CUDA) or of its wall clock (CPU).

    On CUDA every repetition runs after a cold L2 (a 256 MiB write) and behind a GPU spin
    (``torch.cuda._sleep``, ~1 ms) queued ahead of it, with CUDA events around the call alone.
    The spin lets the host enqueue the whole call before the GPU reaches it, so the time is the
    kernels' own, not the host's launch latency: a single op timed back to back with nothing
    queued ahead is bound by Python/launch overhead on a busy host (seen on the H200 VM: the same
    SwiGLU backward read 0.28 and 0.39 ms in two runs), while in training the host runs ahead
    of the GPU and that overhead is hidden. End-to-end throughput (scripts/e2e_bench.py) shows
    whatever host cost remains.
    """

    device: torch.device
    warmup_ms: float
    rep_ms: float
    lead_cycles: int = 2_000_000  # ~1 ms at the H200's 1.98 GHz: longer than any call's launches

    def __call__(self, fn: Callable[[], object]) -> float:
        return self.after(lambda: None, lambda _: fn())

    def after(self, setup: Callable[[], object], fn: Callable[[object], object]) -> float:
        """Median ms of ``fn(setup())``, timing `fn` alone: `setup` runs, untimed, before every
        repetition. On CUDA it follows do_bench's protocol (an estimate, warm-up for warmup_ms,
        repetitions for rep_ms, a cold L2 before each) with events around `fn` only."""
        if self.device.type != "cuda":
            return _wall_clock_median_ms(setup, fn, self.rep_ms)
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=self.device)

        def once() -> tuple[torch.cuda.Event, torch.cuda.Event]:
            state = setup()
            flush.zero_()
            torch.cuda._sleep(self.lead_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(state)
            end.record()
            return start, end

        def median_of(n: int) -> float:
            times = []
            for _ in range(n):
                start, end = once()
                # One repetition at a time: a spin queued behind the previous repetition would
                # otherwise let the host fall behind again.
                end.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)

        # Each repetition also waits out its spin, so the counts are capped: a median of 100
        # cold-cache repetitions is stable to well under the run-to-run spread.
        estimate = max(median_of(3), 1e-3)
        median_of(min(20, max(1, int(self.warmup_ms / estimate))))
        return median_of(min(100, max(3, int(self.rep_ms / estimate))))


def _wall_clock_median_ms(
    setup: Callable[[], object], fn: Callable[[object], object], rep_ms: float
) -> float:
    """CPU timing: at least two runs, then more until rep_ms of timed work."""
    times: list[float] = []
    while len(times) < 2 or sum(times) < rep_ms:
        state = setup()
        t0 = time.perf_counter()
        fn(state)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _live_cuda_blocks() -> set[int]:
    """Start addresses of the CUDA caching allocator's allocated blocks. Each allocation is its own
    block, so a tensor's storage data_ptr is its block's start address."""
    live = set()
    for segment in torch.cuda.memory_snapshot():
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live.add(address)
            address += block["size"]
    return live


def new_storage_bytes(tensors: Iterable[torch.Tensor | None], existing: set[int]) -> int:
    """Bytes of the storages behind `tensors` that are not already in `existing`, each counted
    once (a gradient written in place into an input, or one tensor returned for two inputs,
    costs nothing extra)."""
    seen, total = set(existing), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def peak_extra_mib(run: Callable[[], object], returns_grads: bool) -> float:
    """Run once on the current CUDA device and return the peak extra MiB (see DEFINITIONS).

    With `returns_grads`, `run` returns a tuple of gradients; the storage among them that was
    allocated during the run is their final home and is subtracted. Storage that already existed
    is not: a gradient written into an input (liger's cross entropy) or computed by the forward
    and only handed over by the backward (fused losses) costs the backward nothing.
    """
    torch.cuda.synchronize()
    existing = _live_cuda_blocks() if returns_grads else set()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = new_storage_bytes(result, existing) if returns_grads else 0
    return (peak - before - grads) / 2**20


def measure_rates(device: torch.device, timer: Timer) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and dense matmul rate (TFLOP/s) of this device."""
    if device.type == "cuda":
        copy_bytes, n, dtype = 2**30, 8192, torch.bfloat16
    else:
        copy_bytes, n, dtype = 2**26, 512, torch.float32
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    mm_ms = timer(lambda: a @ b)
    return {
        "copy_gbps": 2 * copy_bytes / copy_ms / 1e6,
        "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
        "matmul": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
    }
