"""`Implements`: how the torch-side classes find the catalog entry they implement, and the other
way round, without a table of names."""

from __future__ import annotations

from typing import Any, ClassVar


class Implements:
    """Base of a family of classes that each implement one catalog options model (an objective's
    loss, a strategy's engine). A subclass that names its model as ``options_model`` is
    registered under it; `implementation` finds the class of a recipe's section. Each direct
    subclass of this base starts a registry of its own (`ligertune.objectives.base.Objective`,
    `ligertune.distributed.runtime.Runtime`)."""

    options_model: ClassVar[type]
    _registry: ClassVar[dict[type, type]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if Implements in cls.__bases__:
            cls._registry = {}
        if "options_model" in cls.__dict__:
            cls._registry[cls.options_model] = cls

    @classmethod
    def implementation(cls, options: Any) -> type:
        """The registered class that implements `options` (a recipe section's model)."""
        return cls._registry[type(options)]

    @classmethod
    def implementations(cls) -> list[type]:
        return list(cls._registry.values())
