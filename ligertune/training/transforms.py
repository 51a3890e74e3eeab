"""The ordered list of model transforms: what happens to the built model before it is wrapped.

    build_model → kernels → plugins → activation checkpointing → compile → runtime.wrap

Each `ModelTransform` says when it applies and what it does; `apply_transforms` runs them in
`TRANSFORMS` order and returns the model (a transform may return a new one, as an adapter
library wraps the model it is given) and, per transform that ran, what it reports for the run
log (the kernels' `PatchReport`, the plugins applied). The order is
the point: our kernels look for Hugging Face's own module types, so they go first; a plugin
sees the patched model; checkpointing and compilation must see the final modules; the
strategy's wrapper (DDP, FSDP2, DeepSpeed), which also builds the optimizer, comes last.

Plugins (``plugins:`` in the recipe) are the extension point for anything else a user wants
done to the model: a list of ``"module:function"`` names (or a built-in short name, see
`BUILTIN_PLUGINS`), each called as ``function(model, recipe)`` and returning the model to go on
with (or None: modified in place). ``liger`` applies Liger-Kernel's own instance patch, which
is how the benchmarks put the peer library through our loop.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ligertune.config import Recipe
from ligertune.config.schema import BUILTIN_PLUGINS
from ligertune.errors import RecipeError
from ligertune.models.build import decoder_layers
from ligertune.patching.apply import patch_model
from ligertune.patching.report import PatchReport


@dataclass(frozen=True)
class ModelTransform:
    name: str
    applies: Callable[[Recipe], bool]
    # → (the model to go on with, what to report in the run log or None)
    apply: Callable[[nn.Module, Recipe], tuple[nn.Module, object | None]]


def _kernels(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, PatchReport]:
    return model, patch_model(model, recipe.kernels)


def plugin_function(name: str) -> Callable:
    """The callable a ``plugins`` entry names; RecipeError naming the entry otherwise."""
    target = BUILTIN_PLUGINS.get(name, name)
    module_name, _, function_name = target.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise RecipeError([f"plugins: cannot load {name!r}: {type(e).__name__}: {e}"]) from None
    if not callable(function):
        raise RecipeError([f"plugins: {name!r} is not callable"])
    return function


def _plugins(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    for name in recipe.plugins:
        returned = plugin_function(name)(model, recipe)
        model = model if returned is None else returned
    return model, f"plugins applied: {', '.join(recipe.plugins)}"


def _activation_checkpointing(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, None]:
    if not model.supports_gradient_checkpointing:
        raise RecipeError(
            [
                f"training.activation_checkpointing: {type(model).__name__} does not support it; set it to false"
            ]
        )
    # Non-reentrant checkpointing works with inputs that need no grad, with kwargs and with
    # torch.compile; the reentrant variant does not.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, None


def _compile(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, None]:
    # Compiling each layer in place (not the whole model) keeps state-dict names unchanged,
    # compiles one graph reused by every layer, and leaves the loss head (where the fused
    # linear cross entropy lives) to its own kernels.
    for layer in decoder_layers(model):
        layer.compile()
    return model, None


TRANSFORMS: tuple[ModelTransform, ...] = (
    ModelTransform("kernels", lambda r: bool(r.kernels.enabled()), _kernels),
    ModelTransform("plugins", lambda r: bool(r.plugins), _plugins),
    ModelTransform(
        "activation_checkpointing", lambda r: r.training.activation_checkpointing, _activation_checkpointing
    ),
    ModelTransform("compile", lambda r: r.training.compile, _compile),
)


def apply_transforms(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, dict[str, object]]:
    """Every transform that applies to this recipe, in order. Returns the model, in train mode,
    and {transform name: what it reports} for those that report something."""
    reports = {}
    for transform in TRANSFORMS:
        if transform.applies(recipe):
            model, report = transform.apply(model, recipe)
            if report is not None:
                reports[transform.name] = report
    model.train()
    return model, reports
