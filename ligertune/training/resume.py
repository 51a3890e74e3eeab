"""Resuming: which checkpoint, what it restores, which recipe changes it accepts, and what the log says.

A checkpoint restores the weights, the optimizer and the schedule (through the runtime, which
knows its format), every rank's RNG states, the step, the data position (epoch, next
micro-batch) and the count of skipped steps.

Resuming with a changed recipe (`recipe_changes`)
    The checkpoint holds the recipe it was saved with (``recipe.yaml``). Before any state is
    loaded, every key whose value differs from the current recipe's is looked up in
    `RESUME_RULES` (the most specific entry wins: ``training.lr`` over ``training`` over the
    default) and is either applied, with one log line per key
    (``resume: training.lr 2e-05 → 1e-05 (applied)``), or refused: `RecipeError`, one line
    per key naming why, before any training step.

    applied   the schedule and optimizer: ``training.lr``, ``lr_schedule``, ``warmup_steps``,
              ``min_lr_ratio``, ``max_steps``/``epochs`` (the schedule follows the new recipe
              at the resumed step), ``weight_decay``, ``adam_betas``, ``adam_eps`` (set on the
              param groups after the optimizer state is loaded), ``max_grad_norm``; the loop:
              ``gradient_accumulation_steps`` (the micro-batch order does not depend on it),
              ``on_nonfinite`` and its skip limits, ``eval_every``, ``eval_max_batches``,
              ``activation_checkpointing``, ``compile``, ``device``; ``kernels.*``,
              ``plugins`` and ``model.attn_implementation`` (the same functions computed
              another way: numerically equivalent, logged); ``logging.*``, ``checkpoint.*``, ``eval.*``,
              ``name``, ``description``, ``output_dir``; ``parallel.fsdp.reshard_after_forward``
              and ``cpu_offload``.
    refused   the model (every other ``model.*`` key: architecture, ``config_overrides``,
              weights source), ``tokenizer.*``, ``data.*`` and ``seed`` (the saved position
              would name other batches), ``training.precision`` and
              ``parallel.fsdp.mixed_precision``, ``parallel.deepspeed.*`` (a ZeRO checkpoint
              loads into the configuration that saved it), and any key this table does not know.
    depends   ``training.micro_batch_size`` and the world size may change only together, with
              micro_batch_size × world size unchanged: micro-batch i of every rank then covers
              the same rows of the epoch's order. The weights and optimizer state reshard for
              the "full" format (every rank reads the whole files) and FSDP's "dcp" format
              (torch.distributed.checkpoint reshards on load), not for DeepSpeed ZeRO (one
              partition per rank). ``parallel.strategy`` may change between strategies that
              read the same checkpoint format (none and ddp).

A state dict that still does not fit (a plugin that adds parameters, a hand-edited
``recipe.yaml``) is refused with the first mismatch, not a traceback.

Changed data (`check_data`)
    The recipe can be unchanged while its data file is not (rows appended between a stop and a
    resume): the same position would then name other rows, with a new shuffle and a new
    validation hold-out, so rows would repeat and validation rows leak into training. Each
    checkpoint records a digest of the tokenised samples it was trained on
    (``ligertune.data.pipeline.data_fingerprint``); a resume whose data digests otherwise is
    refused (`RecipeError`, exit status 2), unless ``checkpoint.data_changed: restart_epoch``
    says to keep the weights, optimizer and schedule and start the checkpoint's epoch over, from
    its first micro-batch, on the new data (logged as a warning). A checkpoint saved before
    digests existed cannot be checked, and the log says so; a streamed run has no digest.

A checkpoint without a manifest that also lacks some rank's RNG file resumes with that rank's
random state as it is, and the log says so (the manifest of newer checkpoints makes a missing
file a damaged checkpoint instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ligertune.catalog.objectives import OBJECTIVES
from ligertune.catalog.strategies import STRATEGIES
from ligertune.catalog.strategies.base import PRECISION_SAVED
from ligertune.config import Recipe
from ligertune.config.loading import load_yaml
from ligertune.distributed import Runtime
from ligertune.errors import RecipeError
from ligertune.run.checkpoint import CheckpointManager, load_checkpoint, missing_rng_files, restore_rng_state
from ligertune.run.manifest import DamagedCheckpoint, read_state, verify_checkpoint
from ligertune.training.optim import apply_hyperparameters
from ligertune.training.state import TrainState


def data_order(recipe: Recipe, world_size: int, samples: dict[str, Any] | None = None) -> dict[str, Any]:
    """The inputs of the data order, as saved with every checkpoint; `samples` is the data's
    fingerprint (module docstring: changed data)."""
    return {
        "seed": recipe.seed,
        "micro_batch_size": recipe.training.micro_batch_size,
        "world_size": world_size,
        "data": recipe.data.model_dump(mode="json"),
        "samples": samples,
    }


def _describe_samples(fingerprint: dict[str, Any]) -> str:
    counts = [f"{fingerprint[split]:,} {split}" for split in ("train", "validation") if split in fingerprint]
    return " and ".join(counts) + " samples"


def check_data(saved, current: dict[str, Any] | None, recipe: Recipe) -> tuple[bool, list[str]]:
    """Whether the resume restarts the saved epoch on changed data, and its log lines. Raises
    RecipeError for changed data unless ``checkpoint.data_changed`` is restart_epoch."""
    order = saved.state.get("order") or {}
    if current is None:
        return False, []
    if "samples" not in order:
        return False, [
            f"warning: {saved.path} records no digest of its data (saved by an older version): the data is not checked"
        ]
    before = order["samples"]
    if before == current:
        return False, []
    then, now = _describe_samples(before or {}), _describe_samples(current)
    change = f"{then} then, {now} now" if then != now else f"{now}, with other content"
    if recipe.checkpoint.data_changed == "restart_epoch":
        return True, [
            f"warning: the data is not what {saved.path} was trained on ({change}); checkpoint.data_changed="
            f"restart_epoch: epoch {saved.state['epoch'] + 1} starts over on the new data at step {saved.step}"
        ]
    raise RecipeError(
        [
            f"data: the data is not what {saved.path} was trained on ({change}): resuming at its position "
            "would repeat rows and move rows between training and validation. Restore the data, start over "
            "(checkpoint.resume=none or another output_dir), or set checkpoint.data_changed=restart_epoch to keep "
            "the weights and start the epoch over on the new data"
        ],
        f"resuming {saved.path}",
    )


def resume_path(recipe: Recipe, manager: CheckpointManager) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, verified (`verify_checkpoint`), and a warning for each
    damaged one passed over, for the run log.

    ``auto`` tries the complete checkpoints newest first and takes the first intact one; when
    every one is damaged it refuses rather than start over and prune them. An explicit path
    must be intact: the user named that one. Either refusal is a RecipeError naming
    checkpoint.resume, the checkpoint and the damaged file."""
    choice = recipe.checkpoint.resume
    if choice == "none":
        return None, []
    if choice != "auto":
        path = recipe.resolve(choice)
        try:
            verify_checkpoint(path)
        except ValueError as e:
            raise RecipeError([f"checkpoint.resume: {e}"]) from None
        return path, []
    candidate, damaged = manager.newest_intact()
    if candidate is not None:
        notes = [f"warning: {problem}; passed over it, resuming from {candidate}" for problem in damaged]
        return candidate, notes + same_run_notes(recipe, candidate)
    if damaged:
        raise RecipeError(
            [
                f"checkpoint.resume: auto found no intact checkpoint in {manager.root}:",
                *(f"{problem}; passed over it" for problem in damaged),
                "restore one (from a copy) or start over with checkpoint.resume=none",
            ]
        )
    return None, []


