"""What every kernel's patch function shares: the `Patcher` it works through, and how a forward
is bound to one module instance.

A patch function (one per kernel of the catalog, in `norms`, `rope`, `mlp`, `moe`, `attention`, `losses`, registered
under the kernel's name with ``@patches``) finds its target
modules, by the family table's class names (`ligertune.catalog.families`) or, for a family the
table does not know, by module type and a probe; then hands (module, forward) pairs and the
reasons for the modules it could not patch to `Patcher.apply`, which installs them, marks each
patched module with the kernel's name and keeps the report. Nothing in transformers, in
``torch.nn.functional`` or in any class is modified: only the instances' own ``forward``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ligertune.catalog.families import Family
from ligertune.catalog.kernels import kernel
from ligertune.patching.report import PatchReport

MARK = "_ligertune_kernel"

# Kernel name → the function that patches it in (it takes a `Patcher`): filled by ``@patches``.
PATCHES: dict[str, Callable[[Patcher], None]] = {}


def patches(name: str) -> Callable:
    """Register the decorated function as the patch of kernel `name` (a catalog entry)."""
    kernel(name)  # KeyError naming the closest kernel: a typo fails at import, not at patch time

    def register(function: Callable[[Patcher], None]) -> Callable[[Patcher], None]:
        PATCHES[name] = function
        return function

    return register


def is_marked(module: nn.Module) -> bool:
    return MARK in module.__dict__


def set_forward(module: nn.Module, forward: Callable) -> None:
    """Give this one instance its own ``forward`` (a function taking ``self``)."""
    module.forward = types.MethodType(forward, module)


def instances(model: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def module_names(pairs: list[tuple[str, Any]], limit: int = 4) -> str:
    shown = ", ".join(name or "<root>" for name, _ in pairs[:limit])
    return shown + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")


def partial_forward(fn: Callable, **options) -> Callable:
    """``forward(self, *args, **kwargs)`` calling ``fn`` with fixed keyword ``options``. Its
    signature is ``fn``'s without them: generate() and trainers inspect ``model.forward``."""

    def forward(self, *args, **kwargs):
        return fn(self, *args, **kwargs, **options)

    signature = inspect.signature(fn)
    forward.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name not in options]
    )
    forward.__name__ = forward.__qualname__ = fn.__name__
    forward.__doc__ = fn.__doc__
    return forward


def probe_input(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """Random probe rows from a private generator: patching never moves the global RNG."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, cols, generator=generator).to(device=like.device, dtype=like.dtype)


def matches(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Same values up to rounding: 1e-5 relative in fp32, two units in the last place in 16-bit
    (per element, relative to the element plus the mean magnitude, as in the kernel tests)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    tol = 1e-5 if torch.finfo(out.dtype).bits >= 32 else 2.0**-7
    out, ref = out.double(), ref.double()
    return bool(((out - ref).abs() <= tol * (ref.abs() + ref.abs().mean())).all())


class Patcher:
    """The model being patched, its family entry (None for a family the table does not know) and
    the report; `apply` installs what a patch function found."""

    def __init__(self, model: nn.Module, family: Family | None, report: PatchReport):
        self.model, self.family, self.report = model, family, report

    def family_instances(self, class_name: str) -> list[tuple[str, nn.Module]]:
        return instances(self.model, self.family.resolve(class_name))

    def apply(
        self,
        kernel: str,
        targets: list[tuple[nn.Module, Callable | None]],
        failures: list[tuple[str, str]],
        none_reason: str,
        install: Callable[[nn.Module, Callable], None] = set_forward,
    ) -> list[nn.Module]:
        """Install each (module, function) unless the module is patched already, and mark it;
        record the failures (module name, reason). Returns the modules patched by this call."""
        if not targets and not failures:
            self.report.skipped[kernel] = none_reason
        done = []
        for module, forward in targets:
            if is_marked(module):
                self.report.already_patched[kernel] = self.report.already_patched.get(kernel, 0) + 1
            else:
                install(module, forward)
                setattr(module, MARK, kernel)
                self.report.patched[kernel] += 1
                done.append(module)
        if failures:
            by_reason: dict[str, list[tuple[str, None]]] = {}
            for name, reason in failures:
                by_reason.setdefault(reason, []).append((name, None))
            self.report.skipped[kernel] = "; ".join(
                f"{module_names(names)}: {why}" for why, names in by_reason.items()
            )
        return done

    def skip(self, kernel: str, reason: str) -> None:
        self.report.skipped[kernel] = reason
