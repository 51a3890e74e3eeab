"""Patch function of the ``rope`` kernel: HF's attention code object, our ``apply_rotary_pos_emb``.

HF attention forwards call their modeling file's module-level ``apply_rotary_pos_emb``, looked
up in the function's globals at call time; transformers 5.17 has no per-instance hook for it
(``use_kernelized_func`` only acts with the hub ``kernels`` package and ``use_kernels=True``).
So the patched attention runs *the same code object* as HF's forward, in a function whose
globals are a copy of the modeling module's namespace with ``apply_rotary_pos_emb`` bound to our
kernel. No attention code is copied, the modeling module is untouched, and every other name the
forward uses resolves as before (the namespace is copied when a class is first patched; later
rebinding of module globals is not seen). The kernel takes HF's signature and rotates only
``cos.shape[-1]`` channels, which covers Phi3's partial rotary; Gemma3's local/global layers
pass their own cos/sin, so nothing is needed. GPT-OSS's rotary module returns cos/sin of half
the rotary width and its ``apply_rotary_pos_emb`` uses each value for both halves
(``[x₁·cos − x₂·sin, x₂·cos + x₁·sin]``): the same rotation as the rotate-half layout with cos/sin
repeated, so for a family with ``rope_half_cos`` the scope binds `apply_rotary_pos_emb_half_cos`,
which repeats them (a [S, D/2] copy per layer, against the [B, H, S, D] q and k) and calls the
kernel. Its attention sinks are untouched (attention stays HF's). DeepSeek-V3's attention calls
``apply_rotary_pos_emb_interleave`` instead when ``config.rope_interleave`` is on (the default):
its rotary part is laid out in interleaved pairs, and for a family with ``rope_interleave`` the
scope binds that name to `apply_rotary_pos_emb_interleave`, which permutes them to halves and
calls the kernel. This needs the family's attention class, so a family missing from the table
gets no RoPE kernel.

The copy is the namespace of a module of its own, registered in ``sys.modules`` under
``ligertune.patching.rope.scopes.<modeling module>``, because torch.compile finds an inlined
function's globals by the ``__name__`` in them: it guards on ``sys.modules[__name__].<global>``.
With HF's ``__name__`` left in the copy, those guards would read HF's module instead of the
copy: its ``apply_rotary_pos_emb`` (whose ``__kwdefaults__`` is None where ours has
``in_place``, the crash of issue #15), and an identity check on a function that is not the one
traced, failing on every call. With the copy's own name they read the copy.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

from ligertune.catalog.families import Family
from ligertune.kernels import rope as rope_kernel
from ligertune.patching.common import Patcher, patches

ROPE_NAME = "apply_rotary_pos_emb"
INTERLEAVE_NAME = "apply_rotary_pos_emb_interleave"

_ROPE_FORWARDS: dict[Callable, Callable] = {}


def apply_rotary_pos_emb_half_cos(q, k, cos, sin, unsqueeze_dim=1, *, in_place=False):
    """GPT-OSS's ``apply_rotary_pos_emb`` (cos/sin [B, S, R/2], each value for both halves) on
    our kernel, which takes the rotate-half layout's [B, S, R]."""
    return rope_kernel.apply_rotary_pos_emb(
        q, k, torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1), unsqueeze_dim, in_place=in_place
    )


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` on our kernel.

    Its q and k carry the rotary dimensions in interleaved pairs ``(x₀, x₁), (x₂, x₃), ...``,
    pair i rotated by angle θᵢ, and it returns them in halves::

        y = [x_even·c − x_odd·s | x_odd·c + x_even·s]        c, s = cos, sin[..., :D/2] (θᵢ)

    which is the rotate-half rotation of the permuted ``x' = [x_even | x_odd]`` with cos/sin
    ``[c | c]``, ``[s | s]``: the permutation (a copy of q's and k's rotary parts), then
    `apply_rotary_pos_emb_half_cos` on the first half of HF's cos/sin, so that whatever its
    second half holds, only the first is read, as HF reads it. The output is not permuted back,
    as HF's is not: the same permutation of q and k leaves every q·k unchanged. Its backward is
    the kernel's, then autograd's for the permutation (the inverse gather)."""

    def halves(x):
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

    half = cos.shape[-1] // 2
    return apply_rotary_pos_emb_half_cos(
        halves(q), halves(k), cos[..., :half], sin[..., :half], unsqueeze_dim
    )


def _kernel_scope(hf_globals: dict, family: Family) -> dict:
    """The namespace of the module ``scopes.<HF module>``: a copy of ``hf_globals`` with our
    ``apply_rotary_pos_emb`` (and ``apply_rotary_pos_emb_interleave`` for a family that has
    it), created (and registered in ``sys.modules``) on first use."""
    name = f"{__name__}.scopes.{hf_globals['__name__']}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        vars(module).update(hf_globals)
        # Its own identity: neither importlib nor torch.compile may take it for the HF module.
        module.__name__, module.__spec__ = name, None
        rope = apply_rotary_pos_emb_half_cos if family.rope_half_cos else rope_kernel.apply_rotary_pos_emb
        setattr(module, ROPE_NAME, rope)
        if family.rope_interleave:
            setattr(module, INTERLEAVE_NAME, apply_rotary_pos_emb_interleave)
        sys.modules[name] = module
    return vars(module)


def rope_forward_for(hf_forward: Callable, family: Family) -> Callable | str:
    """The attention forward that calls our RoPE kernel, or the reason there cannot be one."""
    if not isinstance(hf_forward, types.FunctionType) or hasattr(hf_forward, "__wrapped__"):
        return f"{hf_forward.__qualname__} is wrapped or not a plain function; its globals cannot be rebound"
    if ROPE_NAME not in hf_forward.__code__.co_names:
        return f"{hf_forward.__qualname__} does not call {ROPE_NAME} by name"
    forward = _ROPE_FORWARDS.get(hf_forward)
    if forward is None:
        scope = _kernel_scope(hf_forward.__globals__, family)
        forward = types.FunctionType(
            hf_forward.__code__, scope, hf_forward.__name__, hf_forward.__defaults__, hf_forward.__closure__
        )
        forward.__kwdefaults__ = hf_forward.__kwdefaults__
        forward.__qualname__ = hf_forward.__qualname__
        forward.__doc__ = hf_forward.__doc__
        _ROPE_FORWARDS[hf_forward] = forward
    return forward


@patches("rope")
def patch_rope(patcher: Patcher) -> None:
    family = patcher.family
    if family is None:
        patcher.skip("rope", "needs a family entry in ligertune/catalog/families.py")
        return
    targets, failures = [], []
    for name, module in patcher.family_instances(family.attention):
        forward = rope_forward_for(type(module).forward, family)
        if isinstance(forward, str):
            failures.append((name, forward))
        else:
            targets.append((module, forward))
    patcher.apply("rope", targets, failures, f"no {family.attention} modules in the model")
