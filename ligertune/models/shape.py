"""A model's `ModelShape` (the sizes behind the memory plan and the FLOPs count), read from an
empty (meta-device) build of the recipe's model.

`recipe_shape` builds the model with ``build_model(..., empty=True)``: shapes and dtypes only,
no memory, no weights read, so it answers for an 8B model on a laptop in seconds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ligertune.catalog.families import FAMILIES
from ligertune.catalog.shape import LatentAttention, ModelShape, VisionShape
from ligertune.errors import RecipeError
from ligertune.models.attention import context_parallel_problem
from ligertune.models.build import build_model, decoder_layers, frozen_parameters, tokens_per_image

if TYPE_CHECKING:
    from ligertune.config import Recipe
    from ligertune.config.schema import ModelSection


def model_shape(model: nn.Module, lora_params: int = 0) -> ModelShape:
    """A `ModelShape` from a causal LM (any device, meta included) and its config."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = decoder_layers(model)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_weight = head.weight if head is not None else embed
    unique = {id(p): p for p in model.parameters()}
    intermediate, extra = config.intermediate_size, {}
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and family.experts is not None:
        e = family.experts
        top_k = getattr(config, e.top_k_attr)
        # What one token goes through: k routed experts and the shared one (`ModelShape`).
        intermediate = top_k * getattr(config, e.expert_width_attr) + e.shared_width(config)
        experts_class = family.resolve(e.experts)
        modules = [m for m in model.modules() if isinstance(m, experts_class)]
        routed = {id(p): p for m in modules for p in m.parameters()}
        extra = dict(
            experts=getattr(config, e.num_experts_attr),
            top_k=top_k,
            expert_params=sum(p.numel() for p in routed.values()),
            expert_layers=len(modules),
        )
    if family is not None and family.latent_attention:
        extra["latent"] = LatentAttention(
            q_rank=config.q_lora_rank or 0,
            kv_rank=config.kv_lora_rank,
            rope_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
        )
        # The config's head_dim is the rotary part's (what its rotary module reads).
        head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return ModelShape(
        layers=len(layers),
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=embed.shape[0],
        params=sum(p.numel() for p in unique.values()),
        layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        embed_params=embed.numel(),
        head_params=0 if head_weight is embed else head_weight.numel(),
        lora_params=lora_params,
        row_split_problem=context_parallel_problem(model),
        **extra,
    )