def same_run_notes(recipe: Recipe, checkpoint: Path) -> list[str]:
    """Whether an automatic resume may continue the run `checkpoint` belongs to from this recipe.

    A run directory belongs to the recipe file that started it (its checkpoints record the
    file). Two recipe files that name the same run (a copy that kept ``name``) would otherwise
    share it: the second one's ``train`` would resume the first one's finished run and write
    over its ``final/``. So ``auto`` refuses to continue a *finished* run (its last step saved)
    from another recipe file. An unfinished run continues, with a line in the log: a job
    scheduler that resubmits a preempted run from a fresh copy of its recipe must still resume
    it. An explicit ``checkpoint.resume: <path>`` is consent and skips the check; a recipe not
    read from a file (library use) and checkpoints from before the record are not checked."""
    state = read_state(checkpoint)
    started_by, total = state.get("recipe_file"), state.get("total_steps")
    current = recipe._source_file
    if started_by is None or current is None or Path(started_by) == current:
        return []
    if isinstance(total, int) and state["step"] >= total:
        raise RecipeError(
            [
                f"checkpoint.resume: auto would continue the finished run in {recipe.run_dir} (step "
                f"{state['step']} of {total}, started by {started_by}) from another recipe file, {current}, "
                f"and write over its final/; give this recipe a run of its own (name: {current.stem}, or "
                f"output_dir), or continue that run on purpose with checkpoint.resume={checkpoint}"
            ]
        )
    return [f"resume: {recipe.run_dir} was started by {started_by}; continuing it from {current}"]


