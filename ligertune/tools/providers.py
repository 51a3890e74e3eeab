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

from ligertune.patching.registry import DEFAULT_KERNELS


@dataclass(frozen=True)
class Provider:
    kernels: tuple[str, ...]  # our kernels this provider turns on (every other one is off)
    overrides: tuple[str, ...] = field(default_factory=tuple)  # any other recipe overrides

    def recipe_overrides(self) -> list[str]:
        """All of it as overrides: kernels off, this provider's on, then its other overrides."""
        return ["kernels=none", *(f"kernels.{k}=true" for k in self.kernels), *self.overrides]


PROVIDERS: dict[str, Provider] = {
    "eager": Provider(()),  # the Hugging Face model as built
    "ligertune": Provider(DEFAULT_KERNELS),  # our kernels, the selection of `kernels: all`
    "liger": Provider((), ("plugins=[liger]",)),  # Liger-Kernel's instance patch
}
