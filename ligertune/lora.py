"""LoRA and QLoRA through peft: wrapping the (already kernel-patched) model, and what it leaves on disk.

A LoRA layer computes ``y = W·x + s·B·A·dropout(x)`` with the base weight W (out × in) frozen,
A (r × in, random) and B (out × r, zero at the start, so training starts from the base model)
trained, and s = alpha/r (alpha/√r with ``use_rslora``). At r = 16 on every linear layer of
Llama-3 8B that is 42M trained parameters, 0.5% of the model: gradients and AdamW state shrink
accordingly, which is the point. With ``model.quantize`` the frozen W is stored in 4 or 8 bits
by bitsandbytes (QLoRA, see `ligertune.models.build.quantization_config`).

Order with our kernels (`ligertune.training.transforms`): kernels first, then LoRA. Our kernels
find their targets by Hugging Face's class names and patch *forwards* of the MLPs, norms and
causal LM; peft then swaps the ``nn.Linear`` projections for LoRA layers that call the original
Linear as ``base_layer``. Our patched MLP forward calls ``self.gate_proj(x)`` etc. as modules, so
it calls the LoRA layers; our fused linear cross entropy looks at whatever sits at ``lm_head``
at each call (`ligertune.patching.losses.fused_head`). The other order would leave the kernels
looking for ``nn.Linear`` projections that are no longer there.

``lora.target_parameters`` adds peft's adapters on the routed experts' 3-D weights
(``ParamWrapper``): while the experts module's forward runs, peft parametrizes each targeted
tensor as W + s·B·A, so our ``moe_experts`` forward, which reads ``self.gate_up_proj`` and
``self.down_proj`` at every call, computes with the adapted weights and backpropagates into A
and B like transformers' forward does (docs/moe.md).

Checkpoints hold the trained parameters only (`ligertune.distributed.runtime.trainable_state`):
the frozen ones come back from the recipe (same weights, same seeded init). The final export
(`ligertune.training.export`) writes the adapter in peft's format and, on request, a merged
plain model (`merged_state_dict`).
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from ligertune.errors import RecipeError
from ligertune.models.build import vision_parts
from ligertune.models.shape import expert_weights
from ligertune.patching.common import MARK
from ligertune.patching.losses import fused_head
from ligertune.patching.moe import KERNEL as MOE_KERNEL

if TYPE_CHECKING:  # the schema is a layer above (see ligertune.models.build)
    from ligertune.config import Recipe

# This module sits above patching (it reads the kernels' marks) and below training (whose
# transforms and export call it): a module of its own, since models/ must not import patching/.

# The projections our gated-MLP forwards call, and what peft names the prefix of the wrapped model.
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_PEFT_PREFIX = "base_model.model."


def is_adapted(model: nn.Module) -> bool:
    """Whether `model` is a peft model (what `apply_lora` returns). Without peft imported it
    cannot be one, and a full fine-tuning run (peft perhaps not installed) imports nothing."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_names(model: nn.Module, skip: set[int] = frozenset()) -> list[str]:
    """The distinct last components of the names of the model's linear layers (q_proj, lm_head,
    ...): the names ``lora.target_modules`` can use. bitsandbytes' 4/8-bit layers are Linears too.
    Modules whose id is in `skip` (a vision tower's) are left out."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m) not in skip
        }
    )


def resolve_targets(
    model: nn.Module, target_modules: str | list[str], skip: set[int] = frozenset()
) -> list[str]:
    """``lora.target_modules`` as the list of layer names peft gets. ``all-linear`` is every
    linear layer but the output layer (peft's meaning of the word); each name given must match
    a linear layer, else RecipeError listing the ones that exist."""
    names = linear_names(model, skip)
    if target_modules == "all-linear":
        output = model.get_output_embeddings()
        output_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is output}
        return [n for n in names if n not in output_names]
    unknown = [t for t in target_modules if t not in names]
    if unknown:
        raise RecipeError(
            [
                f"lora.target_modules: {', '.join(map(repr, unknown))} matches no linear module of "
                f"{type(model).__name__}; its linear modules are: {', '.join(names)}"
            ]
        )
    return list(target_modules)


def _check_modules_to_save(model: nn.Module, modules_to_save: list[str]) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    unknown = [m for m in modules_to_save if m not in names]
    if unknown:
        top = [n for n, _ in model.named_children()]
        raise RecipeError(
            [
                f"lora.modules_to_save: {', '.join(map(repr, unknown))} matches no module of "
                f"{type(model).__name__} (e.g. embed_tokens, lm_head; its top-level modules: {', '.join(top)})"
            ]
        )


def apply_lora(model: nn.Module, recipe: Recipe) -> tuple[nn.Module, str]:
    """Wrap `model` with peft LoRA adapters as ``recipe.lora`` says; returns (the peft model, a
    report for the run log). Every base parameter is frozen; the adapters (and
    ``modules_to_save``) are the only parameters that require grad.

    A quantised model first goes through peft's ``prepare_model_for_kbit_training`` (freezes
    everything, upcasts the non-quantised parameters to fp32), without its gradient
    checkpointing (``training.activation_checkpointing`` is ours, non-reentrant, so the input
    embeddings need no grad hook). With ``training.precision: bf16`` the upcast is undone: fp32
    norm weights would turn every activation after them fp32 (HF's norms multiply in the
    weight's dtype), doubling activation memory and making kernels on and off see different
    dtypes; ``bf16-mixed`` keeps fp32 parameters anyway. Adapters take the dtype of the model
    (``autocast_adapter_dtype=False``): FSDP2 shards a unit's parameters as one flat buffer of
    one dtype."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    lora = recipe.lora
    # A vision-language model's adapters go on its language model only: the names peft matches
    # by suffix (q_proj, and the merger's "0"/"2") exist in the vision tower too, so its modules
    # are excluded, and all-linear counts the language model's linear layers only.
    parts = vision_parts(model)
    vision = set()
    if parts is not None:
        vision = {id(m) for part in ("vision", "projector") for top in parts[part] for m in top.modules()}
    targets = resolve_targets(model, lora.target_modules, skip=vision)
    # Full names (model.layers.0.mlp.experts.gate_up_proj): peft matches target_parameters by
    # suffix, and full names leave nothing to chance.
    parameters = (
        [name for name, _ in expert_weights(model, lora.target_parameters)]
        if lora.target_parameters
        else None
    )
    exclude = [n for n, m in model.named_modules() if id(m) in vision] or None
    _check_modules_to_save(model, lora.modules_to_save)
    if recipe.model.quantize != "none":
        dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        for param in model.parameters():
            if param.dtype == torch.float32 and dtype != torch.float32:
                param.data = param.data.to(dtype)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        target_parameters=parameters,
        modules_to_save=lora.modules_to_save or None,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        exclude_modules=exclude,
    )
    adapted = get_peft_model(model, config, autocast_adapter_dtype=False)
    _check_peft_targets(adapted, targets, parameters or [])
    return adapted, _report(adapted, recipe, targets)


