"""The reward functions of ``objective.rewards`` and the advantages computed from them (GRPO).

A reward is a function of one completion: ``fn(prompt=..., completion=..., answer=...,
metadata=...)`` → a number, where ``prompt`` is the prompt's text as the model saw it,
``completion`` the generated text (up to and including the stop string or EOS; special tokens
left out), and ``answer`` and ``metadata`` the data's columns (`ligertune.data.prompts`). A
user's function is named ``module:function``: the module is imported with the recipe's folder
first on the path, so a ``rewards.py`` next to the recipe works, then the working directory and
installed packages. A completion's reward is Σ_k w_k · r_k over the recipe's rewards.

Built-ins:

- ``exact_match``: 1 when the completion's final answer equals the reference answer, else 0. The
  final answer is the last ``\\boxed{...}``, else what follows the last ``####`` (GSM8K's
  marker), else what follows the last "answer is" / "answer:", else the last number in the
  text. Both sides are normalised (`normalise_answer`: spaces, ``$``, thousands separators, a
  trailing period and ``\\text{}`` dropped) and compared as numbers when both read as one
  (``0.5``, ``1/2`` and ``\\frac{1}{2}`` are equal), else as strings.
- ``regex``: 1 when ``pattern`` matches the completion (``match: search`` anywhere; ``full``:
  the whole completion but surrounding whitespace), else 0.
- ``length_penalty``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 for a
  completion of at most L_max − L_cache tokens, falling linearly to −1 at L_max, with L_max =
  ``objective.max_new_tokens`` and L_cache = ``buffer`` (default L_max / 4); a completion cut at
  L_max without stopping gets −1.

A reward that raises, or returns anything but a finite number (a bool counts as 0 or 1), stops
the run with `RewardError`: one line naming the reward (its key and function) and the sample (the
prompt's file and row, the completion's index in its group and its start).

Where rewards run: on every rank, for that rank's own completions. A rank's prompts and their G
completions stay on it (a micro-batch holds whole groups), so each group's advantages need no
communication, the scoring runs in parallel on all ranks, and a user's function needs neither to
be picklable nor to be broadcast. The cost: a reward that holds a model (a judge) is loaded once
per rank. Only ``scale_rewards: batch`` and the logged metrics sum over ranks (one all-reduce).
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ligertune.errors import RecipeError

if TYPE_CHECKING:
    from ligertune.catalog.objectives.grpo import RewardSpec
    from ligertune.data.prompts import Prompt

RewardFn = Callable[..., Any]
# TRL's and most papers' ε in A = (r − mean) / (std + ε): a group whose rewards all agree gets A = 0.
STD_EPSILON = 1e-4


class RewardError(RecipeError):
    """A reward function raised or returned a non-number (module docstring): one line."""

    def __init__(self, problem: str):
        super().__init__([problem])


@dataclass(frozen=True)
class Reward:
    key: str  # objective.rewards[i]: what errors name
    label: str  # its name in the metrics
    weight: float
    fn: RewardFn
    name: str  # the function, as the recipe names it
    takes_length: bool = False  # length_penalty: called with the completion's token count too


# --------------------------------------------------------------------------------------------
# The math-answer normaliser and the built-ins
# --------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The completion's final answer (module docstring: boxed, ####, "answer is", last number)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0]
    found = list(_ANSWER_IS.finditer(text))
    if found:
        rest = text[found[-1].end() :].strip()
        if rest:
            return rest.split("\n")[0]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


_FRAC = re.compile(r"^\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def normalise_answer(answer: Any) -> str | Fraction:
    """A comparable form of an answer: a `Fraction` when it reads as a number, else the
    normalised string."""
    text = str(answer).strip()
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = text.replace("\\!", "").replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    frac = _FRAC.match(text)
    try:
        if frac:
            return Fraction(frac.group(1)) / Fraction(frac.group(2))
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text.lower()


def exact_match(*, completion: str, answer: Any, **_) -> float:
    if answer is None:
        raise ValueError("exact_match needs the data's answer column, and this prompt has none")
    found = final_answer(completion)
    return float(found is not None and normalise_answer(found) == normalise_answer(answer))


def _regex(pattern: str, full: bool) -> RewardFn:
    compiled = re.compile(pattern)

    def regex(*, completion: str, **_) -> float:
        found = compiled.fullmatch(completion.strip()) if full else compiled.search(completion)
        return float(found is not None)

    return regex


def length_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of a completion of `length` tokens (module docstring)."""
    free = max_length - buffer
    if length <= free:
        return 0.0
    if length < max_length:
        return (free - length) / buffer
    return -1.0


