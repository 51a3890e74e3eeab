"""The ordered list of model transforms: what happens to the built model before it is wrapped.

    build_model → attention → kernels → plugins → freeze → lora → fp8 → tiled mlp → activation checkpointing → compile → runtime.wrap

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

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ligertune.catalog.families import FAMILIES
from ligertune.catalog.rules import runs_on_cuda
from ligertune.config import Recipe
from ligertune.errors import RecipeError
from ligertune.lora import apply_lora
from ligertune.models.attention import choose_attention, install_document_mask
from ligertune.models.build import decoder_layers, freeze
from ligertune.patching import PatchReport, patch_model
from ligertune.patching.liger import apply_liger
from ligertune.training.transforms.checkpointing import checkpoint_submodules
from ligertune.training.transforms.offload import install_offload
from ligertune.training.transforms.tiled_mlp import install_tiled_mlp

# The built-in plugins (`ligertune.catalog.section.BUILTIN_PLUGINS` names them for the recipe rules).
BUILTIN_PLUGINS: dict[str, Callable] = {"liger": apply_liger}


@dataclass(frozen=True)
class ModelTransform:
    name: str
    applies: Callable[[Recipe], bool]
    # → (the model to go on with, what to report in the run log or None)
    apply: Callable[[nn.Module, Recipe], tuple[nn.Module, object | None]]
    # Whether it adds or renames parameters and draws random numbers to initialise them
    # (`state_transforms`); the others change how the model computes or trains, not what its
    # state dict holds.
    changes_state: bool = False


def _attention(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    """Reports the backend `build_model` chose; for packed rows, installs the document mask
    (`ligertune.models.attention`), a forward pre-hook on the causal LM that every later
    transform and wrapper leaves in place."""
    # The run's device, not the parameters' (a sharded init builds the model on the meta device).
    _, why = choose_attention(
        recipe.model.attn_implementation, runs_on_cuda(recipe), recipe.data.packing, model.config
    )
    report = f"attention: {model.config._attn_implementation} ({why})"
    # With context parallelism the runtime's attention builds the mask, documents included.
    if recipe.data.packing and recipe.parallel.context_parallel == 1:
        report += f"; {install_document_mask(model)}"
    return model, report


def _kernels(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, PatchReport]:
    return model, patch_model(model, recipe.kernels)


def plugin_function(name: str) -> Callable:
    """The callable a ``plugins`` entry names; RecipeError naming the entry otherwise."""
    if name in BUILTIN_PLUGINS:
        return BUILTIN_PLUGINS[name]
    module_name, _, function_name = name.partition(":")
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


def _freeze(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    """``model.freeze``: parts of a vision-language model that do not train (`ligertune.models.build.freeze`).
    Before lora, which freezes every base weight anyway and adapts the language model only."""
    return model, freeze(model, recipe.model.freeze)


def _lora(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    """peft LoRA adapters (`ligertune.lora.apply_lora`); returns the peft model. After the kernels
    and plugins: they find Hugging Face's module classes and patch forwards, and our patched MLP
    and loss forwards call the projections and the lm_head as modules, so they call the LoRA
    layers peft puts there (the other order would leave the kernels looking for nn.Linear layers
    that are gone). Before checkpointing and compile, which must see the final modules, and
    before wrap, whose FSDP2 units then hold frozen base weights and trainable adapters together
    and whose optimizer gets the adapters only (`build_optimizer` takes what requires grad)."""
    return apply_lora(model, recipe)


def fp8_layers(model: nn.Module) -> tuple[set[nn.Module], int]:
    """The linear layers FP8 is applied to, and how many decoder-layer linears are left out.

    Only the decoder layers' projections: the loss head stays in the model's precision (the
    fused linear cross entropy reads ``lm_head.weight`` itself, and the logits' precision
    matters most to the loss), and FP8 matmuls need both dimensions divisible by 16."""
    chosen, left_out = set(), 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                if module.in_features % 16 == 0 and module.out_features % 16 == 0:
                    chosen.add(module)
                else:
                    left_out += 1
    return chosen, left_out


def _fp8(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    """torchao's float8 training: each chosen ``nn.Linear`` becomes a ``Float8Linear`` that casts
    its input, weight and output gradient to float8 with the recipe's scaling (``rowwise``: one
    scale per row, closer to bf16 numerics; ``tensorwise``: one per tensor, faster) and runs
    ``torch._scaled_mm``. torchao's own choice of the linear layers is replaced by
    `fp8_layers`. With tensorwise scaling under a strategy whose all-gather carries float8
    (FSDP2), the weights are gathered in float8 (torchao's ``enable_fsdp_float8_all_gather``). Without ``training.compile`` the casts run as separate kernels and eat the
    gain, which the log says."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen, left_out = fp8_layers(model)
    names = {id(m) for m in chosen}
    config = Float8LinearConfig.from_recipe_name(recipe.training.fp8)
    # Tensorwise scales are one per weight, so a sharded weight can be cast to float8 before its
    # all-gather (each rank's shard with the whole weight's scale) and gathered in half the bytes.
    gather = recipe.training.fp8 == "tensorwise" and recipe.parallel.gathers_float8
    if gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: id(module) in names)
    report = f"fp8 ({recipe.training.fp8} scaling): {len(chosen)} linear layers of the decoder layers"
    if gather:
        report += f", all-gathered in float8 by {recipe.parallel.label}"
    if left_out:
        report += f"; {left_out} with a dimension not divisible by 16 stay in {recipe.training.precision}"
    if not recipe.training.compile:
        report += "; without training.compile the float8 casts run eagerly and cost more than they save"
    return model, report


