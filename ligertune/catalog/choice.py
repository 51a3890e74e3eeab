"""`Choice`: a recipe section that is one of several options models, told apart by one key
(``objective: {name: dpo, ...}``, ``parallel: {strategy: fsdp, ...}``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Union

from pydantic import BaseModel, Field


class Choice:
    """The options models a section can be (`members`, the first the default) and the key whose
    value names each (`key`, a one-value Literal field of every member)."""

    def __init__(self, section: str, key: str, members: tuple[type[BaseModel], ...]):
        self.section, self.key, self.members = section, key, members
        self.default = members[0]
        # The schema's type for the section: pydantic picks the member by the key's value.
        self.annotation: Any = Annotated[Union[members], Field(discriminator=key)]  # noqa: UP007

    def __iter__(self) -> Iterator[type[BaseModel]]:
        return iter(self.members)

    def name_of(self, member: type[BaseModel] | BaseModel) -> str:
        """The value of the key a member answers to."""
        return (
            type(member).model_fields[self.key].default
            if isinstance(member, BaseModel)
            else member.model_fields[self.key].default
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.name_of(m) for m in self.members)

    def named(self, name: Any) -> type[BaseModel] | None:
        return next((m for m in self.members if self.name_of(m) == name), None)

    def owners(self, option: str) -> list[str]:
        """The members that have an option called `option`, by name."""
        return [self.name_of(m) for m in self.members if option in m.model_fields]
