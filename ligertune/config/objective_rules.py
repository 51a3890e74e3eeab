"""The rules between the ``objective`` section and the data (registered in `ligertune.config.rules`,
which lists them with the others): each objective trains on the formats it declares
(`ligertune.catalog.objectives`), and rows of two sequences cannot be packed. Every objective runs
under every parallel strategy (a frozen reference or teacher is placed like the policy), so none
is refused here; an objective's own rules (its reference, its teacher) are declared with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.catalog.formats import PAIR_FORMATS
from ligertune.catalog.objectives import OBJECTIVES

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

# What each format's rows hold, for the error that names the columns an objective needs.
_COLUMNS = {"preference": "prompt, chosen, rejected", "kto": "prompt, completion, label"}


def data_formats(recipe: Recipe) -> set[str]:
    """The formats of the recipe's data: data.format, or each mixed dataset's."""
    data = recipe.data
    if data.mix:
        return {s.format or data.format for s in data.mix}
    return {data.format}


def _trained_on(formats: set[str]) -> str:
    """The objectives that train on all of `formats`, as a phrase: ``dpo, orpo or simpo``."""
    names = [OBJECTIVES.name_of(o) for o in OBJECTIVES if formats <= set(o.formats)]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def objective_fits_data(recipe: Recipe) -> list[str]:
    """Each objective trains on the data formats it declares (dpo/orpo/simpo: preference, kto: kto, sft/distill: the others)."""
    objective, formats = recipe.objective, data_formats(recipe)
    wanted = set(objective.formats)
    if formats <= wanted:
        return []
    if not wanted & set(PAIR_FORMATS):
        paired = sorted(formats & set(PAIR_FORMATS))
        return [
            f"data.format: {', '.join(paired)} data needs a preference objective (objective.name: "
            f"{_trained_on(set(paired))}), not {objective.name}"
        ]
    needed = sorted(wanted)
    columns = f" (columns {_COLUMNS[needed[0]]})" if len(needed) == 1 and needed[0] in _COLUMNS else ""
    return [
        f"objective.name: {objective.name} trains on data.format {' or '.join(needed)}{columns}; "
        f"the data is {', '.join(sorted(formats))}"
    ]


def pairs_unpacked(recipe: Recipe) -> list[str]:
    """Preference and kto data are laid out a pair per row: no packing, streaming or train_on_inputs."""
    data = recipe.data
    if not data_formats(recipe) & set(PAIR_FORMATS):
        return []
    problems = []
    if data.packing:
        problems.append(
            "data.packing: preference and kto rows are two sequences trained as a pair (chosen and rejected, "
            "or a completion and its KL sample) in one micro-batch, which packing cannot keep together; "
            "set data.packing=false (the default for these formats)"
        )
    if data.streaming:
        problems.append(
            "data.streaming: not supported for preference and kto data yet; set data.streaming=false"
        )
    if data.train_on_inputs:
        problems.append(
            "data.train_on_inputs: preference losses score the responses only; set data.train_on_inputs=false"
        )
    return problems


OBJECTIVE_RULES = [
    ("objective.fits_data", objective_fits_data),
    ("objective.pairs_unpacked", pairs_unpacked),
]
