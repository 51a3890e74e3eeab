"""Patch functions of the gated-MLP kernels: ``swiglu`` (SiLU gate) and ``geglu`` (tanh-GELU gate).

The family's gated MLP computes ``down_proj(act(gate) * up)`` with the fused kernel, chosen from
the MLP's activation module. ``gate_proj``/``up_proj``/``down_proj`` (Phi3: ``gate_up_proj``,
split in half, gate first) are called as modules, so LoRA adapters on them keep working. The
kernel's backward overwrites gate and up with their gradients (they are private intermediates
of the MLP), saving one activation-sized buffer. For a family the table does not know, a module
with ``gate_proj``/``up_proj``/``down_proj`` Linear layers is patched when a probe on random rows
shows it computes exactly ``down(act(gate(x)) * up(x))`` (`probe_gated_mlp`).

In a mixture-of-experts family the family's MLP class covers its dense layers and Qwen2-MoE's
shared expert; the routed experts (3-D weights, one module for all of them) are the
``moe_experts`` kernel's (`ligertune.patching.moe`). Mixtral and GPT-OSS have no dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation, SiLUActivation

from ligertune.kernels import swiglu as gated_kernel
from ligertune.patching.common import MARK, Patcher, is_marked, matches, partial_forward, patches, probe_input

# Gated activation (the kernel module's name for it) → the registry kernel that implements it.
GATED_KERNELS = {"silu": "swiglu", "gelu_tanh": "geglu"}
_DESCRIPTION = {"swiglu": "SiLU", "geglu": "tanh-GELU"}


def _gated_mlp_forward(self, x, *, activation: str):
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(gated_kernel.gated_act(gate, up, activation, inplace_backward=True))


def _fused_gated_mlp_forward(self, x, *, activation: str):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(gated_kernel.gated_act(gate, up, activation, inplace_backward=True))


def activation_of(act: nn.Module) -> str | None:
    """The kernel's name for an activation module, or None when no kernel computes it."""
    if isinstance(act, (nn.SiLU, SiLUActivation)):
        return "silu"
    if isinstance(act, (GELUTanh, NewGELUActivation, FastGELUActivation)):
        return "gelu_tanh"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


@torch.no_grad()
def probe_gated_mlp(module: nn.Module) -> str:
    """The gated activation with which ``module`` is ``down(act(gate(x)) * up(x))``, or raise
    ValueError saying why it is not."""
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts):
        raise ValueError("no gate_proj/up_proj/down_proj Linear layers")
    activation = activation_of(getattr(module, "act_fn", None))
    if activation is None:
        raise ValueError(f"act_fn {type(getattr(module, 'act_fn', None)).__name__} has no fused kernel")
    gate, up, down = parts
    x = probe_input(4, gate.in_features, gate.weight)
    try:
        out = module(x)
    except Exception as e:
        raise ValueError(f"probe failed: {type(e).__name__}: {e}") from None
    reference = gated_kernel.swiglu_reference if activation == "silu" else gated_kernel.geglu_reference
    ref = down(reference(gate(x), up(x)))
    if not matches(out, ref):
        raise ValueError("its output is not down_proj(act_fn(gate_proj(x)) * up_proj(x)) on a random probe")
    return activation


def _gated_mlps(patcher: Patcher) -> tuple[dict[str, list], list[tuple[str, str]], str]:
    """(kernel → [(module, forward)], failures, what was looked for) over the model's gated MLPs."""
    found: dict[str, list] = {"swiglu": [], "geglu": []}
    failures: list[tuple[str, str]] = []
    f = patcher.family
    if f is not None and f.mlp is None:
        return found, failures, "dense MLPs (this family's feed-forward layers are all routed experts)"
    if f is not None:
        # The language model's MLP, and the vision blocks' gated MLP when there is one (its
        # projections separate, with biases, which the forward calls as modules).
        bodies = {f.mlp: _fused_gated_mlp_forward if f.mlp_fused_gate_up else _gated_mlp_forward}
        if f.vision is not None and f.vision.mlp:
            bodies[f.vision.mlp] = _gated_mlp_forward
        for cls, body in bodies.items():
            for name, module in patcher.family_instances(cls):
                act = getattr(module, f.mlp_act_attr, None)
                activation = activation_of(act)
                if activation is None:
                    failures.append((name, f"activation {type(act).__name__} has no fused kernel"))
                else:
                    found[GATED_KERNELS[activation]].append(
                        (module, partial_forward(body, activation=activation))
                    )
        return found, failures, f"{' or '.join(bodies)} modules"
    for name, module in patcher.model.named_modules():
        if not hasattr(module, "gate_proj"):
            continue
        if is_marked(module):
            found[module.__dict__[MARK]].append((module, None))
            continue
        try:
            activation = probe_gated_mlp(module)
        except ValueError as e:
            failures.append((name, f"{type(module).__name__} {e}"))
            continue
        found[GATED_KERNELS[activation]].append(
            (module, partial_forward(_gated_mlp_forward, activation=activation))
        )
    return found, failures, "gated MLPs (gate_proj, up_proj, down_proj)"


def _patch_gated(patcher: Patcher, kernel: str) -> None:
    found, failures, where = _gated_mlps(patcher)
    other = "geglu" if kernel == "swiglu" else "swiglu"
    none_reason = f"no {where} with a {_DESCRIPTION[kernel]} activation" + (
        f" (this model's MLPs use {other})" if found[other] else ""
    )
    # Unsupported activations are reported under both kernels: either could have applied.
    patcher.apply(kernel, found[kernel], failures, none_reason)


@patches("swiglu")
def patch_swiglu(patcher: Patcher) -> None:
    _patch_gated(patcher, "swiglu")


@patches("geglu")
def patch_geglu(patcher: Patcher) -> None:
    _patch_gated(patcher, "geglu")
