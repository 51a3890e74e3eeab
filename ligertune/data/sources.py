"""Reading one split of a dataset through `datasets`, with errors that name the file.

``data.path`` is either local (``ligertune://`` assets, a JSON/JSONL/Parquet/CSV/Arrow file,
a directory of such files, or a directory written by ``save_to_disk``) or a hub id, which goes
through the same ``datasets.load_dataset`` call. A single local file is the split ``train``.

`datasets` reports broken files poorly: invalid UTF-8 is read without complaint and a JSON
syntax error surfaces as a generic DatasetGenerationError. So text files are checked for
UTF-8 before loading (one streaming pass), and when loading fails the file is re-read to find
the line at fault. The successful path costs one UTF-8 pass and nothing else.

A hub dataset may name a config (``data.subset``: ``load_dataset(path, subset)``). With
``data.streaming`` the split is an `IterableDataset` read lazily (``streaming=True``); its
columns are checked on its first row, since a stream's features may be unknown.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ligertune.errors import DataError
from ligertune.paths import looks_local

if TYPE_CHECKING:
    import datasets

    from ligertune.config import DataSection, Recipe

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
TEXT_SUFFIXES = (".json", ".jsonl", ".csv")


@dataclass(frozen=True)
class SourceSpec:
    """One dataset of a recipe: ``data.path``, or one entry of ``data.mix`` with the data
    section's values filled in where the entry leaves a key unset."""

    key: str  # the recipe key naming it, for messages: data.path or data.mix[i].path
    path: str  # as written in the recipe
    local: Path | None  # resolved path of a local dataset; None for a hub id
    format: str
    split: str
    subset: str | None
    messages_field: str | None
    weight: float = 1.0
    columns: dict | None = None  # data.columns: the format's field → this dataset's column
    roles: dict | None = None  # data.roles: this dataset's role name → ours


def source_specs(recipe: Recipe) -> list[SourceSpec]:
    data: DataSection = recipe.data

    def spec(key: str, path: str, **own) -> SourceSpec:
        values = {k: (v if v is not None else getattr(data, k)) for k, v in own.items()}
        local = recipe.resolve(path) if looks_local(path) else None
        return SourceSpec(key, path, local, **values)

    if not data.mix:
        if data.path is None:
            raise DataError("data.path: required key is missing (or list several datasets under data.mix)")
        return [
            spec(
                "data.path",
                data.path,
                format=None,
                split=None,
                subset=None,
                messages_field=None,
                columns=None,
                roles=None,
            )
        ]
    return [
        spec(
            f"data.mix[{i}].path",
            s.path,
            format=s.format,
            split=s.split,
            subset=s.subset,
            messages_field=s.messages_field,
            weight=s.weight,
            columns=s.columns,
            roles=s.roles,
        )
        for i, s in enumerate(data.mix)
    ]


def load_split(
    spec: SourceSpec, split: str, streaming: bool = False
) -> tuple[datasets.Dataset | datasets.IterableDataset, str]:
    """One split of a dataset and a name for it to use in messages."""
    if spec.local is None:
        name = f"{spec.path} (split {split})" + (f", subset {spec.subset}" if spec.subset else "")
        dataset = _load_hub(spec, split, streaming)
    else:
        path = spec.local
        if not path.exists():
            raise DataError(f"{spec.key}: file not found: {path}")
        if spec.subset is not None:
            raise DataError(f"data.subset: {spec.subset!r} names a hub config, but {path} is a local dataset")
        name = str(path)
        dataset = _load_dir(path, split) if path.is_dir() else _load_file(path, split)
        if streaming:
            dataset = dataset.to_iterable_dataset()
    if streaming:
        if next(iter(dataset.take(1)), None) is None:
            raise DataError(f"{name}: the dataset is empty (split {split} has no rows)")
    elif len(dataset) == 0:
        raise DataError(f"{name}: the dataset is empty (split {split} has no rows)")
    return dataset, name