def _tiled_mlp(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    """``training.tiled_mlp`` (`ligertune.training.transforms.tiled_mlp`): wraps each decoder MLP's
    forward as the kernels, LoRA and fp8 left it, so the tiles run the patched forward and the
    adapters; before checkpointing, whose recompute then runs the tiled forward."""
    return model, install_tiled_mlp(model, recipe.training.tiled_mlp)


def _activation_checkpointing(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str | None]:
    """``training.activation_checkpointing`` full (every decoder layer) or selective (layers 0, k,
    2k, ...): whole layers through transformers' ``every_n_layers``, or, with
    ``activation_checkpointing_modules``, only that sub-module of each
    (`ligertune.training.transforms.checkpointing`). Then ``training.activation_offload`` on the
    layers not checkpointed whole (`ligertune.training.transforms.offload`). ``auto`` is resolved by
    the trainer's setup (`ligertune.training.auto`); met here unresolved, it reads as none."""
    training = recipe.training
    mode = training.activation_checkpointing
    modules = training.activation_checkpointing_modules  # only with selective (a recipe rule)
    done = []
    if mode in ("full", "selective"):
        every = training.activation_checkpointing_every if mode == "selective" else 1
        layers = decoder_layers(model)
        if modules:
            count = checkpoint_submodules(layers, modules, every)
            done.append(
                f"activation checkpointing selective: {', '.join(modules)} recomputed in {count} of "
                f"{len(layers)} decoder layers"
            )
        else:
            if not model.supports_gradient_checkpointing:
                raise RecipeError(
                    [
                        f"training.activation_checkpointing: {type(model).__name__} does not support it; set it to none"
                    ]
                )
            # Non-reentrant checkpointing works with inputs that need no grad, with kwargs and with
            # torch.compile; the reentrant variant does not.
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every
            )
            checkpointed = sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers)
            done.append(f"activation checkpointing {mode}: {checkpointed} of {len(layers)} decoder layers")
    if training.activation_offload:
        if next(model.parameters()).device.type != "cuda":
            done.append("activation offload: nothing to offload on CPU (no-op)")
        else:
            count = install_offload(decoder_layers(model))
            done.append(f"activation offload to pinned CPU memory on a side stream: {count} decoder layers")
    return model, "; ".join(done) if done else None


def _compile(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str | None]:
    # Compiling each layer in place (not the whole model) keeps state-dict names unchanged,
    # compiles one graph reused by every layer, and leaves the loss head (where the fused
    # linear cross entropy lives) to its own kernels.
    # From transformers 5.2x a layer checkpoints inside its forward, so the checkpoint is traced
    # into the layer's graph, where dynamo refuses a side effect (a hook recording to an object
    # outside, as DeepSeek's expert-load record does) unless it need not be replayed in the
    # recomputation: the records are read before the backward. Process-wide, as dynamo's
    # configuration is.
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in decoder_layers(model):
        layer.compile()
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is not None and family.balancing_loss and getattr(model.config, "output_router_logits", False):
        # transformers collects the router logits through forward hooks that read a ContextVar,
        # which dynamo cannot trace (docs/moe.md, "Not done yet").
        return model, (
            "compile: each MoE layer's graph breaks at transformers' hooks that collect the router "
            "logits for the balancing loss"
        )
    return model, None


TRANSFORMS: tuple[ModelTransform, ...] = (
    ModelTransform("attention", lambda r: True, _attention),
    ModelTransform("kernels", lambda r: bool(r.kernels.enabled()), _kernels),
    ModelTransform("plugins", lambda r: bool(r.plugins), _plugins),
    ModelTransform("freeze", lambda r: bool(r.model.freeze), _freeze),
    ModelTransform("lora", lambda r: r.lora is not None, _lora, changes_state=True),
    ModelTransform("fp8", lambda r: r.training.fp8 != "none", _fp8),
    ModelTransform("tiled_mlp", lambda r: r.training.tiled_mlp is not False, _tiled_mlp),
    ModelTransform(
        "activation_checkpointing",
        lambda r: (
            r.training.activation_checkpointing in ("full", "selective") or r.training.activation_offload
        ),
        _activation_checkpointing,
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


def state_transforms(recipe: Recipe) -> Callable[[nn.Module], nn.Module]:
    """The transforms of `recipe` that change what the model holds (``changes_state``: LoRA,
    whose peft wrapping renames the adapted weights ``…base_layer.weight`` and adds seeded
    adapters), in `TRANSFORMS` order, as one call on a model.

    A sharded init hands it to the runtime (`ligertune.distributed.runtime.Runtime.wrap`):
    rank 0 fills every rank's shards from a whole build of the recipe, which must hold the
    parameters of the transformed empty model, under the same names, initialised from the same
    random numbers. Running these transforms on that build gives both at once, with no table
    mapping plain names onto peft's: the names are peft's own, and the adapters are drawn right
    after the init, as in the plain path (the transforms before lora draw none). The others are
    left out: attention and kernels patch forwards, freeze sets requires_grad, fp8 swaps a
    Linear for a subclass with the same parameters, checkpointing and compile wrap calls, none
    of which the whole build, only read for its values, needs. Plugins are left out too,
    although one may add or change parameters: a plugin may also patch process-wide state
    (Liger rebinds functions of transformers), and applying it a second time on rank 0 alone
    could make the ranks compute differently; under a sharded init a plugin's changes to the
    parameters are therefore not carried to the shards (docs/distributed.md)."""
    chosen = [t for t in TRANSFORMS if t.changes_state and t.applies(recipe)]

    def apply(model: nn.Module) -> nn.Module:
        for transform in chosen:
            model, _ = transform.apply(model, recipe)
        return model

    return apply
