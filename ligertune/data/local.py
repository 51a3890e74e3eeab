"""Local data files → a `datasets.Dataset`, with one set of rules for a file and for a directory.

Why not ``datasets.load_dataset("json" | "csv" | <directory>)``, as before:

- JSON and JSON Lines: its reader types each column from the values, and a column of mixed
  types becomes ``Json``, whose text values are decoded again when read: an output ``"false"``
  becomes False, ``"\\"quoted\\""`` loses its quotes, ``"null"`` vanishes. Here the file is
  parsed with Python's ``json`` (exact types; ``NaN`` and ``Infinity``, which are not JSON, are
  refused), and every value is stored as the JSON text of exactly that value, decoded by
  `ligertune.data.formats.Located` when the rows are tokenised. So the format's checks see the
  file's own types, and name the file's own row, whatever the other rows hold.
- CSV: pandas infers numbers and reads ``NA``, ``null`` and empty fields as missing. A CSV file
  holds text, and every field is read as the text it is (Python's ``csv``), stored the same way.
- A directory: ``load_dataset(dir)`` picks one file type and reads only those files (``a.jsonl``
  and ``b.csv``: half the rows), and casts every file to the first one's column types (an int
  ``output`` in ``b.jsonl`` was trained on as text, though the same file alone is refused). Here
  each file of a directory is read as a file alone, with the same rules and checks, and the
  results are put together; rows are named by their file and their row in it. A directory that
  mixes file types, or holds a data file that no split takes, is refused, naming the files.
  Splits follow `datasets`' file-name conventions (``train.jsonl``, ``test-00001.parquet``;
  everything is ``train`` when no file names a split).

Parquet and Arrow files carry their own column types and are read by `datasets`, a file at a
time. JSON and CSV files are held in memory as compact JSON text (about the size of the file).
Rows are numbered from 0 within their file, as every message about a row says.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ligertune.data.formats import Located, check_columns, column_renames, columns_for, rename_columns
from ligertune.errors import DataError

if TYPE_CHECKING:
    import datasets

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# Rows turned into Arrow arrays at a time: bounds the Python objects alive while a file is read.
_CHUNK = 50_000
# UTF-8, with the byte-order mark some Windows editors write first skipped.
_TEXT = "utf-8-sig"


def load_local(
    path: Path, split: str, fmt: str, messages_field: str | None, columns: dict[str, str] | None = None
) -> tuple[datasets.Dataset, Located]:
    """One split of the local dataset `path` (a file, a directory of files, or a folder written by
    ``save_to_disk``), its columns renamed as ``data.columns`` maps them (`columns`) and checked
    against the format's, and how to name its rows."""
    if path.is_dir():
        return _load_directory(path, split, fmt, messages_field, columns)
    if split != "train":
        raise DataError(
            f"{path}: a single file holds one split, train, not {split!r}; point data.path at a directory "
            "or dataset with that split, or hold out data.validation_fraction instead"
        )
    return load_file(path, fmt, messages_field, columns)


def file_builder(path: Path) -> str:
    """How a data file is read, by its suffix (`BUILDERS`); DataError for another type or an
    empty file."""
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(BUILDERS)}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    return builder


def text_rows(path: Path, builder: str) -> Iterator[dict[str, Any]]:
    """The rows of a JSON or CSV file as the module docstring reads them, one at a time (a JSON
    list or object is parsed whole: the format has no head to read)."""
    return _json_rows(path) if builder == "json" else _csv_rows(path)


def load_file(
    path: Path, fmt: str, messages_field: str | None, columns: dict[str, str] | None = None
) -> tuple[datasets.Dataset, Located]:
    """One data file, by its suffix (module docstring), its columns renamed and checked."""
    builder = file_builder(path)
    if builder in ("json", "csv"):
        check_utf8(path)
        rows = text_rows(path, builder)
        dataset = _as_json_text(rows, path, fmt, messages_field, columns)
        return dataset, Located(str(path), json_text=True)
    dataset = rename_columns(_load_typed(path, builder), columns, str(path))
    check_columns(fmt, dataset.column_names, str(path), messages_field)
    refuse_json_columns(dataset, fmt, messages_field, str(path))
    return dataset, Located(str(path))


# --------------------------------------------------------------------------------------------
# JSON and CSV, read here
# --------------------------------------------------------------------------------------------


# A JSON escape of a UTF-16 surrogate: paired, json makes one character of two; alone (a cut
# emoji), it decodes to a string that is not Unicode text, which the tokenizer cannot take.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _loads(text: str) -> Any:
    value = json.loads(text, parse_constant=_not_json)
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "a \\u escape stands for half a character (a lone surrogate); fix the text"
            ) from None
    return value


