"""`patch_model`: the selected kernels of the registry, put into one model instance.

Modules are found *by type* (the family table of `ligertune.catalog.families`) and only those
instances get a new ``forward``. Nothing in the transformers package, in
``torch.nn.functional`` or in any class is modified, so two models in one process can be
patched differently (or not at all), and since no module is replaced or renamed, ``state_dict``
keys, checkpoints and ``save_pretrained`` stay exactly Hugging Face's. A patched module carries
the name of its kernel in ``_ligertune_kernel``; a second call finds the marks and patches
nothing twice. Patching never undoes an earlier patch.

For a ``model_type`` missing from the table only kernels that can be recognised by type apply:
``layer_norm``, ``cross_entropy`` (when the model's loss is HF's causal-LM loss), and RMSNorm and
gated-MLP modules whose forward a probe on a small random input shows to compute exactly our
kernel's function. ``rope`` and the fused loss need a family entry.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from torch import nn

from ligertune.catalog.families import FAMILIES, VisionTower
from ligertune.catalog.kernels import DEFAULT_KERNELS, KERNEL_NAMES, KERNELS, conflicts, kernel
from ligertune.patching import attention, losses, mlp, moe, norms, rope  # noqa: F401 - each registers its patches
from ligertune.patching.common import MARK, PATCHES, Patcher, is_marked
from ligertune.patching.report import PatchReport

KernelSelection = Mapping[str, bool] | str | None


def selected_kernels(kernels) -> set[str]:
    """The kernel names a selection turns on. ``kernels``: None or ``"all"`` (the registry's
    defaults), ``"none"``, a mapping of kernel name to bool (unnamed kernels keep their default),
    or anything with an ``enabled()`` method returning names (the recipe's ``kernels`` section)."""
    if kernels is None:
        names = set(DEFAULT_KERNELS)
    elif isinstance(kernels, str):
        if kernels not in ("all", "none"):
            raise ValueError(
                f"kernels={kernels!r}: use 'all', 'none', a recipe's kernels section or a mapping kernel→bool"
            )
        names = set(DEFAULT_KERNELS) if kernels == "all" else set()
    elif isinstance(kernels, Mapping):
        for name in kernels:
            try:
                kernel(name)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        names = {k for k in KERNEL_NAMES if kernels.get(k, k in DEFAULT_KERNELS)}
    elif callable(getattr(kernels, "enabled", None)):
        names = set(kernels.enabled())
    else:
        raise TypeError(
            f"kernels must be a recipe's kernels section, a mapping, 'all' or 'none', got {type(kernels).__name__}"
        )
    for target, both in conflicts(sorted(names, key=KERNEL_NAMES.index)):
        raise ValueError(f"kernels {' and '.join(both)} both replace the {target}: choose one")
    return names


def patch_model(model: nn.Module, kernels: KernelSelection = None) -> PatchReport:
    """Patch the kernels selected by ``kernels`` (see `selected_kernels`) into this model
    instance, in place, in registry order. Patch before wrapping the model (PEFT, FSDP,
    DeepSpeed, torch.compile): patching looks for Hugging Face's own module types. Calling it
    again is safe: patched modules are recognised and counted in ``already_patched``."""
    selected = selected_kernels(kernels)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or model_type is None:
        raise TypeError(
            f"patch_model needs a transformers model with a config.model_type, got {type(model).__name__}; "
            "pass the model returned by AutoModelForCausalLM (before wrapping it)"
        )
    family = FAMILIES.get(model_type)
    report = PatchReport(type(model).__name__, model_type, family is not None)
    if family is None:
        report.notes.append(
            f"model_type {model_type!r} is not in the family table ({', '.join(FAMILIES)}): only kernels "
            "recognised by module type can apply (rms_norm and swiglu/geglu after a probe of each module, "
            "layer_norm, cross_entropy); rope and fused_linear_cross_entropy need a family entry"
        )
    patcher = Patcher(model, family, report)
    for entry in KERNELS:
        if entry.name in selected:
            PATCHES[entry.name](patcher)
        else:
            patcher.skip(entry.name, "off in the recipe")
    if family is not None and family.experts is not None:
        report.notes.append(moe.experts_note(model, family))  # ours or transformers', after patching
    if family is None and report.total == 0 and not report.already_patched:
        report.notes.append("none of the enabled kernels applies to this model")
    if family is not None and family.vision is not None:
        report.notes.append(_where_applied(model, family.vision))
    return report


def _where_applied(model: nn.Module, vision: VisionTower) -> str:
    """A vision-language model's patched modules, split into vision tower, projector (where it
    sits outside the tower, as Gemma 3's; Qwen-VL's mergers count with the tower) and language
    model (the ForConditionalGeneration module that holds the fused loss counts as the latter)."""

    def within(name: str, path: str) -> bool:
        return name == path or name.startswith(path + ".")

    outside = [p for p in vision.projectors if not within(p, vision.tower)]
    sides: dict[str, Counter] = {"vision tower": Counter()}
    if outside:
        sides["projector"] = Counter()
    sides["language model"] = Counter()
    head = getattr(model, "lm_head", None)  # marked with the causal LM, whose forward owns the loss
    for name, module in model.named_modules():
        if is_marked(module) and module is not head:
            if within(name, vision.tower):
                side = "vision tower"
            elif any(within(name, p) for p in outside):
                side = "projector"
            else:
                side = "language model"
            sides[side][module.__dict__[MARK]] += 1
    blocks = sum(type(m).__name__ == vision.block for m in model.modules())
    where = {
        "vision tower": f"{vision.tower}, {blocks} blocks",
        "projector": ", ".join(outside),
        "language model": vision.language_model,
    }
    parts = [
        f"{side} ({where[side]}): "
        + (", ".join(f"{kernel} {n}" for kernel, n in counts.items()) or "nothing patched")
        for side, counts in sides.items()
    ]
    return "; ".join(parts) + f"; {vision.rope_note}"
