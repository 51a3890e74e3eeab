"""Benchmarks through lm-evaluation-harness (``lm-eval``, the ``eval`` extra): ``ligertune eval`` and
a recipe's ``eval.tasks``, which run at the end of training with the scores in metrics.jsonl and
the summary.

A task is a name lm-eval knows (``hellaswag``, ``arc_easy``: their datasets come from the hub) or a
local task file (YAML in lm-eval's format), which works offline: its ``dataset_kwargs.data_files``
may be relative to the file, and ``ligertune://eval/tiny_qa.yaml`` is a ten-question task shipped
for smoke runs and the tests. The model is evaluated in memory (lm-eval's ``HFLM`` wraps it, with its
tokenizer), so a run scores the model it just trained, LoRA adapters included.

lm-eval's progress bars and its notices about being handed a model object rather than a name
are kept off the console unless ``-v`` (a short table is the answer); its warnings about a task or
a model still show. Scores are flattened to snake_case keys, ``eval_<task>_<metric>``
(``eval_tiny_qa_acc``); lm-eval's filter suffix ``,none`` is dropped, other filters are kept
(``eval_gsm8k_exact_match_strict_match``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ligertune.errors import TrainingError, UsageError
from ligertune.paths import resolve_path
from ligertune.run.loggers import console_handler

TASK_FILE_SUFFIXES = (".yaml", ".yml")


class HarnessError(UsageError):
    """An evaluation that cannot run, in one line (a missing package, an unknown task)."""


def is_task_file(task: str) -> bool:
    return task.lower().endswith(TASK_FILE_SUFFIXES)


def task_specs(tasks: list[str], base: Path | None = None) -> tuple[list[str | dict[str, Any]], list[str]]:
    """(lm-eval task specs, folders for lm-eval to index). Names go as given. A task file is read
    as its config dict, with relative ``data_files`` resolved against the file's folder (lm-eval
    would read them from the working directory); one that uses lm-eval's own YAML extensions
    (``!function``, ``include``) is handed to lm-eval by its task name, its folder indexed.
    `base`: where relative task file paths resolve after the working directory."""
    import yaml

    specs: list[str | dict[str, Any]] = []
    folders: list[str] = []
    for task in tasks:
        if not is_task_file(task):
            specs.append(task)
            continue
        path = resolve_path(task, base)
        if not path.is_file():
            raise HarnessError(f"{task}: no such task file")
        text = path.read_text(encoding="utf-8")
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError:
            config = None  # lm-eval's tags: lm-eval reads it
        if not isinstance(config, dict) or "include" in config:
            name = re.search(r"^task:\s*(\S+)", text, re.MULTILINE)
            if name is None:
                raise HarnessError(f"{path}: an lm-eval task file names its task (task: <name>)")
            specs.append(name.group(1))
            folders.append(str(path.parent))
            continue
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            config["dataset_kwargs"]["data_files"] = {k: _beside(path, v) for k, v in files.items()}
        elif isinstance(files, (str, list)):
            config["dataset_kwargs"]["data_files"] = _beside(path, files)
        specs.append(config)
    return specs, folders


def _beside(task_file: Path, files: str | list[str]) -> str | list[str]:
    if isinstance(files, list):
        return [str(_beside(task_file, f)) for f in files]
    path = Path(files).expanduser()
    return str(path if path.is_absolute() else task_file.parent / path)


def run_tasks(
    model: nn.Module,
    tokenizer,
    tasks: list[str],
    *,
    base: Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    verbose: bool = False,
) -> dict[str, float]:
    """Score `model` on `tasks`; returns ``{eval_<task>_<metric>: value}`` (see the docstring)."""
    try:
        from lm_eval.evaluator import evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise HarnessError(
            "lm-eval is not installed; install it with: pip install 'ligertune[eval]'"
        ) from None
    specs, folders = task_specs(tasks, base)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    quiet = contextlib.nullcontext() if verbose else _quiet_harness()
    try:
        with quiet:
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(device))
            try:
                loaded = TaskManager(include_path=folders or None).load(specs)
            except Exception as e:  # an unknown name, a task whose dataset cannot be loaded
                raise HarnessError(f"cannot load the tasks {', '.join(tasks)}: {_first_line(e)}") from None
            for task in loaded["tasks"].values():
                if num_fewshot is not None:
                    task.set_config(key="num_fewshot", value=num_fewshot)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=1234)
            with torch.no_grad():
                results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)
    finally:
        model.train(was_training)
    return scores(results["results"])


def scores(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's per-task results as flat snake_case metric keys (numbers only: no stderr "N/A")."""
    flat = {}
    for task, metrics in results.items():
        for name, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or "," not in name:
                continue
            metric, _, kind = name.partition(",")
            if metric.endswith("_stderr"):
                continue
            key = f"eval_{task}_{metric}" + ("" if kind == "none" else f"_{kind}")
            flat[re.sub(r"[^a-z0-9_]+", "_", key.lower())] = float(value)
    return flat


@contextlib.contextmanager
def _quiet_harness():
    """lm-eval's progress bars (tqdm on stderr) and info notices off; its warnings stay."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    hf = logging.getLogger("lm_eval.models.huggingface")
    hf_level = hf.level
    hf.setLevel(logging.ERROR)  # "pretrained model kwarg is not of type str": we pass a model on purpose
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
        hf.setLevel(hf_level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines() or [type(error).__name__])[0][:300]


def score_run(recipe, model: nn.Module, tokenizer, saved: Path | None) -> dict[str, float]:
    """``eval.tasks`` on the model a run just trained (this process's whole model: strategy none
    or ddp, the ``eval.tasks_runnable`` rule), task files resolved against the recipe's folder.
    lm-eval's progress shows with ``-v``. A task that cannot run is a `TrainingError` that says
    where the trained model is (`saved`): the run's work is not lost to a bad task name."""
    evaluation = recipe.eval
    handler = console_handler()
    try:
        return run_tasks(
            model,
            tokenizer,
            evaluation.tasks,
            base=recipe._base_dir,
            limit=evaluation.limit,
            num_fewshot=evaluation.num_fewshot,
            batch_size=evaluation.batch_size,
            verbose=handler is not None and handler.level <= logging.DEBUG,
        )
    except HarnessError as e:
        raise TrainingError(f"eval.tasks: {e}; the trained model is saved in {saved}") from None