def _json_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSON list of objects, a single object, or JSON Lines (one object a line).
    DataError naming the line of the first problem."""
    with path.open(encoding=_TEXT) as f:
        first = ""
        for first in f:
            if first.strip():
                break
    lines = _loads_first(first)
    if lines:  # JSON Lines: read a line at a time
        with path.open(encoding=_TEXT) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = _loads(line)
                except ValueError as e:
                    raise DataError(f"{path}: line {number} is not valid JSON: {_reason(e)}") from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}: line {number} is a JSON {type(row).__name__}; each line must be an object "
                        "with the columns"
                    )
                yield row
        return
    try:
        whole = _loads(path.read_text(encoding=_TEXT))
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON: {_reason(e)}") from None
    if isinstance(whole, dict):
        yield whole
    elif isinstance(whole, list) and all(isinstance(row, dict) for row in whole):
        if not whole:
            raise DataError(f"{path}: the JSON list has no rows")
        yield from whole
    else:
        raise DataError(
            f"{path}: expected a JSON list of objects (or one object per line), got a {type(whole).__name__}"
        )


def _loads_first(line: str) -> bool:
    """Whether the first non-blank line is a whole JSON object: then the file is JSON Lines."""
    try:  # the layout only: what the line holds is checked when it is read
        return isinstance(json.loads(line), dict) and line.lstrip().startswith("{")
    except ValueError:
        return False


def _reason(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno}, column {error.colno}"
    return str(error)


def _csv_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a CSV file with a header line, every field as text."""
    with path.open(encoding=_TEXT, newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if not header:
                raise DataError(f"{path}: the CSV file has no header line")
            for row in reader:
                if not row:
                    continue
                if len(row) != len(header):
                    raise DataError(
                        f"{path}: line {reader.line_num} has {len(row)} fields, the header has {len(header)}"
                    )
                yield dict(zip(header, row, strict=True))
        except csv.Error as e:
            raise DataError(f"{path}: line {reader.line_num} is not valid CSV: {e}") from None


def _as_json_text(
    rows: Iterable[dict[str, Any]],
    path: Path,
    fmt: str,
    messages_field: str | None,
    columns: dict[str, str] | None,
) -> datasets.Dataset:
    """A dataset of the format's columns (`columns_for`, read from the keys ``data.columns`` maps
    them to), each value the JSON text of the row's value (None where a row lacks the key). Other
    columns are left out; their names count for the columns check."""
    import datasets
    import pyarrow as pa

    required, optional = columns_for(fmt, messages_field)
    wanted = required + optional
    own = {name: (columns or {}).get(name, name) for name in wanted}  # the file's key for each
    seen: dict[str, None] = {}
    arrays: dict[str, list] = {name: [] for name in wanted}
    chunk: dict[str, list] = {name: [] for name in wanted}
    count = 0

    def flush() -> None:
        for name in wanted:
            arrays[name].append(pa.array(chunk[name], type=pa.string()))
            chunk[name] = []

    for row in rows:
        seen.update(dict.fromkeys(row))
        for name in wanted:
            value = row.get(own[name])
            chunk[name].append(None if value is None else json.dumps(value, ensure_ascii=False))
        count += 1
        if count % _CHUNK == 0:
            flush()
    flush()
    if count == 0:
        raise DataError(f"{path}: the file has no rows")
    renames = column_renames(columns, list(seen), str(path))
    check_columns(fmt, [renames.get(c, c) for c in seen], str(path), messages_field)
    present = [name for name in wanted if own[name] in seen]
    table = pa.table({name: pa.chunked_array(arrays[name], type=pa.string()) for name in present})
    return datasets.Dataset(table)


def check_utf8(path: Path) -> None:
    """Raise DataError naming the line of the first byte that is not UTF-8 (`datasets` and
    Python's own readers would either read it without complaint or fail without a line)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                # e.object is the decoder's buffer: this chunk plus at most 3 carried bytes, none a newline.
                where = line + e.object[: e.start].count(b"\n")
                raise DataError(
                    f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {where}); "
                    "re-save the file as UTF-8"
                ) from None
            if not chunk:
                return
            line += chunk.count(b"\n")


# --------------------------------------------------------------------------------------------
# Parquet and Arrow, read by datasets
# --------------------------------------------------------------------------------------------


def _load_typed(path: Path, builder: str) -> datasets.Dataset:
    import datasets

    try:
        with quiet_datasets():
            return datasets.load_dataset(builder, data_files={"train": str(path)}, split="train")
    except Exception as e:
        raise DataError(f"{path}: cannot read it as {path.suffix[1:]}: {root_message(e)}") from None


def refuse_json_columns(dataset, fmt: str, messages_field: str | None, name: str) -> None:
    """A dataset whose format column `datasets` typed ``Json`` (its values are of mixed types) is
    refused: its JSON builder stores text that parses as JSON as it is, so ``"false"`` and
    ``false`` read back alike. Hub datasets go through that builder; a Parquet or Arrow file
    written by `datasets` may carry the type. Local JSON is read exactly instead (module docstring)."""
    features = dataset.features or {}
    required, optional = columns_for(fmt, messages_field)
    mixed = [c for c in required + optional if c in features and "Json(" in repr(features[c])]  # nested too
    if mixed:
        raise DataError(
            f"{name}: column {mixed[0]} holds values of mixed types, which datasets reads back as JSON (text "
            'such as "false" or "null" would not stay text); give the column one type, or download the '
            "files and point data.path at them (local files are read exactly)"
        )


# --------------------------------------------------------------------------------------------
# Directories
# --------------------------------------------------------------------------------------------


def _load_directory(
    path: Path, split: str, fmt: str, messages_field: str | None, columns: dict[str, str] | None
) -> tuple[datasets.Dataset, Located]:
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if not isinstance(loaded, datasets.Dataset):  # one split saved on its own, or several
            if split not in loaded:
                raise DataError(f"{path}: no split {split!r}; it has {', '.join(loaded)}")
            loaded = loaded[split]
        loaded = rename_columns(loaded, columns, str(path))
        check_columns(fmt, loaded.column_names, str(path), messages_field)
        return loaded, Located(str(path))
    splits = split_files(path)
    if split not in splits:
        raise DataError(f"{path}: no split {split!r}; its files make {', '.join(splits) or 'none'}")
    parts = [load_file(file, fmt, messages_field, columns) for file in splits[split]]
    return _concatenate(path, parts)


def split_files(path: Path) -> dict[str, list[Path]]:
    """The data files of directory `path` by split (module docstring). DataError for a directory
    without data files, one that mixes file types, or a data file that no split takes."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    found = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    data = [p for p in found if p.suffix.lower() in BUILDERS]
    if not data:
        raise DataError(f"{path}: no data files in it ({', '.join(BUILDERS)})")
    kinds: dict[str, Path] = {}
    for file in data:
        kinds.setdefault(BUILDERS[file.suffix.lower()], file)
    if len(kinds) > 1:
        mixed = ", ".join(f"{file.relative_to(path)} ({kind})" for kind, file in kinds.items())
        raise DataError(
            f"{path}: mixes file types: {mixed}; a directory holds files of one type (convert them, or "
            "list each under data.mix)"
        )
    patterns = get_data_patterns(str(path))
    resolved = DataFilesDict.from_patterns(patterns, base_path=str(path))
    splits = {
        str(name): sorted(Path(f) for f in files if Path(f).suffix.lower() in BUILDERS)
        for name, files in resolved.items()
    }
    taken = {file for files in splits.values() for file in files}
    left = [file for file in data if file not in taken]
    if left:
        raise DataError(
            f"{path}: {left[0].relative_to(path)} belongs to no split (the files are named by split: "
            f"{', '.join(str(f.relative_to(path)) for f in sorted(taken)[:3])}); rename it after its split "
            "or move it out"
        )
    return {name: files for name, files in splits.items() if files}


def _concatenate(
    path: Path, parts: list[tuple[datasets.Dataset, Located]]
) -> tuple[datasets.Dataset, Located]:
    """The files' rows one after another, named by file. Their columns must agree: a column some
    files lack, or hold only nulls in, is nulls there of the type the others give it (for JSON
    text, a missing value), and a column typed differently in two typed files is refused (it used
    to be cast to the first file's type)."""
    import datasets

    datasets_ = [d for d, _ in parts]
    columns = list(dict.fromkeys(c for d in datasets_ for c in d.column_names))
    first_type: dict[str, tuple[str, Any]] = {}
    filled = []
    for dataset, located in parts:
        for column in columns:
            if column not in dataset.column_names:
                feature = datasets.Value("string") if located.json_text else datasets.Value("null")
                dataset = dataset.add_column(column, [None] * len(dataset), feature=feature)
            feature = dataset.features[column]
            if getattr(feature, "dtype", None) == "null":
                continue
            seen = first_type.setdefault(column, (located.name, feature))
            if seen[1] != feature:
                raise DataError(
                    f"{path}: column {column} is {_describe(seen[1])} in {seen[0]} but {_describe(feature)} in "
                    f"{located.name}; make the files agree"
                )
        filled.append(dataset)
    for i, dataset in enumerate(filled):  # a column null in one file takes the others' type
        nulls = [
            c for c in columns if getattr(dataset.features[c], "dtype", None) == "null" and c in first_type
        ]
        if nulls:
            filled[i] = dataset.cast(
                datasets.Features({**dataset.features, **{c: first_type[c][1] for c in nulls}})
            )
    combined = datasets.concatenate_datasets([d.select_columns(columns) for d in filled])
    starts, total = [], 0
    for dataset, located in parts:
        starts.append((located.name, total))
        total += len(dataset)
    json_text = all(located.json_text for _, located in parts)
    return combined, Located(str(path), files=tuple(starts), json_text=json_text)


def _describe(feature: Any) -> str:
    return str(getattr(feature, "dtype", feature))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def root_message(error: BaseException) -> str:
    """The innermost cause's message: `datasets` wraps the useful one in generic errors."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {first_line(error)}"


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Silence `datasets` logging and progress bars for local loads: failures are reported by us."""
    import datasets

    logger = logging.getLogger("datasets")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()
