"""The objective seam: what the training loop asks of a loss.

An objective turns a model and a micro-batch into the sum of a per-item loss over that
micro-batch, plus metrics, and says how many items a micro-batch holds. The gradient of one
optimizer step is that of

    Σ_micro-batches Σ_items loss  /  N,     N = Σ count(micro-batch) over the window and every rank

so the result does not depend on how the window is cut into micro-batches or ranks. An item is
what the objective averages over: a label token for next-token SFT, a preference pair for DPO.
`count` runs on the host, on the CPU batch, before any forward, so the loop knows N before the
first backward without a device synchronisation, and hands it to the call: the objective
returns its sum already divided by N. That order matters for fused losses, which compute their
gradient inside the forward: dividing afterwards would scale (and round, in bf16) every stored
gradient a second time. Evaluation passes N = 1 to get plain sums.

Metrics are sums over the micro-batch's items divided by the same N (0-d tensors on the
device): summed over the window they are means, e.g. a reward accuracy from 0/1 per pair.

Each objective is an `Objective` subclass that names the catalog model of its recipe section
(``options_model``, `ligertune.catalog.objectives`): that registers it, and `build_objective`
finds the class of a recipe's ``objective`` section through it and calls its `build`.

An objective may also make the micro-batches it trains on (`prepare`): online RL generates
completions of the data's prompts with the policy, scores them and turns them into rows. The
loop hands it each window of data micro-batches before the step and trains on what it returns;
with `ObjectiveOptions.updates_per_window` above 1 it reuses them for that many optimizer
steps (several policy updates per generation batch) and keeps them in the checkpoints saved in
between, so a resume continues on the same rows. The default returns the data's micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ligertune.catalog.implements import Implements
from ligertune.catalog.objectives import OBJECTIVES, ObjectiveOptions

if TYPE_CHECKING:
    from ligertune.config import Recipe
    from ligertune.objectives.reference import Placement

Batch = dict[str, torch.Tensor]


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # 0-d: the loss summed over this micro-batch's items, divided by N
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # 0-d sums over the items, / N


@dataclass
class Prepared:
    """What `Objective.prepare` makes of a window of data micro-batches."""

    batches: list[Batch]  # the micro-batches to train on (CPU tensors only: a checkpoint may hold them)
    metrics: dict[str, float] = field(
        default_factory=dict
    )  # window means over every rank, logged with the step
    report: str | None = None  # lines for train.log (e.g. sample completions), on the main rank


@dataclass(frozen=True)
class Building:
    """What building an objective may need besides its options: the recipe and the runtime (to
    build and place a frozen reference or teacher like the policy), the policy itself (the
    model the strategy wraps, not the wrapper: a peft model with LoRA, whose reference is the
    adapters-off policy; an objective that generates samples from it) and the tokenizer."""

    recipe: Recipe | None = None
    policy: nn.Module | None = None
    runtime: Placement | None = None
    tokenizer: object | None = None  # the data's, for an objective that decodes what it generates


class Objective(Implements):
    """Given a batch, its item count; given the model, a batch and N, the loss sum over N."""

    options_model: ClassVar[type[ObjectiveOptions]]

    @classmethod
    def build(cls, options: ObjectiveOptions, building: Building) -> Objective:
        """The objective for these options (override to build a reference, a teacher)."""
        return cls()

    @property
    def name(self) -> str:
        return OBJECTIVES.name_of(self.options_model)

    def count(self, batch: Batch) -> int:
        """Items this micro-batch's loss sums over, counted on the host (no device work)."""
        raise NotImplementedError

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        """Forward `batch` (on the model's device) and return its summed loss over `num_items`
        (a 0-d int64 tensor on the device: N ≥ 1)."""
        raise NotImplementedError

    def prepare(self, model: nn.Module, window: list[Batch], step: int) -> Prepared:
        """The micro-batches of optimizer step `step` (0-based) and the next
        ``updates_per_window − 1``, made from the data's `window` (CPU batches); `model` is what
        the strategy wrapped. *Collective* when it communicates (every rank calls it, at the
        same steps). Default: the window itself."""
        return Prepared(window)
