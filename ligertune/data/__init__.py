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

from ligertune.data.loader import MicroBatchLoader
from ligertune.data.packing import SequenceDataset
from ligertune.data.pipeline import DataStats, PreparedData, build_datasets, cache_entry
from ligertune.data.tokenizer import load_tokenizer
from ligertune.errors import DataError

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
