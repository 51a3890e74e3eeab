"""The one list of kernels: every name a recipe, the patcher, `bench` and `compare` use.

Each `KernelEntry` is a kernel of ``ligertune.kernels`` as the tool knows it: the recipe key
that turns it on (``kernels.<name>``), the line the recipe reference prints for it, whether
``kernels: all`` turns it on and which Hugging Face computation it replaces. The function that
puts it into a model lives with the other patches (`ligertune.patching`, registered there under
this name with ``@patches``), since it needs torch and this list must not. The recipe schema,
the patcher, the patch report, ``ligertune compare --kernels`` and ``ligertune bench --kernels``
all read this tuple; adding a kernel is its file in ``kernels/``, an entry here, its patch
function, and its tests (docs/architecture.md walks through one).

Order matters twice: it is the order of the patch report and of every listing, and kernels are
patched in it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelEntry:
    name: str
    summary: str  # the recipe reference's description of kernels.<name>
    default: bool  # on under `kernels: all` (and when the recipe says nothing)
    # What the kernel takes over in the model. Two kernels that replace the same computation
    # cannot both be on (the recipe rule `kernels.one_per_computation` says which to choose).
    replaces: str | None = None


KERNELS: tuple[KernelEntry, ...] = (
    KernelEntry("rms_norm", "Triton RMSNorm (and q_norm/k_norm where the family has them).", True),
    KernelEntry("layer_norm", "Triton LayerNorm.", True),
    KernelEntry("rope", "Triton rotary embedding for q and k in one launch.", True),
    KernelEntry("swiglu", "Triton SwiGLU activation in the MLP.", True),
    KernelEntry("geglu", "Triton GeGLU (tanh GELU) activation in the MLP (Gemma).", True),
    KernelEntry(
        "moe_experts",
        "Mixture-of-experts routed experts on grouped GEMMs with a fused, recomputed gated "
        "activation (Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS, DeepSeek-V3); transformers' own experts where it cannot "
        "compute them (docs/moe.md).",
        True,
    ),
    KernelEntry(
        "vision_attention",
        "Qwen2.5-VL / Qwen3-VL vision tower: each layer's attention over all images and windows in one "
        "FlexAttention call with a block-diagonal mask, instead of one call per image or window "
        "(docs/vision.md).",
        True,
    ),
    KernelEntry("cross_entropy", "Triton cross entropy over materialised logits.", False, replaces="loss"),
    KernelEntry(
        "fused_linear_cross_entropy",
        "lm_head + cross entropy fused in chunks; logits are never materialised in training.",
        True,
        replaces="loss",
    ),
)

KERNEL_NAMES: tuple[str, ...] = tuple(k.name for k in KERNELS)
DEFAULT_KERNELS: tuple[str, ...] = tuple(k.name for k in KERNELS if k.default)


def kernel(name: str) -> KernelEntry:
    """The entry called `name`; KeyError naming the closest valid name otherwise."""
    for entry in KERNELS:
        if entry.name == name:
            return entry
    close = difflib.get_close_matches(name, KERNEL_NAMES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise KeyError(f"unknown kernel {name!r}{hint}; kernels: {', '.join(KERNEL_NAMES)}")


def conflicts(names: list[str] | tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(computation, kernels) for every computation that more than one of `names` replaces."""
    by_target: dict[str, list[str]] = {}
    for name in names:
        target = kernel(name).replaces
        if target is not None:
            by_target.setdefault(target, []).append(name)
    return [(target, found) for target, found in by_target.items() if len(found) > 1]
