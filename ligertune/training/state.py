"""`TrainState`: what the loop changes as it runs and a checkpoint restores (besides the weights,
the optimizer, the schedule and the RNG states, which their owners save)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    def checkpoint_record(self, position: tuple[int, int], order: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint's state.json holds of the loop, at data `position` (a stop for a
        non-finite loss saves the failing step's, for a resume to replay it), with the inputs
        of the data `order`. The step is recorded by the checkpoint itself."""
        return {
            "epoch": position[0],
            "batch_index": position[1],
            "order": order,
            "skipped_steps": self.skipped,
        }

    @classmethod
    def from_checkpoint(cls, step: int, record: dict[str, Any], path: Path) -> TrainState:
        """The state a checkpoint restores (one written before skipped steps were counted has none)."""
        return cls(step, record["epoch"], record["batch_index"], record.get("skipped_steps", 0), path)
