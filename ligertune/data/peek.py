"""`ligertune validate`'s look at the data: the first rows of every local source, checked against the
format without loading the whole dataset, and with ``--check`` a sample of them tokenised.

`train` loads a source whole (``datasets`` writes its Arrow cache) before it checks the columns;
for validate that is too slow and too late (a recipe validated on a laptop, trained on a server).
So `first_rows` reads only the head of a file: the first lines of JSON Lines and CSV, the first
record batch of Parquet, the first rows of a ``save_to_disk`` folder; a JSON list is parsed whole
(the format has no head to read). Then the format's own checks run on those rows: the column
mapping (``data.columns``), the required columns, and each field's type as the format's reader
checks it (text, messages with their keys and roles, token ids). Hub datasets are not fetched by
validate (no network is assumed): they are named as not checked.

What passes here can still fail later in a row beyond the first ones; what fails here fails
`train` too, with the same message.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ligertune.data.chat import read_messages
from ligertune.data.formats import (
    alpaca_segments,
    canonical_format,
    chat_options,
    check_columns,
    column_renames,
    default_messages_field,
    kto_label,
    pretokenized_samples,
    prompt_completion_segments,
)
from ligertune.data.images import BadImage, has_image_parts, read_conversation
from ligertune.data.local import file_builder, split_files, text_rows
from ligertune.data.sources import SourceSpec, source_specs
from ligertune.errors import DataError

if TYPE_CHECKING:
    from ligertune.config import Recipe

ROWS = 8  # rows read per source: enough to catch a wrong layout, cheap for any file


def first_rows(
    spec: SourceSpec, split: str, count: int = ROWS
) -> tuple[list[dict[str, Any]], list[str], str]:
    """(the first `count` rows, the columns, a name for messages) of a local source's split."""
    path = spec.local
    if path is None:
        raise ValueError("a hub dataset is not read here")
    if not path.exists():
        raise DataError(f"{spec.key}: file not found: {path}")
    if path.is_dir():
        return _first_rows_of_folder(path, split, count)
    rows = _first_rows_of_file(path, count)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return rows, columns, str(path)


def _first_rows_of_file(path: Path, count: int) -> list[dict[str, Any]]:
    """The head of a file, read by `ligertune.data.local`'s own readers (JSON and CSV exactly as
    `train` reads them)."""
    builder = file_builder(path)
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(path).iter_batches(batch_size=count), None)
            return batch.to_pylist() if batch is not None else []
        if builder == "arrow":
            import datasets

            loaded = datasets.Dataset.from_file(str(path))
            return loaded.select(range(min(count, len(loaded)))).to_list()
        return list(itertools.islice(text_rows(path, builder), count))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason}); re-save the file as UTF-8") from None


def _first_rows_of_folder(path: Path, split: str, count: int) -> tuple[list[dict], list[str], str]:
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))  # memory-mapped: reading its head is cheap
        if not isinstance(loaded, datasets.Dataset):
            if split not in loaded:
                raise DataError(f"{path}: no split {split!r}; it has {', '.join(loaded)}")
            loaded = loaded[split]
        return loaded.select(range(min(count, len(loaded)))).to_list(), list(loaded.column_names), str(path)
    splits = split_files(path)
    if split not in splits:
        raise DataError(f"{path}: no split {split!r}; its files make {', '.join(splits) or 'none'}")
    first = splits[split][0]
    rows = _first_rows_of_file(first, count)
    return rows, list(dict.fromkeys(key for row in rows for key in row)), str(first)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def mapped(rows: list[dict], columns: list[str], spec: SourceSpec, name: str) -> tuple[list[dict], list[str]]:
    """Rows and columns with ``data.columns`` applied, as `train` renames them."""
    renames = column_renames(spec.columns, columns, name)
    return [{renames.get(k, k): v for k, v in row.items()} for row in rows], [
        renames.get(c, c) for c in columns
    ]


def check_rows(
    spec: SourceSpec, rows: list[dict], name: str, think_blocks: str = "keep", skip_bad_images: bool = False
) -> None:
    """The format's own per-row checks that need no tokenizer (DataError naming the row)."""
    fmt = canonical_format(spec.format)
    named = [(f"{name}, row {index}", row) for index, row in enumerate(rows)]
    if fmt == "alpaca":
        alpaca_segments(named)
    elif fmt == "prompt_completion":
        prompt_completion_segments(named)
    elif fmt == "pretokenized":
        pretokenized_samples(named, 2**31)
    elif fmt in ("chat", "sharegpt"):
        field = spec.messages_field or default_messages_field(fmt)
        options = chat_options(fmt, spec.columns, spec.roles, think_blocks)
        base = None if spec.local is None else (spec.local if spec.local.is_dir() else spec.local.parent)
        for where, row in named:
            if has_image_parts(row[field]):  # a vision-language row: its parts and images, opened
                try:
                    read_conversation(row[field], where, base, row.get("images") or [])
                except BadImage as e:
                    if not skip_bad_images:
                        raise DataError(f"{where}: {e}; fix it, or set data.skip_bad_images: true") from None
            else:
                read_messages(row[field], field, where, options)
    elif fmt == "kto":
        for where, row in named:
            kto_label(row, where)


def data_problems(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(problems, notes): one line per source whose first rows do not fit its format; a note for
    each source not read here (hub datasets)."""
    problems, notes = [], []
    for spec in source_specs(recipe):
        if spec.local is None:
            notes.append(
                f"{spec.key}: {spec.path} is a hub dataset; its rows are checked when train loads it"
            )
            continue
        try:
            rows, columns, name = first_rows(spec, spec.split)
            rows, columns = mapped(rows, columns, spec, name)
            check_columns(spec.format, columns, name, spec.messages_field)
            check_rows(spec, rows, name, recipe.data.think_blocks, recipe.data.skip_bad_images)
        except DataError as e:
            problems.append(str(e))
    return problems, notes
