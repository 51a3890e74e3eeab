"""Providers: named ways to run the same recipe, for side-by-side measurements.

A provider is the set of our kernels it turns on plus any other recipe overrides, applied on
top of the user's recipe; the benchmark scripts run each provider as an arm of
`ligertune.tools.compare` (its own process, same seed, data and steps), so the only difference
between two providers is what these change. ``liger`` is our loop with every kernel of ours off
and Liger-Kernel patched in through the ``plugins`` extension point (`ligertune.patching.liger`);
a provider of another library is one more entry here with its plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ligertune.catalog.kernels import DEFAULT_KERNELS


@dataclass(frozen=True)
class Provider:
    kernels: tuple[str, ...]  # our kernels this provider turns on (every other one is off)
    overrides: tuple[str, ...] = field(default_factory=tuple)  # any other recipe overrides
    # The attention backend where the recipe leaves it to `auto`. The Hugging Face baselines run
    # what transformers picks by default (SDPA), as their users run them; ours runs `auto`.
    default_attention: str | None = None

    def extra_overrides(self, recipe_attention: str = "auto") -> list[str]:
        """The overrides besides the kernel switches, for a recipe whose
        ``model.attn_implementation`` is `recipe_attention`."""
        attention = (
            [f"model.attn_implementation={self.default_attention}"]
            if self.default_attention and recipe_attention == "auto"
            else []
        )
        return [*attention, *self.overrides]

    def recipe_overrides(self, recipe_attention: str = "auto") -> list[str]:
        """All of it as overrides: kernels off, this provider's on, then its other overrides."""
        return [
            "kernels=none",
            *(f"kernels.{k}=true" for k in self.kernels),
            *self.extra_overrides(recipe_attention),
        ]


# The first three are the benchmarks' defaults; the others show what one setting buys.
PROVIDERS: dict[str, Provider] = {
    "eager": Provider((), default_attention="sdpa"),  # the Hugging Face model as built
    "ligertune": Provider(DEFAULT_KERNELS),  # our kernels, the selection of `kernels: all`
    "liger": Provider((), ("plugins=[liger]",), default_attention="sdpa"),  # Liger-Kernel's instance patch
    "eager-compile": Provider((), ("training.compile=true",), default_attention="sdpa"),
    "ligertune-sdpa": Provider(
        DEFAULT_KERNELS, default_attention="sdpa"
    ),  # ours without the packed-row backend
    "ligertune-compile": Provider(DEFAULT_KERNELS, ("training.compile=true",)),
    # MoE models: our kernels with transformers' own experts (grouped_mm), what moe_experts buys.
    "ligertune-hf-experts": Provider(tuple(k for k in DEFAULT_KERNELS if k != "moe_experts")),
    "ligertune-compile-fp8": Provider(DEFAULT_KERNELS, ("training.compile=true", "training.fp8=rowwise")),
    # tensorwise scales: under FSDP2 the weights are also all-gathered in float8
    "ligertune-compile-fp8-tensorwise": Provider(
        DEFAULT_KERNELS, ("training.compile=true", "training.fp8=tensorwise")
    ),
    # FP8 without our kernels: whether a loss difference comes from FP8 itself or from us.
    "eager-compile-fp8": Provider(
        (), ("training.compile=true", "training.fp8=rowwise"), default_attention="sdpa"
    ),
}
DEFAULT_PROVIDERS: tuple[str, ...] = ("eager", "ligertune", "liger")
