"""The plan of a `ligertune compare`: which arms, with which overrides, checked before anything runs."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ligertune.catalog.kernels import KERNEL_NAMES, conflicts, kernel
from ligertune.config import KernelsSection, Recipe, load_recipe
from ligertune.distributed.env import launched_as
from ligertune.errors import RecipeError, UsageError

SCHEMA = "ligertune-compare/1"
BASELINE = "off"
DEFAULT_STEPS = 20
# Relative per-step loss tolerance by training.precision (see the module docstring).
RTOL = {"fp32": 1e-4, "bf16": 2e-2, "bf16-mixed": 2e-2}

ARM_SPEC = "arm.json"  # written into each arm directory; also marks the directory as ours
ARM_LOG = "arm.log"
# Arm statuses, most telling first: an OOM on one rank explains the errors of the others.
STATUSES = ("oom", "error", "nonfinite", "ok")

# Recipe keys the compare sets itself, and the option that sets them instead.
_CONTROLLED = {"kernels": "--kernels", "training.max_steps": "--steps", "output_dir": "--out"}


class CompareError(UsageError):
    """Bad options for `ligertune compare`; the message says what to change."""


@dataclass
class ArmSpec:
    name: str
    kernels: list[str]
    overrides: list[str]
    directory: Path
    ablation: bool = False  # one kernel alone (--ablate)

    def as_json(self, recipe: Path, steps: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "kernels": self.kernels,
            "recipe": str(recipe),
            "overrides": self.overrides,
            "steps": steps,
        }


@dataclass
class ComparePlan:
    recipe_path: Path
    overrides: list[str]
    recipe: Recipe  # the user's recipe with the user's overrides
    steps: int
    kernels: list[str]
    ablate: bool
    out: Path
    nproc: int
    rtol: float
    rtol_rule: str
    arms: list[ArmSpec] = field(default_factory=list)


def parse_kernels(text: str | None, recipe: Recipe) -> list[str]:
    """``--kernels``: a comma list of kernel names or ``all`` (the default selection of a
    recipe's ``kernels: all``). Left out: the kernels the recipe enables, or ``all`` when it
    enables none."""
    if text is None or not text.strip():
        return recipe.kernels.enabled() or KernelsSection.preset("all").enabled()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return KernelsSection.preset("all").enabled()
    problems = []
    for name in names:
        try:
            kernel(name)
        except KeyError as e:
            problems.append(e.args[0])
    if problems:
        raise CompareError(f"--kernels: {'; '.join(problems)}; or all")
    for target, both in conflicts(sorted(set(names), key=KERNEL_NAMES.index)):
        raise CompareError(f"--kernels: {' and '.join(both)} replace the same {target}; choose one")
    return sorted(set(names), key=KERNEL_NAMES.index)


def _check_user_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.partition("=")[0]
        for controlled, option in _CONTROLLED.items():
            if key == controlled or key.startswith(controlled + "."):
                raise CompareError(f"{item}: compare sets {controlled} for each arm; use {option} instead")


def processes_per_arm(requested: int | None) -> int:
    """``--nproc-per-node``, or the world size of a compare launched by torchrun."""
    launched = launched_as()
    world, local = launched.world_size, launched.local_world_size
    if world > 1:
        if world != local:
            raise CompareError(
                f"compare was launched as {world} processes over several nodes; arms run on one node: "
                "launch it once and pass --nproc-per-node G"
            )
        if requested is not None and requested != world:
            raise CompareError(
                f"--nproc-per-node {requested} disagrees with the {world} processes torchrun started; "
                "pass one or the other"
            )
        return world
    if requested is not None and requested < 1:
        raise CompareError(f"--nproc-per-node must be at least 1, got {requested}")
    return requested or 1


def arm_recipe_overrides(overrides: list[str], kernels: list[str], steps: int, directory: Path) -> list[str]:
    """The user's overrides plus what every arm sets: only `kernels` on, `steps` steps, its own
    output directory, and nothing that an arm does not need (eval, checkpoints, export)."""
    return [
        *overrides,
        "kernels=none",
        *(f"kernels.{k}=true" for k in kernels),
        f"training.max_steps={steps}",
        f"output_dir={json.dumps(str(directory))}",  # a JSON string is YAML, whatever the path holds
        "training.eval_every=null",
        "training.on_nonfinite=skip",
        "checkpoint.every_steps=null",
        "checkpoint.resume=none",
        "checkpoint.export_hf=false",
        "logging.progress=plain",
    ]


def make_plan(
    recipe_path: Path,
    overrides: list[str],
    *,
    steps: int = DEFAULT_STEPS,
    kernels: str | None = None,
    ablate: bool = False,
    out: Path | None = None,
    nproc_per_node: int | None = None,
    rtol: float | None = None,
    also: list[str] | tuple[str, ...] = (),
) -> ComparePlan:
    """Check every option and every arm's recipe before anything runs. Each item of `also`
    (``key=value``) adds an arm: the ``on`` arm plus that override, to show what one setting
    (``training.compile=true``, ``model.attn_implementation=sdpa``) changes on top of the kernels."""
    if steps < 1:
        raise CompareError(f"--steps must be at least 1, got {steps}")
    if rtol is not None and not (rtol > 0 and math.isfinite(rtol)):
        raise CompareError(f"--rtol must be a positive number, got {rtol}")
    _check_user_overrides([*overrides, *also])
    for item in also:
        if "=" not in item:
            raise CompareError(
                f"--also {item}: write one recipe override, key=value (e.g. training.compile=true)"
            )
    recipe = load_recipe(recipe_path, overrides)
    nproc = processes_per_arm(nproc_per_node)
    if nproc > 1 and not recipe.parallel.multi_process:
        raise CompareError(
            f"{nproc} processes per arm need a multi-process strategy: add parallel.strategy=ddp (or fsdp, deepspeed)"
        )
    selected = parse_kernels(kernels, recipe)
    precision = recipe.training.precision
    rule = f"training.precision {precision}: per-step relative loss difference ≤ {RTOL[precision]:g}"
    if rtol is not None:
        rule = f"--rtol: per-step relative loss difference ≤ {rtol:g}"
    out = (out or recipe.run_dir.with_name(recipe.run_dir.name + "-compare")).resolve()
    plan = ComparePlan(
        recipe_path=recipe_path.resolve(),
        overrides=list(overrides),
        recipe=recipe,
        steps=steps,
        kernels=selected,
        ablate=ablate,
        out=out,
        nproc=nproc,
        rtol=rtol if rtol is not None else RTOL[precision],
        rtol_rule=rule,
    )
    arms = {BASELINE: ([], []), "on": (selected, [])}
    if ablate and len(selected) > 1:
        arms |= {name: ([name], []) for name in selected}
    for item in also:
        key, _, value = item.partition("=")
        arms[re.sub(r"[^\w.=+-]", "_", f"on+{key.rsplit('.', 1)[-1]}={value}")] = (selected, [item])
    for name, (arm_selection, arm_extra) in arms.items():
        directory = out / name
        arm_overrides = arm_recipe_overrides([*overrides, *arm_extra], arm_selection, steps, directory)
        try:
            load_recipe(recipe_path, arm_overrides)
        except RecipeError as e:
            e.problems = [
                f"arm {name!r} (kernels: {', '.join(arm_selection) or 'none'}): {p}" for p in e.problems
            ]
            raise
        if directory.exists() and not (directory / ARM_SPEC).exists():
            raise CompareError(
                f"{directory} exists and was not written by ligertune compare; choose another --out"
            )
        plan.arms.append(ArmSpec(name, arm_selection, arm_overrides, directory, ablation=name in selected))
    return plan
