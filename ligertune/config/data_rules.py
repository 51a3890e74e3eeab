"""The rules of the data section's mappings: ``data.columns`` and ``data.roles`` (and the same keys of
each ``data.mix`` entry) name fields the source's format reads. Registered in
`ligertune.config.rules`, which lists them with the others.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from ligertune.catalog.formats import FORMAT_FIELDS, MESSAGE_FORMATS, MESSAGE_KEYS, ROLES

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe


def _sources(recipe: Recipe) -> list[tuple[str, str, dict[str, str], dict[str, str], str | None]]:
    """(key prefix, format, columns, roles, messages_field) of every data source, the mix's
    entries with the data section's values where they leave a key unset."""
    data = recipe.data
    if not data.mix:
        return [("data", data.format, data.columns, data.roles, data.messages_field)]
    return [
        (
            f"data.mix[{i}]",
            source.format or data.format,
            source.columns if source.columns is not None else data.columns,
            source.roles if source.roles is not None else data.roles,
            source.messages_field or data.messages_field,
        )
        for i, source in enumerate(data.mix)
    ]


def _columns_known(recipe: Recipe) -> list[str]:
    """data.columns maps fields of the format (and, for chat formats, the message keys role and content) to distinct columns; data.roles maps to system, user, assistant or tool."""
    problems = []
    for prefix, fmt, columns, roles, messages_field in _sources(recipe):
        required, optional = FORMAT_FIELDS["chat" if fmt == "messages" else fmt]
        conversation = fmt in MESSAGE_FORMATS
        fields = [*required, *optional, *(MESSAGE_KEYS if conversation else ())]
        for field in columns:
            if field not in fields:
                close = difflib.get_close_matches(field, fields, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                problems.append(
                    f"{prefix}.columns: {field!r} is not a field of data.format {fmt}{hint} "
                    f"(its fields: {', '.join(fields)}); map each field to the dataset's column: "
                    "{field: column}"
                )
        taken: dict[str, str] = {}
        for field, column in columns.items():
            if column in taken and field not in MESSAGE_KEYS:
                problems.append(
                    f"{prefix}.columns: {taken[column]} and {field} both name the column {column!r}"
                )
            taken.setdefault(column, field)
        if messages_field is not None and required[0] in columns and conversation:
            problems.append(
                f"{prefix}.columns: {required[0]} and {prefix}.messages_field both name the conversation "
                "column; keep one"
            )
        if roles and not conversation:
            problems.append(
                f"{prefix}.roles: used only with data.format chat or sharegpt (this one is {fmt})"
            )
        for name, role in roles.items():
            if role not in ROLES:
                problems.append(
                    f"{prefix}.roles: {name!r} → {role!r}; a role is one of {', '.join(ROLES)} "
                    "(map the dataset's name to ours: {human: user})"
                )
    return problems


# (rule name, check), in the order `ligertune.config.rules` registers them.
DATA_RULES = [("data.columns_known", _columns_known)]
