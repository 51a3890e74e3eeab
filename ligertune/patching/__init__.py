"""Our kernels, put into an instantiated Hugging Face model: `patch_model(model, kernels)`.

`registry` is the one list of kernels (names, defaults, what each replaces); one file per kernel
family holds its patch functions (`norms`, `rope`, `mlp`, `losses`); `common` has what they share
(finding modules, binding forwards, marking what is patched) and `report` the `PatchReport`.

`patch_model` and `PatchReport` are imported on first use (PEP 562): reading the registry, which
the recipe schema does, must not import torch and transformers.
"""

from __future__ import annotations

import importlib

from ligertune.patching.registry import DEFAULT_KERNELS, KERNEL_NAMES, KERNELS, KernelEntry, kernel

_LAZY = {"patch_model": "ligertune.patching.apply", "PatchReport": "ligertune.patching.report"}

__all__ = [
    "DEFAULT_KERNELS",
    "KERNELS",
    "KERNEL_NAMES",
    "KernelEntry",
    "PatchReport",
    "kernel",
    "patch_model",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
