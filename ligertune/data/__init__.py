"""The data pipeline: dataset files → tokenized samples (cached) → packed or padded rows → micro-batches.

    tokenizer = load_tokenizer(recipe)
    data = build_datasets(recipe, tokenizer, log=print)   # data.train, data.validation, data.stats
    # under several processes: build_datasets(..., is_main=runtime.is_main, barrier=runtime.barrier)
    print(data.report())
    loader = MicroBatchLoader(data.train, 4, seed=recipe.seed, pad_token_id=tokenizer.pad_token_id,
                              packing=recipe.data.packing, rank=rank, world_size=world_size)
    for batch in loader.iter_epoch(epoch, start=resume_micro_batch): ...

Every problem with the data a user can fix raises `DataError` with one line naming the file and
what is wrong; the CLI prints it and exits with status 2.
"""

import importlib
from typing import TYPE_CHECKING

from ligertune.errors import DataError

# Imported on first use: `ligertune validate` reads the formats (ligertune.data.formats, .peek),
# which need neither torch nor datasets, and answers in a fraction of a second; the loader and the
# pipeline import torch.
_EXPORTS = {
    "DataStats": "ligertune.data.pipeline",
    "MicroBatchLoader": "ligertune.data.loader",
    "PreparedData": "ligertune.data.pipeline",
    "SequenceDataset": "ligertune.data.packing",
    "build_datasets": "ligertune.data.pipeline",
    "cache_entry": "ligertune.data.pipeline",
    "load_tokenizer": "ligertune.data.tokenizer",
}

if TYPE_CHECKING:
    from ligertune.data.loader import MicroBatchLoader
    from ligertune.data.packing import SequenceDataset
    from ligertune.data.pipeline import DataStats, PreparedData, build_datasets, cache_entry
    from ligertune.data.tokenizer import load_tokenizer


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ligertune.data' has no attribute {name!r}")


__all__ = [
    "DataError",
    "DataStats",
    "MicroBatchLoader",
    "PreparedData",
    "SequenceDataset",
    "build_datasets",
    "cache_entry",
    "load_tokenizer",
]
