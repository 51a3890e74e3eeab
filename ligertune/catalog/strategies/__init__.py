"""The parallel strategies a recipe can name (``parallel.strategy``), one module each: its options
model (the recipe's ``parallel:`` section when it is chosen), what it supports, its rules, its
checkpoint format and resume rules, and how it spreads memory over the GPUs
(`base.ParallelOptions` says what each means). The engines are in `ligertune.distributed`.

`STRATEGIES` is the one list (a `Choice`: the recipe schema's ``parallel`` field is the union
of its models, told apart by ``strategy``).
"""

from __future__ import annotations

from typing import Any

from ligertune.catalog.choice import Choice
from ligertune.catalog.section import Section
from ligertune.catalog.strategies.base import ParallelOptions
from ligertune.catalog.strategies.ddp import DDPParallel
from ligertune.catalog.strategies.deepspeed import DeepSpeedOptions, DeepSpeedParallel
from ligertune.catalog.strategies.fsdp import FSDPOptions, FSDPParallel
from ligertune.catalog.strategies.single import SingleProcess

STRATEGIES = Choice("parallel", "strategy", (SingleProcess, DDPParallel, FSDPParallel, DeepSpeedParallel))


def writers(checkpoint_format: str) -> list[str]:
    """The strategies that write (and read) checkpoints of `checkpoint_format`, by name."""
    return [STRATEGIES.name_of(s) for s in STRATEGIES if s.checkpoint_format == checkpoint_format]


# Each strategy's own sub-sections (``fsdp:``, ``deepspeed:``). A recipe of the old layout (one
# model for every strategy's options, and every recipe.yaml saved with a checkpoint then) wrote
# them all, at their defaults for the strategies it did not choose.
_SUB_SECTIONS: dict[str, type[Section]] = {
    key: field.annotation
    for strategy in STRATEGIES
    for key, field in strategy.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, Section)
}


def read_section(raw: Any) -> Any:
    """The ``parallel`` section as the union reads it: ``strategy`` defaults to none, and the
    sub-sections of strategies not chosen are dropped when they hold only their defaults (they
    had no effect; anything else there is an error naming the strategy that reads it)."""
    if not isinstance(raw, dict):
        return raw
    raw = {"strategy": STRATEGIES.name_of(STRATEGIES.default), **raw}
    chosen = STRATEGIES.named(raw["strategy"])
    fields = chosen.model_fields if chosen is not None else {}

    def inert(key: str, value: Any) -> bool:
        if key not in _SUB_SECTIONS or key in fields or not isinstance(value, dict):
            return False
        defaults = _SUB_SECTIONS[key]().model_dump()
        return all(
            k in defaults and v == defaults[k] and type(v) is type(defaults[k]) for k, v in value.items()
        )

    return {key: value for key, value in raw.items() if not inert(key, value)}


__all__ = [
    "STRATEGIES",
    "DDPParallel",
    "DeepSpeedOptions",
    "DeepSpeedParallel",
    "FSDPOptions",
    "FSDPParallel",
    "ParallelOptions",
    "SingleProcess",
    "read_section",
    "writers",
]
