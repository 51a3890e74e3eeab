"""The rules between the ``objective`` section and the data (registered in `ligertune.config.rules`,
which lists them with the others): each objective trains on the formats it declares
(`ligertune.catalog.objectives`), and rows of two sequences, or prompts to complete, cannot be
packed. A frozen reference or teacher is placed like the policy under every strategy; what a
strategy cannot run (generation in the loop) is its own ``unsupported`` entry, checked with the
others by the rule ``parallel.supports``; an objective's own rules are declared with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.catalog.formats import PAIR_FORMATS, PROMPT_FORMATS, UNPACKED_FORMATS
from ligertune.catalog.objectives import OBJECTIVES

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

# What each format's rows hold, for the error that names the columns an objective needs.
_COLUMNS = {
    "preference": "prompt, chosen, rejected",
    "kto": "prompt, completion, label",
    "prompt": "prompt, and optionally answer and metadata",
}
# What objective the formats only some objectives train on need, as the error says it.
_NEEDS = {
    "preference": "a preference objective",
    "kto": "a preference objective",
    "prompt": "an online RL objective",
}


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
    if not wanted & set(UNPACKED_FORMATS):
        special = sorted(formats & set(UNPACKED_FORMATS))
        return [
            f"data.format: {', '.join(special)} data needs {_NEEDS[special[0]]} (objective.name: "
            f"{_trained_on(set(special))}), not {objective.name}"
        ]
    needed = sorted(wanted)
    columns = f" (columns {_COLUMNS[needed[0]]})" if len(needed) == 1 and needed[0] in _COLUMNS else ""
    return [
        f"objective.name: {objective.name} trains on data.format {' or '.join(needed)}{columns}; "
        f"the data is {', '.join(sorted(formats))}"
    ]


def pairs_unpacked(recipe: Recipe) -> list[str]:
    """Preference and kto data are laid out a pair per row, prompt data a prompt per row: no packing, streaming or train_on_inputs."""
    data = recipe.data
    formats = data_formats(recipe)
    if not formats & set(UNPACKED_FORMATS):
        return []
    pairs = bool(formats & set(PAIR_FORMATS))
    what = "preference and kto" if pairs else "prompt"
    problems = []
    if data.packing:
        why = (
            "preference and kto rows are two sequences trained as a pair (chosen and rejected, or a completion "
            "and its KL sample) in one micro-batch, which packing cannot keep together"
            if pairs
            else "a prompt row is completed by the policy, which generates into its own row"
        )
        problems.append(f"data.packing: {why}; set data.packing=false (the default for these formats)")
    if data.streaming:
        problems.append(f"data.streaming: not supported for {what} data yet; set data.streaming=false")
    if data.train_on_inputs:
        scored = (
            "preference losses score the responses only"
            if pairs
            else "the policy loss scores the completions only"
        )
        problems.append(f"data.train_on_inputs: {scored}; set data.train_on_inputs=false")
    if formats & set(PROMPT_FORMATS) and len(formats) > 1:
        problems.append(
            f"data.mix: prompt data completes prompts while training and cannot be mixed with {', '.join(sorted(formats - set(PROMPT_FORMATS)))} data"
        )
    return problems


OBJECTIVE_RULES = [
    ("objective.fits_data", objective_fits_data),
    ("objective.pairs_unpacked", pairs_unpacked),
]