def _check_peft_targets(model: nn.Module, targets: list[str], parameters: list[str]) -> None:
    """The adapters peft placed are the ones asked for. Under transformers 5, peft 0.21 rewrites
    the config of the MoE models whose checkpoints transformers converts (Qwen3-MoE, Mixtral):
    linear names of transformers 4's per-expert layers (gate_proj, up_proj, down_proj; w1..w3)
    become adapters on the fused 3-D experts, at twice the rank for gate_up_proj, and those
    names no longer reach the dense MLPs (Qwen3-MoE's ``mlp_only_layers``). Silently training
    other adapters than the recipe says is refused."""
    tuner = model.base_model
    adapted_modules = {name.rsplit(".", 1)[-1] for name in tuner.targeted_module_names}
    missing = [t for t in targets if t not in adapted_modules]
    unasked = sorted({n.rsplit(".", 1)[-1] for n in set(tuner.targeted_parameter_names) - set(parameters)})
    if missing or unasked:
        raise RecipeError(
            [
                f"lora.target_modules: peft retargets {', '.join(missing or targets)} of "
                f"{type(model.get_base_model()).__name__} to the routed experts' {', '.join(unasked) or 'weights'} "
                "(its transformers-4 MoE conversion), so those linear layers would get no adapter; list "
                "lora.target_modules without them, and use lora.target_parameters for the experts"
            ]
        )


