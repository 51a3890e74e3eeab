"""`Rule`: one named check between recipe keys, as `ligertune.config.rules` lists them and the
components (`ligertune.catalog.objectives`, `ligertune.catalog.strategies`) declare their own.

A rule returns one line per problem, each starting with the key to change. Its phase says when
it runs: *recipe* rules whenever a recipe is read, *model* rules once the model's config can be
read against the installed transformers, *machine* rules on the machine the run goes on
(`ligertune.config.rules` explains the three).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

PHASES = ("recipe", "model", "machine")


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[Recipe], list[str]]
    phase: str = "recipe"

    @property
    def summary(self) -> str:
        """The first paragraph of the check's docstring, on one line: what the recipe reference
        says of it."""
        paragraph = (self.check.__doc__ or "").strip().split("\n\n")[0]
        return " ".join(line.strip() for line in paragraph.splitlines())


def runs_on_cuda(recipe: Recipe) -> bool:
    """Whether the run's device is a GPU on this machine (``auto`` picks CUDA when present). For
    machine rules only: asking imports torch, which reading a recipe must not."""
    device = recipe.training.device
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()
