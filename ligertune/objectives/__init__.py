"""Training objectives behind one seam (`base.Objective`): the loss a recipe trains with.

``sft`` (`causal_lm`): next-token cross entropy on the label tokens. Adding an objective is one
module here with a class following `Objective`, an entry in `OBJECTIVES`, and its tests
(docs/architecture.md walks through one).
"""

from __future__ import annotations

from ligertune.objectives.base import Batch, Objective, ObjectiveOutput
from ligertune.objectives.causal_lm import CausalLM

OBJECTIVES: dict[str, type] = {"sft": CausalLM}


def build_objective(name: str = "sft") -> Objective:
    return OBJECTIVES[name]()


__all__ = ["OBJECTIVES", "Batch", "Objective", "ObjectiveOutput", "build_objective"]
