"""Patch functions of the normalisation kernels: ``rms_norm`` and ``layer_norm``.

``rms_norm``: every RMSNorm of the family (decoder norms, the final norm, Qwen3/Gemma3
``q_norm``/``k_norm``, Gemma2/3 pre/post-feedforward norms) computes
``rms_norm(x, self.weight, eps, offset, casting_mode)``: Llama casting for Llama-style norms,
``offset=1`` and all-fp32 math for Gemma's ``(1 + w)`` norms. The eps attribute is read at every
call, like the module itself does. For a family the table does not know, a module whose class
name ends in ``RMSNorm`` is patched when a probe on random rows shows it computes exactly one of
the two semantics (`probe_rms_norm`).

``layer_norm``: every plain ``nn.LayerNorm`` over one trailing dimension, in any model.
"""

from __future__ import annotations

import torch
from torch import nn

from ligertune.kernels import layer_norm as ln_kernel
from ligertune.kernels import rms_norm as rms_kernel
from ligertune.patching.common import (
    Patcher,
    instances,
    is_marked,
    matches,
    partial_forward,
    patches,
    probe_input,
)


def _rms_norm_forward(self, hidden_states, *, eps_attr: str, offset: float, casting_mode: str):
    return rms_kernel.rms_norm(hidden_states, self.weight, getattr(self, eps_attr), offset, casting_mode)


def _layer_norm_forward(self, x):
    return ln_kernel.layer_norm(x, self.weight, self.bias, self.eps)


@torch.no_grad()
def probe_rms_norm(module: nn.Module) -> dict | str:
    """Options for `_rms_norm_forward` under which it reproduces ``module``, or why not.

    The candidate semantics are the two in the wild: ``w·x̂`` with Llama casting and
    ``(1 + w)·x̂`` in fp32 (Gemma). The module is run on random rows and compared with the
    kernel's reference for each; the weight is the module's own, and since a fresh Llama weight
    is ones and a fresh Gemma weight zeros, the two never agree by accident.
    """
    weight = getattr(module, "weight", None)
    eps_attr = next(
        (a for a in ("variance_epsilon", "eps") if isinstance(getattr(module, a, None), float)), None
    )
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps_attr is None:
        return "not a 1-D weight with an eps or variance_epsilon attribute"
    x = probe_input(4, weight.shape[0], weight)
    try:
        out = module(x)
    except Exception as e:  # a module we cannot run standalone (sharded, meta, ...)
        return f"probe failed: {type(e).__name__}: {e}"
    for offset, casting_mode in ((0.0, "llama"), (1.0, "gemma")):
        ref = rms_kernel.rms_norm_reference(x, weight, getattr(module, eps_attr), offset, casting_mode)
        if matches(out, ref):
            return dict(eps_attr=eps_attr, offset=offset, casting_mode=casting_mode)
    return "its output matches neither w·x̂ (Llama) nor (1+w)·x̂ (Gemma) on a random probe"


@patches("rms_norm")
def patch_rms_norm(patcher: Patcher) -> None:
    f = patcher.family
    if f is not None:
        forward = partial_forward(
            _rms_norm_forward, eps_attr=f.norm_eps_attr, offset=f.norm_offset, casting_mode=f.norm_casting
        )
        targets = [(m, forward) for _, m in patcher.family_instances(f.rms_norm)]
        patcher.apply("rms_norm", targets, [], f"no {f.rms_norm} modules in the model")
        return
    targets, failures = [], []
    for name, module in patcher.model.named_modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        probed = {} if is_marked(module) else probe_rms_norm(module)
        if isinstance(probed, str):
            failures.append((name, f"{type(module).__name__} {probed}"))
        else:
            targets.append((module, partial_forward(_rms_norm_forward, **probed)))
    patcher.apply("rms_norm", targets, failures, "no module whose class name ends in RMSNorm")


@patches("layer_norm")
def patch_layer_norm(patcher: Patcher) -> None:
    targets, failures = [], []
    for name, module in instances(patcher.model, nn.LayerNorm):
        if type(module).forward is not nn.LayerNorm.forward:
            failures.append((name, f"{type(module).__name__} overrides nn.LayerNorm.forward"))
        elif len(module.normalized_shape) != 1:
            failures.append((name, f"normalises over {len(module.normalized_shape)} dimensions, not 1"))
        else:
            targets.append((module, _layer_norm_forward))
    patcher.apply("layer_norm", targets, failures, "no nn.LayerNorm in the model")