# -- Resuming with a changed recipe ------------------------------------------------------------

WORLD_SIZE = "world size"  # not a recipe key: the number of processes, compared like one


@dataclass(frozen=True)
class _Compared:
    """What a rule that depends on more than one key sees: both recipes (flattened, with the
    world size) and both checkpoint formats."""

    saved: dict[str, Any]
    current: dict[str, Any]
    saved_format: str
    current_format: str


def _rows_per_position(c: _Compared) -> str | None:
    rows = [d.get("training.micro_batch_size", 0) * d.get(WORLD_SIZE, 1) for d in (c.saved, c.current)]
    if rows[0] != rows[1]:
        return (
            f"micro_batch_size × world size goes from {rows[0]} to {rows[1]} rows, so the saved data position "
            "would name other batches (keep the product: e.g. twice the micro-batch on half the processes)"
        )
    one_file_per_rank = any(
        s.resume_same_world_size for s in STRATEGIES if s.checkpoint_format == c.saved_format
    )
    if c.saved.get(WORLD_SIZE) != c.current.get(WORLD_SIZE) and one_file_per_rank:
        return f"a {c.saved_format!r} checkpoint holds one partition per rank; launch as many processes as saved it"
    return None


def _same_format(c: _Compared) -> str | None:
    if c.saved_format != c.current_format:
        return (
            f"the checkpoint is in the {c.saved_format!r} format, which this strategy does not read "
            f"(it reads {c.current_format!r})"
        )
    return None


_APPLY = None
_ORDER = "the data order depends on it: the saved position would name other batches"
# Recipe key (or section) → None: applied; a string: refused, and why; a function of both
# recipes: None or why. The most specific entry wins; "" is every key the table does not name.
RESUME_RULES: dict[str, str | Callable[[_Compared], str | None] | None] = {
    "": "not known to be safe to change on resume",
    "name": _APPLY,
    "description": _APPLY,
    "output_dir": _APPLY,
    "seed": _ORDER,
    "model": "the checkpoint holds the weights of the saved model; another architecture or source cannot take them",
    "model.attn_implementation": _APPLY,
    "plugins": _APPLY,
    "tokenizer": "other tokens make other rows: the saved position would name other batches",
    "data": _ORDER,
    **{
        f"training.{key}": _APPLY
        for key in (
            "epochs",
            "max_steps",
            "gradient_accumulation_steps",
            "lr",
            "lr_schedule",
            "warmup_steps",
            "min_lr_ratio",
            "weight_decay",
            "adam_betas",
            "adam_eps",
            "max_grad_norm",
            "activation_checkpointing",
            "tiled_mlp",
            "compile",
            "eval_every",
            "eval_max_batches",
            "on_nonfinite",
            "max_skipped_steps",
            "max_consecutive_skipped_steps",
            "device",
        )
    },
    "training.micro_batch_size": _rows_per_position,
    WORLD_SIZE: _rows_per_position,
    "training.precision": PRECISION_SAVED,
    "kernels": _APPLY,
    "parallel.strategy": _same_format,
    # How the model is built before the checkpoint is loaded over it: the plain build's weights
    # either way (docs/distributed.md), so a LoRA run's frozen base is the same too. A LoRA
    # recipe saved before LoRA could shard at init has ``false`` written out (auto was resolved
    # in place then) and resumes under ``auto``. Not the same: a random init too large for half
    # of rank 0's GPU, made on its CPU under sharded init (the run log says so at the start).
    "parallel.sharded_init": _APPLY,
    # each strategy's own options: what it declares (`ligertune.catalog.strategies`)
    **{f"parallel.{key}": rule for strategy in STRATEGIES for key, rule in strategy.resume_rules.items()},
    "logging": _APPLY,
    "checkpoint": _APPLY,
    "eval": _APPLY,  # what scores the model at the end, not how it trains
}


