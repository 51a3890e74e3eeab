"""The ``liger`` plugin: LinkedIn's Liger-Kernel patched into the model instead of our kernels.

For side-by-side measurements (``scripts/e2e_bench.py``, ``ligertune compare``): with
``kernels=none plugins=[liger]`` the peer library runs through our loop, on the same model,
data and steps. Liger's instance patch (``_apply_liger_kernel_to_instance``) replaces the same
modules ours do, with its defaults for the model type; it also rebinds some functions
process-wide, which is harmless in a process of its own (as each compare arm is).
"""

from __future__ import annotations

from torch import nn

from ligertune.errors import RecipeError


def apply_liger(model: nn.Module, recipe) -> None:
    try:  # an optional dependency: only this plugin needs it
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise RecipeError(
            ["plugins: liger needs the liger-kernel package; pip install liger-kernel"]
        ) from None
    _apply_liger_kernel_to_instance(model=model)