# --------------------------------------------------------------------------------------------
# Loading and scoring
# --------------------------------------------------------------------------------------------


def import_function(name: str, key: str, directory: Path | None) -> RewardFn:
    """``module:function``, imported with `directory` (the recipe's folder) first on the path;
    RecipeError naming `key` when it cannot be."""
    module_name, _, function_name = name.partition(":")
    added = directory is not None and str(directory) not in sys.path
    if added:
        sys.path.insert(0, str(directory))
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        where = f" (looked in {directory} first)" if directory is not None else ""
        raise RecipeError([f"{key}.fn: cannot load {name!r}: {type(e).__name__}: {e}{where}"]) from None
    finally:
        if added:
            sys.path.remove(str(directory))
    if not callable(function):
        raise RecipeError([f"{key}.fn: {name!r} is {type(function).__name__}, not a function"])
    return function


def load_rewards(specs: Sequence[RewardSpec], directory: Path | None, max_new_tokens: int) -> list[Reward]:
    """The recipe's rewards as functions of keyword arguments (module docstring)."""
    rewards = []
    for i, spec in enumerate(specs):
        key = f"objective.rewards[{i}]"
        if spec.fn is not None:
            fn = import_function(spec.fn, key, directory)
        elif spec.builtin == "exact_match":
            fn = exact_match
        elif spec.builtin == "regex":
            fn = _regex(spec.pattern, spec.match == "full")
        else:
            buffer = spec.buffer or max(1, max_new_tokens // 4)

            def fn(*, length: int, _buffer=buffer, **_) -> float:
                return length_penalty(length, max_new_tokens, _buffer)

        name = spec.fn or f"builtin {spec.builtin}"
        rewards.append(Reward(key, spec.label(), spec.weight, fn, name, spec.builtin == "length_penalty"))
    return rewards


def _number(value: Any) -> float | None:
    """A finite float from a reward's return value, or None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if isinstance(value, str) or not math.isfinite(number):
        return None
    return number


def _sample(prompt: Prompt, index: int, group: int, completion: str) -> str:
    start = completion[:60] + ("…" if len(completion) > 60 else "")
    return f"completion {index % group + 1} of {group} of the prompt at {prompt.where} ({start!r})"


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Prompt],
    completions: Sequence[str],
    lengths: Sequence[int],
    group: int,
) -> tuple[torch.Tensor | None, str | None]:
    """([n, k] float64 rewards of the n completions by the k functions, None) or (None, the
    `RewardError` line of the first failure). Completion i answers ``prompts[i // group]``."""
    values = torch.zeros(len(completions), len(rewards), dtype=torch.float64)
    for i, (completion, length) in enumerate(zip(completions, lengths, strict=True)):
        prompt = prompts[i // group]
        args = dict(prompt=prompt.text, completion=completion, answer=prompt.answer, metadata=prompt.metadata)
        for k, reward in enumerate(rewards):
            try:
                value = reward.fn(**args, **({"length": length} if reward.takes_length else {}))
            except Exception as e:  # the user's code: any failure is reported in one line
                return None, (
                    f"{reward.key} ({reward.name}) raised {type(e).__name__}: {str(e)[:200]} on "
                    f"{_sample(prompt, i, group, completion)}"
                )
            number = _number(value)
            if number is None:
                return None, (
                    f"{reward.key} ({reward.name}) returned {value!r:.80} (not a finite number) on "
                    f"{_sample(prompt, i, group, completion)}"
                )
            values[i, k] = number
    return values, None


def advantages(
    total: torch.Tensor, group: int, scaling: str, batch_std: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage of each completion [n], whether its group's rewards all agree [n / group]) from
    the total rewards [n], completions grouped `group` at a time:

        A_i = (R_i − mean_group R) / (std + ε)     std: the group's (``group``), the generation
                                                   batch's over every rank (``batch``, given as
                                                   `batch_std`), or none (A_i = R_i − mean)

    std is the sample standard deviation (Bessel's correction, as TRL); ε = `STD_EPSILON`."""
    grouped = total.view(-1, group)
    centred = (grouped - grouped.mean(-1, keepdim=True)).view(-1)
    agree = grouped.amax(-1) == grouped.amin(-1)
    if scaling == "group":
        std = grouped.std(-1).repeat_interleave(group)
        return centred / (std + STD_EPSILON), agree
    if scaling == "batch":
        return centred / (batch_std + STD_EPSILON), agree
    return centred, agree