def stream_columns(dataset: datasets.IterableDataset) -> list[str]:
    """A stream's columns: from its features when known, else from its first row."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset.take(1))))


def source_fingerprint(spec: SourceSpec, dataset: datasets.Dataset) -> dict:
    """What identifies the data read: each local file's path, size and modification time, or
    for a hub dataset its id, config and `datasets`' fingerprint of the snapshot loaded (which
    follows the revision the hub served: the cached Arrow files are per revision)."""
    if spec.local is None:
        return {"hub": spec.path, "subset": spec.subset, "snapshot": dataset._fingerprint}
    files = sorted(p for p in spec.local.rglob("*") if p.is_file()) if spec.local.is_dir() else [spec.local]
    return {
        "local": str(spec.local.resolve()),
        "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }


def _load_hub(spec: SourceSpec, split: str, streaming: bool) -> datasets.Dataset:
    import datasets

    kwargs = {"name": spec.subset} if spec.subset else {}
    if streaming:
        kwargs["streaming"] = True
    try:
        return datasets.load_dataset(spec.path, split=split, **kwargs)
    except ValueError as e:
        raise DataError(f"{spec.key} {spec.path}: {_first_line(e)}") from None
    except Exception as e:  # network, authentication, missing repository: all say the same to the user
        raise DataError(
            f"{spec.key}: cannot load {spec.path!r} from the hub ({type(e).__name__}: {_first_line(e)}); "
            "no local file has that name either"
        ) from None


def _load_file(path: Path, split: str) -> datasets.Dataset:
    import datasets

    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(BUILDERS)}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    if builder in ("json", "csv"):
        check_utf8(path)
    try:
        with quiet_datasets():
            return datasets.load_dataset(builder, data_files={"train": str(path)}, split=split)
    except Exception as e:
        raise _diagnose(path, split, e) from None


def _load_dir(path: Path, split: str) -> datasets.Dataset:
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.Dataset):
            return loaded  # one split saved on its own
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r}; it has {', '.join(loaded)}")
        return loaded[split]
    for file in sorted(path.rglob("*")):
        if file.suffix.lower() in TEXT_SUFFIXES and file.is_file():
            check_utf8(file)
    try:
        with quiet_datasets():
            return datasets.load_dataset(str(path), split=split)
    except Exception as e:
        raise DataError(f"{path}: cannot load split {split!r}: {_root_message(e)}") from None


def check_utf8(path: Path) -> None:
    """Raise DataError naming the line of the first byte that is not UTF-8."""
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


def _diagnose(path: Path, split: str, error: Exception) -> DataError:
    """Turn a failed load of a local file into a message naming the problem."""
    if "split" in str(error).lower() and split != "train":
        return DataError(
            f"{path}: a single file holds one split, train, not {split!r}; point data.path at a directory "
            "or dataset with that split, or hold out data.validation_fraction instead"
        )
    if BUILDERS[path.suffix.lower()] == "json":
        problem = json_problem(path)
        if problem:
            return DataError(f"{path}: {problem}")
    return DataError(f"{path}: cannot read it as {path.suffix[1:]}: {_root_message(error)}")


def json_problem(path: Path) -> str | None:
    """What is wrong with a JSON or JSON Lines file, or None when it parses as one of them."""
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return "the file is empty"
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            return f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        whole = None  # more than one value: JSON Lines
    if whole is not None:
        if isinstance(whole, list) and all(isinstance(row, dict) for row in whole):
            return "the JSON list has no rows" if not whole else None
        if isinstance(whole, dict):
            return None
        return f"expected a JSON list of objects (or one object per line), got a {type(whole).__name__}"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {number} is not valid JSON: {e.msg} at column {e.colno}"
        if not isinstance(row, dict):
            return (
                f"line {number} is a JSON {type(row).__name__}; each line must be an object with the columns"
            )
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _root_message(error: BaseException) -> str:
    """The innermost cause's message: `datasets` wraps the useful one in generic errors."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return f"{type(error).__name__}: {_first_line(error)}"


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
