"""The rules of the ``objective`` section (registered in `ligertune.config.rules`, which lists
them with the others): which data each objective trains on and what its reference or teacher
needs. Every objective runs under every parallel strategy (a frozen reference or teacher is
placed like the policy, `ligertune.objectives.reference.build_frozen`), so none is refused here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.config.schema.data import PAIR_FORMATS

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

PAIRED = ("dpo", "orpo", "simpo")
DATA_OF = {"dpo": "preference", "orpo": "preference", "simpo": "preference", "kto": "kto"}


def _formats(recipe: Recipe) -> set[str]:
    data = recipe.data
    if data.mix:
        return {s.format or data.format for s in data.mix}
    return {data.format}


def objective_fits_data(recipe: Recipe) -> list[str]:
    """dpo/orpo/simpo train on data.format preference, kto on kto, sft/distill on the others."""
    name, formats = recipe.objective.name, _formats(recipe)
    wanted = DATA_OF.get(name)
    if wanted is not None and formats != {wanted}:
        return [
            f"objective.name: {name} trains on data.format {wanted} (columns "
            f"{'prompt, chosen, rejected' if wanted == 'preference' else 'prompt, completion, label'}); "
            f"the data is {', '.join(sorted(formats))}"
        ]
    if wanted is None and formats & set(PAIR_FORMATS):
        paired = sorted(formats & set(PAIR_FORMATS))
        return [
            f"data.format: {', '.join(paired)} data needs a preference objective (objective.name: "
            f"{'dpo, orpo or simpo' if 'preference' in paired else 'kto'}), not {name}"
        ]
    return []


def pairs_unpacked(recipe: Recipe) -> list[str]:
    """Preference and kto data are laid out a pair per row: no packing, streaming or train_on_inputs."""
    data = recipe.data
    if not _formats(recipe) & set(PAIR_FORMATS):
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


def reference_fits(recipe: Recipe) -> list[str]:
    """objective.reference and reference_model apply to dpo and kto; orpo and simpo are reference-free."""
    objective = recipe.objective
    problems = []
    if objective.name not in ("dpo", "kto") and objective.reference not in (None, "none"):
        problems.append(
            f"objective.reference: {objective.name} uses no reference model (only dpo and kto do); "
            "remove objective.reference"
        )
    if objective.reference_model is not None and (
        objective.name not in ("dpo", "kto") or objective.reference_kind != "frozen"
    ):
        problems.append("objective.reference_model: only for dpo/kto with objective.reference frozen")
    if objective.reference_model is not None and recipe.lora is not None:
        problems.append(
            "objective.reference_model: with lora the reference is the policy with its adapters off (no second "
            "copy); remove objective.reference_model"
        )
    return problems


def teacher_fits(recipe: Recipe) -> list[str]:
    """objective.name distill needs objective.teacher, and only distill takes one."""
    objective = recipe.objective
    if objective.name == "distill" and objective.teacher is None:
        return ["objective.teacher: distill needs a teacher model section (name_or_path or config)"]
    if objective.name != "distill" and objective.teacher is not None:
        return [f"objective.teacher: only objective.name distill uses a teacher, not {objective.name}"]
    teacher = objective.teacher
    if teacher is not None and (teacher.name_or_path is None) == (teacher.config is None):
        return ["objective.teacher: set exactly one of name_or_path (weights) or config (random init)"]
    model = objective.reference_model
    if model is not None and (model.name_or_path is None) == (model.config is None):
        return [
            "objective.reference_model: set exactly one of name_or_path (weights) or config (random init)"
        ]
    return []


OBJECTIVE_RULES = [
    ("objective.fits_data", objective_fits_data),
    ("objective.pairs_unpacked", pairs_unpacked),
    ("objective.reference", reference_fits),
    ("objective.teacher", teacher_fits),
]
