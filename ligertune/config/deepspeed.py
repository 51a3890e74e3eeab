"""The DeepSpeed config a recipe implies, and the rule that a user's DeepSpeed JSON agrees with it.

The recipe stays the one source of the batch shape, clipping, precision and ZeRO stage:
``parallel.deepspeed.config`` (a JSON file) is merged over the generated config key by key and
may repeat those keys with the same value but not change them, nor name an optimizer or
scheduler (the recipe's AdamW and schedule are handed to DeepSpeed). Everything else in the
file (bucket sizes, overlap_comm, offload details, ...) wins. Pure dictionaries: nothing here
imports DeepSpeed or torch.
"""

from __future__ import annotations

import json
from typing import Any

from ligertune.config.schema import Recipe
from ligertune.errors import RecipeError

# Keys of the DeepSpeed config that the recipe decides, with the recipe key to change instead.
_RECIPE_OWNED = {
    ("train_micro_batch_size_per_gpu",): "training.micro_batch_size",
    ("gradient_accumulation_steps",): "training.gradient_accumulation_steps",
    ("gradient_clipping",): "training.max_grad_norm",
    ("bf16", "enabled"): "training.precision",
    ("fp16", "enabled"): "training.precision",
    ("zero_optimization", "stage"): "parallel.deepspeed.zero_stage",
}

_MISSING = object()


def generated_config(recipe: Recipe) -> dict[str, Any]:
    """What the recipe alone says, before the user's file is merged in."""
    training, options = recipe.training, recipe.parallel.deepspeed
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if options.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "gradient_clipping": training.max_grad_norm or 0.0,
        "bf16": {"enabled": training.precision == "bf16-mixed"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        # torch's AdamW is not on DeepSpeed's list of ZeRO-tested optimizers, and with an
        # offloaded optimizer DeepSpeed would insist on its own (JIT-compiled) CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,  # our own metrics report the steps
        "wall_clock_breakdown": False,
    }


def _user_config(recipe: Recipe) -> tuple[dict[str, Any] | None, list[str]]:
    """The parsed ``parallel.deepspeed.config`` file (None when unset), or why it cannot be read."""
    if recipe.parallel.deepspeed.config is None:
        return None, []
    path = recipe.resolve(recipe.parallel.deepspeed.config)
    try:
        user = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [f"parallel.deepspeed.config: cannot read {path} as JSON: {e}"]
    if not isinstance(user, dict):
        return None, [f"parallel.deepspeed.config: {path} must hold a JSON object, got {type(user).__name__}"]
    return user, []


def deepspeed_config_problems(recipe: Recipe) -> list[str]:
    """Every way the user's DeepSpeed file contradicts the recipe, one line each."""
    user, problems = _user_config(recipe)
    if user is None:
        return problems
    path = recipe.resolve(recipe.parallel.deepspeed.config)
    problems = [
        f"parallel.deepspeed.config: {path} sets {key!r}; ligertune hands DeepSpeed the recipe's AdamW and LR "
        "schedule (training.*), remove it from the file"
        for key in ("optimizer", "scheduler")
        if key in user
    ]
    if "train_batch_size" in user:
        problems.append(
            f"parallel.deepspeed.config: {path} sets 'train_batch_size'; it follows from training.micro_batch_size × "
            "training.gradient_accumulation_steps × the number of processes: remove it from the file"
        )
    generated = generated_config(recipe)
    for keys, recipe_key in _RECIPE_OWNED.items():
        ours, theirs = _lookup(generated, keys), _lookup(user, keys)
        if theirs is not _MISSING and theirs != ours:
            problems.append(
                f"parallel.deepspeed.config: {path} sets {'.'.join(keys)}={theirs!r} but the recipe gives {ours!r}; "
                f"change {recipe_key} in the recipe instead and remove it from the file"
            )
    return problems


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
    """The DeepSpeed config of a recipe, with ``parallel.deepspeed.config`` merged over it.
    Raises RecipeError when the file contradicts the recipe (see the module docstring)."""
    problems = deepspeed_config_problems(recipe)
    if problems:
        raise RecipeError(problems)
    user, _ = _user_config(recipe)
    generated = generated_config(recipe)
    return generated if user is None else _merge(generated, user)


def _lookup(mapping: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return _MISSING
        mapping = mapping[key]
    return mapping


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
