"""Faults for `ligertune compare` arms, as recipe plugins (never imported by ligertune itself).

A plugin (``plugins: ["tests.compare_faults:<name>"]``, see `ligertune.training.transforms`)
runs in every arm on the arm's own model and recipe, so each fault picks its arms by what the
arm's recipe turns on:

- `scale_rms_norm`: the RMSNorm kernel's output is multiplied by 1.5 (a broken kernel): every arm
  that patches RMSNorm diverges, the others do not.
- `oom_at_step_2_without_kernels`: in the arm with every kernel off, the second training forward
  raises ``torch.OutOfMemoryError`` (simulated).
- `cuda_oom_at_step_3_without_kernels`: likewise at the third, by asking the CUDA allocator for
  1 PiB (a real OOM).
"""

from __future__ import annotations

import torch

FAULTS = "tests.compare_faults"


def plugin(name: str) -> str:
    """The override that applies fault `name` in every arm."""
    return f"plugins=[{FAULTS}:{name}]"


def scale_rms_norm(model, recipe) -> None:
    from ligertune.kernels import rms_norm as module

    kernel = module.rms_norm

    def broken(*args, **kwargs):
        return kernel(*args, **kwargs) * 1.5

    module.rms_norm = broken


def _fail_at_forward(model, recipe, step: int, real: bool) -> None:
    if recipe.kernels.enabled():
        return
    calls = 0

    def count(module, args, kwargs):
        nonlocal calls
        if not module.training:
            return
        calls += 1
        if calls == step:
            if real:
                torch.empty(2**50, dtype=torch.uint8, device="cuda")
            raise torch.OutOfMemoryError(
                f"out of memory at step {step} (simulated by tests/compare_faults.py)"
            )

    model.register_forward_pre_hook(count, with_kwargs=True)


def oom_at_step_2_without_kernels(model, recipe) -> None:
    _fail_at_forward(model, recipe, 2, real=False)


def cuda_oom_at_step_3_without_kernels(model, recipe) -> None:
    _fail_at_forward(model, recipe, 3, real=True)