def _report(model: nn.Module, recipe: Recipe, targets: list[str]) -> str:
    """One line per fact: what got adapters, what trains, and how our kernels meet them."""
    lora = recipe.lora
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    layers = [m for m in model.modules() if _is_lora_layer(m) and not _is_param_wrapper(m)]
    variant = "".join([" DoRA" if lora.use_dora else "", " rsLoRA" if lora.use_rslora else ""])
    quantized = f", base in {recipe.model.quantize} (bitsandbytes)" if recipe.model.quantize != "none" else ""
    lines = [
        f"lora{variant}: r={lora.r}, alpha={lora.alpha:g}, dropout={lora.dropout:g} on {len(layers)} layers "
        f"({', '.join(targets)}){quantized}; {trained:,} of {total:,} parameters train ({100 * trained / total:.2f}%)"
    ]
    if lora.modules_to_save:
        lines.append(f"  trained in full: {', '.join(lora.modules_to_save)}")
    wrappers = [m for m in model.modules() if _is_param_wrapper(m)]
    if wrappers:
        # peft nests one wrapper per parameter around the experts module; the innermost is it.
        experts = {id(w.get_base_layer()): w.get_base_layer() for w in wrappers}.values()
        ours = sum(m.__dict__.get(MARK) == MOE_KERNEL for m in experts)
        names = "/".join(sorted({w.parameter_name for w in wrappers}))
        kind = type(next(iter(experts))).__name__
        reader = "transformers' forward"
        if ours:
            reader = "our moe_experts" + (
                "" if ours == len(experts) else f" in {ours}, transformers' in the rest"
            )
        lines.append(
            f"  experts: LoRA on {names} of {len(experts)} {kind} modules, one rank-{lora.r} adapter per "
            f"expert; W + s·B·A made by peft at each call, read by {reader}"
        )
    mlps: dict[str, list[int]] = {}
    for module in model.modules():
        kernel = module.__dict__.get(MARK)
        if kernel in ("swiglu", "geglu"):
            counts = mlps.setdefault(kernel, [0, 0])
            counts[0] += 1
            projections = [getattr(module, p, None) for p in _MLP_PROJECTIONS]
            counts[1] += any(_is_lora_layer(p) for p in projections if p is not None)
    for kernel, (n, adapted) in mlps.items():
        adapted_projections = sorted({p for p in _MLP_PROJECTIONS if p in targets})
        lines.append(
            f"  {kernel}: {n} MLPs"
            + (
                f" (LoRA on {'/'.join(adapted_projections)} in {adapted})"
                if adapted
                else " (no LoRA in them)"
            )
        )
    for module in model.modules():
        if module.__dict__.get(MARK) == "fused_linear_cross_entropy" and hasattr(module, "lm_head"):
            lines.append(f"  fused_linear_cross_entropy: {fused_head(module.lm_head)[1]}")
    return "\n".join(lines)


