"""What the data pipeline hands the trainer: the rows of each split and their counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ligertune.data.packing import SequenceDataset

Log = Callable[[str], None]  # receives progress lines


@dataclass
class DataStats:
    """Counts for one split. `validation` holds the validation split's counts, when there is one."""

    num_samples: int  # rows read from the source (after max_samples / hold-out)
    num_truncated: int  # samples cut to max_seq_len
    num_dropped: int  # samples with no trained token left (e.g. the response was truncated away)
    num_sequences: int  # rows handed to the loader
    num_tokens: int  # real tokens in those rows (packing padding not counted)
    num_label_tokens: int  # tokens the loss is computed on
    max_seq_len: int
    packed: bool
    validation: DataStats | None = None
    streaming: bool = False  # counts unknown: the rows are made while training
    prompts: bool = False  # prompts whose completions the objective generates (no label tokens here)

    def describe(self) -> str:
        if self.prompts:
            return (
                f"{self.num_samples} prompts of {self.num_tokens / max(1, self.num_sequences):.0f} tokens on average, "
                f"completions generated while training; {self.num_truncated} cut to fit {self.max_seq_len} tokens "
                "with their completions"
            )
        if self.streaming:
            layout = f"packed sequences of {self.max_seq_len}" if self.packed else "one sample per row"
            return f"streaming: samples tokenised on the fly ({layout}; length unknown, steps from max_steps)"
        if self.packed:
            layout = f"{self.num_sequences} packed sequences of {self.max_seq_len} tokens"
            fill = self.num_tokens / max(1, self.num_sequences * self.max_seq_len)
            layout += f" ({fill:.0%} filled)"
        else:
            layout = f"{self.num_sequences} sequences of ≤ {self.max_seq_len} tokens (padding mode)"
        text = f"{self.num_samples} samples → {layout}; {self.num_truncated} truncated to {self.max_seq_len}"
        if self.num_dropped:
            text += f"; {self.num_dropped} dropped with no trainable tokens"
        return text + f"; {self.num_label_tokens} of {self.num_tokens} tokens trained"


@dataclass
class PreparedData:
    train: Any  # a SequenceDataset, or a StreamingRows with data.streaming
    validation: SequenceDataset | None
    stats: DataStats  # train counts; stats.validation for the validation split
    cache_dir: Path | None = None  # the cache entry the samples came from or went to
    # A digest of the tokenised samples and their counts (`ligertune.data.pipeline.data_fingerprint`),
    # saved with every checkpoint so that a resume notices changed data; None for a stream.
    fingerprint: dict[str, Any] | None = None

    def report(self) -> str:
        """One line for the run log."""
        text = self.stats.describe()
        if self.stats.validation is not None:
            text += f" | validation: {self.stats.validation.describe()}"
        return text