def expert_weights(model: nn.Module, targets: str | list[str]) -> list[tuple[str, torch.Tensor]]:
    """(full name, tensor) of the routed experts' 3-D weights that ``lora.target_parameters``
    names (``experts``: every weight of the family's `Experts` record), in every experts module
    of the model, found by the family table's class. RecipeError for a model without routed
    experts or a name that is not one of their weights."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is None or family.experts is None:
        raise RecipeError(
            [
                f"lora.target_parameters: {type(model).__name__} has no routed experts (not a "
                "mixture-of-experts family of the table, docs/moe.md); remove lora.target_parameters"
            ]
        )
    record = family.experts
    names = list(record.weights) if targets == "experts" else list(targets)
    unknown = [n for n in names if n not in record.weights]
    if unknown:
        raise RecipeError(
            [
                f"lora.target_parameters: {', '.join(map(repr, unknown))} is not a weight of "
                f"{record.experts}; its weights are: {', '.join(record.weights)} (or experts for all)"
            ]
        )
    experts_class = family.resolve(record.experts)
    return [
        (f"{module_name}.{name}", getattr(module, name))
        for module_name, module in model.named_modules()
        if isinstance(module, experts_class)
        for name in names
    ]


def lora_params(model: nn.Module, rank: int, targets: str | list[str]) -> int:
    """Trainable parameters of LoRA adapters of rank `rank` on the decoder layers' linear layers
    named in `targets` (``all-linear``: every one): r × (in + out) each."""
    total = 0
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and (targets == "all-linear" or name.split(".")[-1] in targets):
                total += rank * (module.in_features + module.out_features)
    return total


def expert_lora_params(model: nn.Module, rank: int, targets: str | list[str]) -> int:
    """Trainable parameters of peft's adapters on the experts' 3-D weights ``[E, a, b]``: one
    rank-r pair per expert, r × (a + b) each (peft stores them as one A of r·E rows and one B of
    r·E columns)."""
    return sum(w.shape[0] * rank * (w.shape[1] + w.shape[2]) for _, w in expert_weights(model, targets))


def vision_shape(model: nn.Module, recipe: Recipe) -> VisionShape | None:
    """The vision tower's `VisionShape` for the recipe (None for a text model): its blocks (the
    family's `VisionTower.block`) and their sizes from the config's ``vision_config``; whether
    they train (not under ``model.freeze: [vision]``, nor LoRA, which adapts the language model
    only); the largest image's patches and tokens: Gemma 3's fixed size and count, or Qwen-VL's
    ``data.image_max_pixels`` in merged patches (the processor resizes each side to a multiple of
    ``patch_size × merge`` within that many pixels); Llama 3.2 Vision's whole tiles, one image
    assumed per row (`VisionShape`)."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is None or family.vision is None:
        return None
    record, config = family.vision, model.config.vision_config
    # By class name, as the patch report counts them: Gemma 3's SigLIP blocks live in another module.
    layers = sum(type(m).__name__ == record.block for m in model.get_submodule(record.tower).modules())
    fixed = tokens_per_image(model.config, record)
    images_per_row = None
    if record.cross_attention:
        # MllamaVisionModel: each tile's patches and its class token, padded to a multiple of 8.
        per_tile = (config.image_size // config.patch_size) ** 2 + 1
        per_tile += -per_tile % 8
        patches = per_token = config.max_num_tiles * per_tile
        tokens, max_pixels, images_per_row = 1, None, 1
    elif fixed is not None:
        patches = (config.image_size // config.patch_size) ** 2
        per_token, tokens, max_pixels = patches // fixed, fixed, None
    else:
        per_token, max_pixels = config.spatial_merge_size**2, recipe.data.image_max_pixels
        tokens = max_pixels // (config.patch_size**2 * per_token) if max_pixels else None
        patches = tokens * per_token if tokens is not None else None
    return VisionShape(
        layers=layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        gated=record.mlp is not None,
        trains="vision" not in recipe.model.freeze and recipe.lora is None,
        patches_per_token=per_token,
        tokens_per_image=tokens,
        patches_per_image=patches,
        max_pixels=max_pixels,
        images_per_row=images_per_row,
    )


def recipe_shape(recipe: Recipe) -> ModelShape:
    """The shape of the recipe's model, from an empty build (no memory, no weights read): with
    the parameters ``model.freeze`` leaves untrained and the vision tower of a vision-language model."""
    model = build_model(recipe, torch.device("cpu"), empty=True)
    frozen = (
        sum(p.numel() for p in frozen_parameters(model, recipe.model.freeze)) if recipe.model.freeze else 0
    )
    common = dict(frozen_params=frozen, vision=vision_shape(model, recipe))
    lora = recipe.lora
    if lora is None:
        return replace(model_shape(model), **common)
    experts = expert_lora_params(model, lora.r, lora.target_parameters) if lora.target_parameters else 0
    shape = model_shape(model, lora_params(model, lora.r, lora.target_modules) + experts)
    return replace(shape, expert_lora_params=experts, **common)


def section_shape(recipe: Recipe, section: ModelSection) -> ModelShape:
    """The shape of another model section of the recipe (a frozen reference or teacher), built
    as `build_frozen` builds it: the recipe with that model section, no adapters."""
    return recipe_shape(recipe.model_copy(update={"model": section, "lora": None}))


def frozen_shape(recipe: Recipe) -> ModelShape | None:
    """The shape of the frozen model the recipe's objective holds besides the policy (its
    `frozen_model`: a reference, a teacher), or None when it holds none."""
    frozen = recipe.objective.frozen_model(recipe)
    return section_shape(recipe, frozen.section) if frozen is not None else None
