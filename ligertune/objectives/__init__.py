"""Training objectives behind one seam (`base.Objective`): the loss a recipe trains with.

``sft`` (`causal_lm`): next-token cross entropy on the label tokens. The preference objectives
``dpo`` (with IPO and hinge variants), ``orpo``, ``simpo`` (`pairs` and one module each) train
on pairs of responses, ``kto`` on unpaired desirable/undesirable examples, ``distill``
(`distill`) on a frozen teacher's distribution, and ``grpo`` (`grpo`, with `rollout` generating
and `rewards` scoring) on completions the policy generates while it trains; `logps` computes
sequence and per-token log-probs without the [tokens × vocab] logits, `reference` provides the
reference model's and builds the frozen models (reference, teacher), which the parallel strategy
places like the policy (a replica, or sharded under FSDP2 and ZeRO-3).

Each objective's recipe section, data, rules and memory facts are its catalog module's
(`ligertune.catalog.objectives`); its loss is a class here naming that module's options model.
Every module of this package is imported here, so that each such class registers itself and
`build_objective` finds it: adding an objective is its catalog module, its entry in the catalog's
list and its loss module here (docs/architecture.md walks through one).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from torch import nn

from ligertune.catalog.objectives import OBJECTIVES, ObjectiveOptions
from ligertune.objectives.base import Batch, Building, Objective, ObjectiveOutput, Prepared

if TYPE_CHECKING:
    from ligertune.config import Recipe
    from ligertune.objectives.reference import Placement

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_objective(
    options: ObjectiveOptions | None = None,
    *,
    recipe: Recipe | None = None,
    policy: nn.Module | None = None,
    runtime: Placement | None = None,
    tokenizer: object | None = None,
) -> Objective:
    """The objective a recipe's ``objective`` section names (default: sft). `policy` is the
    trained model (a peft model with LoRA: its reference is the adapters-off policy), the one
    the strategy wrapped, not the wrapper; `recipe` and `runtime` (the strategy's,
    `ligertune.distributed`) build and place a frozen reference or teacher (`build_frozen`);
    `tokenizer` decodes what an objective generates."""
    options = options if options is not None else OBJECTIVES.default()
    return Objective.implementation(options).build(options, Building(recipe, policy, runtime, tokenizer))


__all__ = ["Batch", "Objective", "ObjectiveOutput", "Prepared", "build_objective"]