def _rule_for(key: str):
    parts = key.split(".")
    for n in range(len(parts), -1, -1):
        prefix = ".".join(parts[:n])
        if prefix in RESUME_RULES:
            return RESUME_RULES[prefix]
    raise AssertionError("RESUME_RULES has a default entry")


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = list(value) if isinstance(value, tuple) else value
    return flat


def _saved_recipe(recipe_yaml: str) -> dict[str, Any]:
    """The saved recipe as the current schema reads it, so keys added since it was saved
    compare at their defaults; as written when the current schema no longer reads it."""
    try:  # with the recipe loader's bounds: a copied checkpoint's recipe.yaml may be anything
        raw = load_yaml(recipe_yaml) or {}
    except yaml.YAMLError as e:
        raise RecipeError([f"checkpoint.resume: the checkpoint's recipe.yaml cannot be read: {e}"]) from None
    if not isinstance(raw, dict):
        raise RecipeError(["checkpoint.resume: the checkpoint's recipe.yaml is not a mapping of sections"])
    try:
        return Recipe.model_validate(raw).model_dump(mode="json")
    except ValidationError:
        return raw


_ABSENT = object()


def _show(value: Any) -> str:
    """A value as the log and the errors write it: 2e-05, 'cosine', [0.9, 0.95], null."""
    if value is _ABSENT:
        return "(absent)"
    return "null" if value is None else repr(value)


