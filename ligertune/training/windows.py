"""The micro-batches of each optimizer step: the next window of the data stream, made into the
micro-batches the step trains on by the objective (`ligertune.objectives.base.Objective.prepare`),
and reused for ``updates_per_window`` optimizer steps.

For the objectives that train on the data as it is (sft, the preference objectives) a window is
``gradient_accumulation_steps`` micro-batches, used once. An objective that makes its own rows
(grpo generates completions of the window's prompts) may train on them for several steps
(``num_iterations`` policy updates per generation batch): a new window is taken at steps 0, μ,
2μ, … and the data position moves only then. A checkpoint saved in between holds each rank's
prepared micro-batches (``prepared-rank<R>.pt``, CPU tensors, read back with
``torch.load(weights_only=True)`` like every checkpoint file; the manifest covers it), so a resume
continues on the same rows, which could not be made again: the policy that generated them has
moved on since. At a window's first step nothing is kept: the resume prepares the window again,
from the same data position and (for generation) the same seeded generator, which is what an
uninterrupted run does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ligertune.errors import RecipeError
from ligertune.objectives import Objective, Prepared
from ligertune.run.manifest import load_file
from ligertune.training.state import TrainState

if TYPE_CHECKING:
    from ligertune.config import Recipe
    from ligertune.training.components import Components


def prepared_file(rank: int) -> str:
    return f"prepared-rank{rank}.pt"


class Windows:
    """What each step trains on (module docstring). `model` is what the strategy wrapped,
    `autocast` the step's precision context (generation runs under it too)."""

    def __init__(
        self,
        objective: Objective,
        model: nn.Module,
        autocast: Callable[[], contextlib.AbstractContextManager],
        accumulation: int,
        updates: int,
        rank: int,
    ):
        self.objective, self.model, self.autocast = objective, model, autocast
        self.accumulation, self.updates, self.rank = accumulation, updates, rank
        self.current: Prepared | None = None  # the window in use while it is reused

    @classmethod
    def of(cls, parts: Components, recipe: Recipe, rank: int) -> Windows:
        """The windows of a run: its objective, model and precision, the recipe's accumulation."""
        updates = recipe.objective.updates_per_window()
        accumulation = recipe.training.gradient_accumulation_steps
        return cls(parts.objective, parts.model, parts.autocast, accumulation, updates, rank)

    def take(self, state: TrainState, stream: Iterator) -> Prepared | None:
        """The micro-batches of the step after `state.step`, moving the data position in `state`
        when a new window is taken; None when the data has ended."""
        if self.current is not None and state.step % self.updates:
            return Prepared(self.current.batches)  # its metrics and report belong to its first step
        window = list(itertools.islice(stream, self.accumulation))
        if not window:
            return None
        state.epoch, state.batch_index = window[-1][1]
        with self.autocast():
            prepared = self.objective.prepare(self.model, [batch for batch, _ in window], state.step)
        self.current = prepared if self.updates > 1 else None
        return prepared

    def save(self, directory: Path, step: int) -> None:
        """Into checkpoint `directory` of step `step`: this rank's prepared micro-batches, when the
        next step still trains on them."""
        if self.current is not None and step % self.updates:
            torch.save({"batches": self.current.batches}, directory / prepared_file(self.rank))

    def restore(self, checkpoint: Path, step: int) -> None:
        """The prepared micro-batches a checkpoint of step `step` holds for this rank, when a
        resume there continues on them (RecipeError naming the file when they are missing)."""
        if self.updates == 1 or step % self.updates == 0:
            return
        path = checkpoint / prepared_file(self.rank)
        if not path.is_file():
            raise RecipeError(
                [
                    f"checkpoint.resume: {checkpoint} was saved at step {step}, between the {self.updates} updates "
                    f"of one generation batch, and has no {path.name} for rank {self.rank}: resume with the number "
                    "of processes that saved it, or from a checkpoint at a multiple of objective.num_iterations"
                ]
            )
        self.current = Prepared(load_file(path)["batches"])