def _is_lora_layer(module: nn.Module | None) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _is_param_wrapper(module: nn.Module | None) -> bool:
    """peft's adapter on a parameter (``lora.target_parameters``): it parametrizes the wrapped
    module's tensor as W + s·B·A while its forward runs, so whatever forward the module has (ours
    with ``moe_experts``, or transformers') reads the adapted weight."""
    from peft.tuners.lora import ParamWrapper

    return isinstance(module, ParamWrapper)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def save_adapter(model: nn.Module, state: dict[str, torch.Tensor], directory) -> None:
    """The adapter in peft's format (adapter_config.json + adapter_model.safetensors), from the
    model's full state dict `state` (gathered, for sharded strategies): loads with
    ``PeftModel.from_pretrained(base_model, directory)``."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=state)
    model.save_pretrained(
        directory, state_dict={k: v.detach().cpu().contiguous() for k, v in adapter.items()}
    )


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain Hugging Face state dict of the adapted model, adapters merged, on the CPU.

    For a LoRA layer ``W' = W + s·B·A`` (peft's ``get_delta_weight``, which knows the fan-in /
    fan-out layout and the rsLoRA scale); with DoRA ``W' = m ⊙ (W + s·B·A) / ‖W + s·B·A‖_row``,
    peft's merge. ``modules_to_save`` copies replace the originals. Computed from `state` (the
    full state dict, whatever the strategy) without touching the training model's weights; a
    quantised W is dequantised from the live layer first (quantised runs are never sharded). The
    arithmetic is in fp32, rounded once to the weight's dtype."""
    from peft.utils.integrations import dequantize_module_weight

    merged = {}
    lora_layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    consumed: set[str] = set()
    for name, layer in lora_layers.items():
        if _is_param_wrapper(layer):
            consumed |= _merge_parameter(name, layer, state, merged)
            continue
        adapter = layer.active_adapters[0]
        base_key = f"{name}.base_layer.weight"
        quantized = base_key not in state or not state[base_key].dtype.is_floating_point
        weight = dequantize_module_weight(layer.base_layer) if quantized else state[base_key]
        dtype = torch.bfloat16 if quantized else weight.dtype
        a = state[f"{name}.lora_A.{adapter}.weight"].float().cpu()
        b = state[f"{name}.lora_B.{adapter}.weight"].float().cpu()
        full = weight.float().cpu() + _delta(layer, b @ a, adapter)
        if layer.use_dora.get(adapter):
            magnitude = state[f"{name}.lora_magnitude_vector.{adapter}.weight"].float().cpu()
            full = full * (magnitude / torch.linalg.norm(full, dim=1)).view(-1, 1)
        merged[f"{name}.weight"] = full.to(dtype)
        consumed |= {
            k for k in state if k.startswith(f"{name}.lora_") or k.startswith(f"{name}.base_layer.weight")
        }
    saved = re.compile(r"^(.*)\.modules_to_save\.[^.]+\.(.*)$")
    for key, value in state.items():
        if key in consumed or ".original_module." in key:
            continue
        match = saved.match(key)
        key = f"{match[1]}.{match[2]}" if match else _unwrapped(key)
        merged.setdefault(key, value.detach().cpu())
    return {k.removeprefix(_PEFT_PREFIX): v for k, v in merged.items()}


def _unwrapped(key: str) -> str:
    """A key of the adapted model as the plain model names it: peft's wrappers add a
    ``base_layer.`` each, and wrappers of 3-D parameters nest (two on an experts module)."""
    return re.sub(r"(\.base_layer)+\.", ".", key)


def _merge_parameter(name: str, layer: nn.Module, state: dict[str, torch.Tensor], merged: dict) -> set[str]:
    """Merge one peft ``ParamWrapper`` (an adapter on a 3-D experts weight) into `merged`; returns
    the keys of `state` it used.

    peft stores the E experts' factors side by side: A as ``[r·E, in]`` (expert e's rows
    e·r … e·r + r − 1) and B as ``[out, r·E]`` (expert e's columns e, e + E, …: B is reshaped
    ``[out, r, E]``), and ``ΔW_e = s·B_e·A_e`` is ``[out, in]``. The weight is ``[E, out, in]``
    (Qwen, Mixtral: peft swaps its in/out reading) or ``[E, in, out]`` (GPT-OSS, whose module
    says ``is_transposed``), so ΔW_e is transposed for the latter. Wrappers nest, one per
    parameter: the weight sits under as many ``base_layer.`` as there are wrappers."""
    adapter = layer.active_adapters[0]
    depth, inner = 1, layer.base_layer
    while _is_param_wrapper(inner):
        depth, inner = depth + 1, inner.base_layer
    base_key = f"{name}{'.base_layer' * depth}.{layer.parameter_name}"
    weight = state[base_key]
    experts = weight.shape[0]
    a = state[f"{name}.lora_A.{adapter}.weight"].float().cpu()
    b = state[f"{name}.lora_B.{adapter}.weight"].float().cpu()
    a = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
    delta = torch.bmm(b, a) * layer.scaling[adapter]  # [E, out, in]
    if getattr(inner, "is_transposed", False):  # the weight is [E, in, out]: peft's reading too
        delta = delta.transpose(1, 2)
    merged[_unwrapped(base_key)] = (weight.float().cpu() + delta).to(weight.dtype)
    return {base_key, *(k for k in state if k.startswith(f"{name}.lora_"))}


def _delta(layer: nn.Module, product: torch.Tensor, adapter: str) -> torch.Tensor:
    """s·B·A in the base weight's layout (transposed for fan_in_fan_out layers, as peft does)."""
    delta = product * layer.scaling[adapter]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta
