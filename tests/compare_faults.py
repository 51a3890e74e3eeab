"""Test-only faults for `ligertune compare` arms (never imported by ligertune itself).

`ligertune.compare` imports the module named by ``LIGERTUNE_COMPARE_INJECT`` in every arm
process and calls ``inject(arm_name)``. This module reads the faults to inject from
``COMPARE_FAULTS``, a JSON mapping of arm name to fault:

- ``{"scale_rms_norm": s}``: the RMSNorm kernel's output is multiplied by s (a broken kernel).
- ``{"oom_at_step": k}``: the k-th optimizer step raises ``torch.OutOfMemoryError`` (simulated).
- ``{"cuda_oom_at_step": k}``: the k-th step asks the CUDA allocator for 1 PiB (a real OOM).
"""

from __future__ import annotations

import json
import os

FAULTS_ENV = "COMPARE_FAULTS"


def inject(arm_name: str) -> None:
    fault = json.loads(os.environ.get(FAULTS_ENV, "{}")).get(arm_name)
    if not fault:
        return
    if "scale_rms_norm" in fault:
        _scale_rms_norm(fault["scale_rms_norm"])
    if "oom_at_step" in fault:
        _fail_at_step(fault["oom_at_step"], real=False)
    if "cuda_oom_at_step" in fault:
        _fail_at_step(fault["cuda_oom_at_step"], real=True)


def _scale_rms_norm(scale: float) -> None:
    from ligertune.kernels import rms_norm as module

    kernel = module.rms_norm

    def broken(*args, **kwargs):
        return kernel(*args, **kwargs) * scale

    module.rms_norm = broken


def _fail_at_step(step: int, real: bool) -> None:
    import torch

    from ligertune import train as loop

    forward_backward = loop.forward_backward
    calls = 0

    def failing(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == step:
            if real:
                torch.empty(2**50, dtype=torch.uint8, device="cuda")
            raise torch.OutOfMemoryError(
                f"out of memory at step {step} (simulated by tests/compare_faults.py)"
            )
        return forward_backward(*args, **kwargs)

    loop.forward_backward = failing
