"""What the loop keeps as it runs: `TrainState` (what it changes and a checkpoint restores, besides
the weights, the optimizer, the schedule and the RNG states, which their owners save), `Progress`
(what it tracks between log lines and does not checkpoint), and the records it hands out: one
`StepRecord` per step to the ``on_step_end`` hook, the `TrainResult` at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # the data position: the epoch of the next micro-batch...
    batch_index: int = 0  # ...and its index in that epoch's order
    skipped: int = 0  # steps skipped in the run (on_nonfinite=skip), resumes included
    last_saved: Path | None = None  # the newest checkpoint this run wrote or resumed from

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch_index

    def checkpoint_record(
        self, position: tuple[int, int], order: dict[str, Any], recipe_file: Path | None, total_steps: int
    ) -> dict[str, Any]:
        """What a checkpoint's state.json holds of the loop, at data `position` (a stop for a
        non-finite loss saves the failing step's, for a resume to replay it), with the inputs
        of the data `order`, and which recipe file runs the directory and when it is finished
        (`ligertune.training.resume.same_run_notes`). The step is recorded by the checkpoint
        itself."""
        return {
            "epoch": position[0],
            "batch_index": position[1],
            "order": order,
            "skipped_steps": self.skipped,
            "recipe_file": str(recipe_file) if recipe_file else None,
            "total_steps": total_steps,
        }

    @classmethod
    def from_checkpoint(cls, step: int, record: dict[str, Any], path: Path) -> TrainState:
        """The state a checkpoint restores (one written before skipped steps were counted has none)."""
        return cls(step, record["epoch"], record["batch_index"], record.get("skipped_steps", 0), path)


@dataclass
class StepRecord:
    """What one optimizer step did; handed to the `on_step_end` hook."""

    step: int
    epoch: float  # epochs completed, fractional (2.5: half way through the third)
    loss: float
    grad_norm: float
    lr: float
    items: int  # what the objective averages over (label tokens for SFT), over all ranks
    label_tokens: int
    tokens: int
    seconds: float
    skipped: bool
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's (rewards, KL, ...)


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    eval_loss: float | None
    run_dir: Path
    checkpoint: Path | None
    export_dir: Path | None
    signal: int | None
    model: nn.Module


@dataclass
class Progress:
    """What the loop tracks between steps and log lines and does not checkpoint."""

    window_losses: list[float] = field(default_factory=list)  # finite step losses since the last log line
    window_metrics: dict[str, list[float]] = field(default_factory=dict)  # the objective's, likewise
    consecutive_skipped: int = 0
    last_loss: float | None = None
    eval_loss: float | None = None
    epoch_saved: int = 0  # checkpoint.save_every_epoch: the epochs whose end is saved
