"""Patch function of the mixture-of-experts kernel: ``moe_experts``.

The family's routed-experts module (the `Experts` record's class: ``Qwen3MoeExperts``,
``Qwen2MoeExperts``, ``MixtralExperts``, ``GptOssExperts``) gets a forward that calls
`ligertune.kernels.moe.moe_experts` on its own 3-D parameters, with the same
``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` contract. The sparse
block around it and its router stay transformers': the routing, the router logits and the
balancing loss computed from them are HF's own. SiLU families use the gate/up-halves layout and
must have a SiLU ``act_fn`` (the kernel computes no other activation); GPT-OSS uses its
interleaved layout with both biases, and ``alpha``/``limit`` read from the module at every call.
A model whose family has no `Experts` record (dense or unknown) has nothing to patch: routed
experts are found by the family table's class name, never by probing.

Where the kernel cannot take the grouped path (no Triton, misaligned weights) it runs its own
per-expert reference (`moe_experts`' docstring): the same function, HF's eager algorithm.
"""

from __future__ import annotations

from torch import nn

from ligertune.catalog.families import Family
from ligertune.kernels import moe as moe_kernel
from ligertune.patching.common import MARK, Patcher, instances, patches
from ligertune.patching.mlp import activation_of
from ligertune.patching.report import plural

KERNEL = "moe_experts"


def _halves_forward(self, hidden_states, top_k_index, top_k_weights):
    return moe_kernel.moe_experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj
    )


def _gpt_oss_forward(self, hidden_states, router_indices, routing_weights):
    return moe_kernel.moe_experts(
        hidden_states,
        router_indices,
        routing_weights,
        self.gate_up_proj,
        self.down_proj,
        gate_up_bias=self.gate_up_proj_bias,
        down_bias=self.down_proj_bias,
        layout="gpt_oss",
        alpha=self.alpha,
        limit=self.limit,
    )


# The family record's expert activation → the forward computing it (GPT-OSS's names for the
# routing arguments kept, as its sparse block passes them positionally either way).
_FORWARDS = {"silu": _halves_forward, "clamped_swiglu": _gpt_oss_forward}


@patches(KERNEL)
def patch_moe_experts(patcher: Patcher) -> None:
    f = patcher.family
    if f is None or f.experts is None:
        patcher.skip(KERNEL, "not a known MoE family (no Experts record in the family table)")
        return
    experts = f.experts
    targets, failures = [], []
    for name, module in patcher.family_instances(experts.experts):
        act = getattr(module, "act_fn", None)
        if experts.expert_activation == "silu" and activation_of(act) != "silu":
            hidden_act = getattr(patcher.model.config, "hidden_act", None)
            failures.append(
                (name, f"hidden_act {hidden_act!r} ({type(act).__name__}): the kernel computes SiLU")
            )
            continue
        targets.append((module, _FORWARDS[experts.expert_activation]))
    patcher.apply(KERNEL, targets, failures, f"no {experts.experts} modules")


def experts_note(model: nn.Module, family: Family) -> str:
    """The patch report's line on what computes a MoE family's routed experts: our kernel,
    transformers' (its configured ``experts_implementation``), or each for some modules."""
    cls = family.experts.experts
    modules = [m for _, m in instances(model, family.resolve(cls))]
    ours = sum(m.__dict__.get(MARK) == KERNEL for m in modules)
    implementation = getattr(model.config, "_experts_implementation", None) or "eager"
    theirs = f"transformers' {implementation}"
    if modules and ours == len(modules):
        return f"experts: ours (moe_experts), {plural(ours, cls + ' module')}"
    if ours:
        return f"experts: ours (moe_experts) in {ours} of {len(modules)} {cls} modules, {theirs} in the rest"
    return f"experts: {theirs} ({cls})"
