"""The objectives a recipe can name (``objective.name``), one module each: its options model (the
recipe's ``objective:`` section when it is chosen), the data it trains on, its rules, its frozen
model, how its loss runs at the lm_head and the metrics it logs (`base.ObjectiveOptions` says
what each means). The losses themselves are in `ligertune.objectives`.

`OBJECTIVES` is the one list (a `Choice`: the recipe schema's ``objective`` field is the union
of its models, told apart by ``name``). Adding an objective is a module here, its entry in
`OBJECTIVES`, and its loss in `ligertune.objectives` (docs/architecture.md walks through one).
"""

from __future__ import annotations

from typing import Any

from ligertune.catalog.choice import Choice
from ligertune.catalog.objectives.base import FrozenModel, ObjectiveOptions
from ligertune.catalog.objectives.distill import DistillOptions
from ligertune.catalog.objectives.dpo import DPOOptions
from ligertune.catalog.objectives.grpo import GRPOOptions
from ligertune.catalog.objectives.kto import KTOOptions
from ligertune.catalog.objectives.orpo import ORPOOptions
from ligertune.catalog.objectives.sft import SFTOptions
from ligertune.catalog.objectives.simpo import SimPOOptions

OBJECTIVES = Choice(
    "objective",
    "name",
    (
        SFTOptions,
        DPOOptions,
        ORPOOptions,
        SimPOOptions,
        KTOOptions,
        DistillOptions,
        GRPOOptions,
    ),  # the first: the default
)


# Until the section was one model per objective, every objective's options were keys of every
# recipe, and a recipe.yaml saved with a checkpoint lists them all, at their defaults for the
# objectives that do not read them. Those values meant nothing and are dropped when read, so such
# recipes (and resumes from such checkpoints) read as before. Any other value of a key the chosen
# objective does not have is an error naming the objectives that have it.
_INERT_VALUES: dict[str, tuple[Any, ...]] = {
    "beta": (None,),
    "loss_type": ("sigmoid",),
    "label_smoothing": (0.0,),
    "reference": (None, "none"),
    "reference_model": (None,),
    "gamma_beta_ratio": (0.5,),
    "desirable_weight": (1.0,),
    "undesirable_weight": (1.0,),
    "teacher": (None,),
    "divergence": ("forward_kl",),
    "temperature": (1.0,),
    "jsd_beta": (0.5,),
    "ce_weight": (0.5,),
}


def read_section(raw: Any) -> Any:
    """The ``objective`` section as the union reads it: ``name`` defaults to sft, and the keys an
    older recipe wrote with no effect are dropped (see `_INERT_VALUES`). A null ``beta`` or
    ``reference`` always meant "the objective's default", so it is dropped for every objective."""
    if not isinstance(raw, dict):
        return raw
    raw = {"name": OBJECTIVES.name_of(OBJECTIVES.default), **raw}
    chosen = OBJECTIVES.named(raw["name"])
    fields = chosen.model_fields if chosen is not None else {}
    return {
        key: value
        for key, value in raw.items()
        if not (_inert(key, value) and (key not in fields or value is None))
    }


def _inert(key: str, value: Any) -> bool:
    """Whether `value` is one a recipe of the old layout wrote for `key` with no effect (a bool is
    never one: ``false == 0.0`` in Python, but not in a recipe)."""
    return any(
        value is inert if inert is None else (value == inert and not isinstance(value, bool))
        for inert in _INERT_VALUES.get(key, ())
    )


__all__ = ["OBJECTIVES", "FrozenModel", "ObjectiveOptions", "read_section"]