def _belongs_to_another_choice(key: str, saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether `key` is an option of one objective or strategy that only one side chose (the
    other side has no such key): the change of the choice itself (``parallel.strategy``) is the
    one its rule decides, not each of its options."""
    for choice in (OBJECTIVES, STRATEGIES):
        chooser = f"{choice.section}.{choice.key}"
        if key.startswith(choice.section + ".") and saved.get(chooser) != current.get(chooser):
            return key not in saved or key not in current
    return False


def recipe_changes(
    recipe_yaml: str,
    recipe: Recipe,
    *,
    saved_world_size: int,
    world_size: int,
    saved_format: str,
    current_format: str,
) -> tuple[list[str], list[str]]:
    """Compare the recipe a checkpoint was saved with (`recipe_yaml`) with the current one, key
    by key, by `RESUME_RULES`. Returns (log lines of the applied changes, refusal lines)."""
    saved = _flatten(_saved_recipe(recipe_yaml)) | {WORLD_SIZE: saved_world_size}
    current = _flatten(recipe.model_dump(mode="json")) | {WORLD_SIZE: world_size}
    both = _Compared(saved, current, saved_format, current_format)
    applied, refused = [], []
    for key in [*current, *(k for k in saved if k not in current)]:
        before, after = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if before == after or _belongs_to_another_choice(key, saved, current):
            continue
        rule = _rule_for(key)
        reason = rule(both) if callable(rule) else rule
        change = f"{key} {_show(before)} → {_show(after)}"
        if reason is None:
            applied.append(f"resume: {change} (applied)")
        else:
            refused.append(
                f"{key}: {_show(before)} → {_show(after)} since the checkpoint was saved; a resume cannot change "
                f"it: {reason}. Set it back, or start over with checkpoint.resume=none or another output_dir"
            )
    return applied, refused


@dataclass
class Resumed:
    state: TrainState
    message: str


# How torch and torch.distributed.checkpoint word a state dict that does not fit the model or
# optimizer it is loaded into (a damaged file reads otherwise and is reported as such).
_MISMATCH = (
    "size mismatch",
    "missing key",
    "unexpected key",
    "doesn't match the size of optimizer's group",
    "different number of parameter groups",
)


def _load_state(saved, runtime: Runtime, model, optimizer) -> None:
    """`runtime.load_state`, with a state dict that does not fit this run's model refused in
    one line naming the first mismatch (the recipe comparison catches the usual causes first)."""
    try:
        runtime.load_state(saved, model, optimizer)
    except RecipeError:
        raise
    except (RuntimeError, ValueError, KeyError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        first = next((line for line in lines if any(m in line.lower() for m in _MISMATCH)), None)
        if first is None:
            raise
        raise RecipeError(
            [
                f"checkpoint.resume: {saved.path} does not fit this run's model or optimizer ({first}); resume "
                "with the model.* and plugins the checkpoint was saved with, or start over with checkpoint.resume=none"
            ]
        ) from e


def resume(
    path: Path,
    runtime: Runtime,
    model,
    optimizer,
    scheduler,
    recipe: Recipe,
    total_steps: int,
    data_fingerprint: dict[str, Any] | None = None,
) -> Resumed:
    """Load checkpoint `path` into the wrapped model, optimizer and schedule (every rank), after
    checking that `recipe` changes nothing the checkpoint cannot honour and that the data is the
    one it was trained on (`check_data`); the optimizer's hyper-parameters and the lr are then
    the current recipe's (`recipe_changes`)."""
    try:
        saved = load_checkpoint(path, runtime.rank)
    except ValueError as e:
        raise RecipeError([f"checkpoint.resume: {e}"]) from None
    applied, refused = recipe_changes(
        saved.recipe_yaml,
        recipe,
        saved_world_size=saved.world_size,
        world_size=runtime.world_size,
        saved_format=saved.format,
        current_format=runtime.checkpoint_format,
    )
    if refused:
        raise RecipeError(refused, f"resuming {saved.path}")
    # After the recipe's keys: a changed key (seed, data.*) is named as such, not as other data.
    restart_epoch, data_lines = check_data(saved, data_fingerprint, recipe)
    try:
        _load_state(saved, runtime, model, optimizer)
    except DamagedCheckpoint as e:  # a file torch cannot read (a checkpoint without a manifest)
        raise RecipeError([f"checkpoint.resume: {e}"]) from None
    scheduler.load_state_dict(saved.scheduler)
    apply_hyperparameters(optimizer, scheduler, recipe.training)
    if saved.rng is not None:  # None: this rank did not exist in the saving job, or its file is missing
        restore_rng_state(saved.rng)
    state = TrainState.from_checkpoint(saved.step, saved.state, saved.path)
    if restart_epoch:
        state.batch_index = 0
    lines = [
        *data_lines,
        f"resumed from {saved.path} (step {state.step}, epoch {state.epoch}, micro-batch {state.batch_index})",
        *applied,
    ]
    missing = missing_rng_files(saved.path, min(saved.world_size, runtime.world_size))
    if missing:
        lines.append(
            f"warning: {saved.path} has no {', '.join(missing)}: the random state (dropout, sampling) of "
            "those ranks is not restored, so the run will not repeat an uninterrupted one exactly"
        )
    if state.step >= total_steps:
        lines.append(
            f"the run is already complete ({state.step} of {total_steps} steps); to train again, set a new "
            "output_dir or checkpoint.resume=none"
        )
    return Resumed(state, "\n".join(lines))
