"""The rules of the ``eval`` section (lm-evaluation-harness at the end of a run). Registered in
`ligertune.config.rules`, which lists them with the others."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ligertune.paths import resolve_path

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe


def _tasks_runnable(recipe: Recipe) -> list[str]:
    """eval.tasks needs lm-eval installed, local task files that exist, and a run whose model one process holds (not fsdp or deepspeed)."""
    tasks = recipe.eval.tasks
    if not tasks:
        return []
    problems = []
    if importlib.util.find_spec("lm_eval") is None:
        problems.append(
            "eval.tasks: needs lm-eval, which is not installed; install it with: pip install 'ligertune[eval]'"
        )
    for task in tasks:
        if task.lower().endswith((".yaml", ".yml")) and not resolve_path(task, recipe._base_dir).is_file():
            problems.append(f"eval.tasks: {task}: no such task file")
    parallel = recipe.parallel
    if not parallel.supports("eval.tasks"):
        problems.append(
            f"eval.tasks: not with parallel.strategy {parallel.strategy} ({parallel.unsupported['eval.tasks']}); "
            f"score the export after training with ligertune eval {recipe.run_dir} --tasks {','.join(tasks)} "
            "(and remove eval.tasks)"
        )
    return problems


# (rule name, check), in the order `ligertune.config.rules` registers them.
EVAL_RULES = [("eval.tasks_runnable", _tasks_runnable)]
