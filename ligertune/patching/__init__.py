"""Our kernels, put into an instantiated Hugging Face model: `patch_model(model, kernels)`.

The list of kernels (names, defaults, what each replaces) is the catalog's
(`ligertune.catalog.kernels`); one file per kernel family holds the patch functions, each
registered under its kernel's name with ``@patches`` (`norms`, `rope`, `mlp`, `moe`, `attention`,
`losses`); `common` has what they share (finding modules, binding forwards, marking what is
patched) and `report` the `PatchReport`.
"""

from __future__ import annotations

from ligertune.patching.apply import patch_model, selected_kernels
from ligertune.patching.report import PatchReport

__all__ = ["PatchReport", "patch_model", "selected_kernels"]
