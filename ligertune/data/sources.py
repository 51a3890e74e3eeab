"""Reading one split of a dataset through `datasets`, with errors that name the file.

``data.path`` is either local (``ligertune://`` assets, a JSON/JSONL/Parquet/CSV/Arrow file,
a directory of such files, or a directory written by ``save_to_disk``), read by
`ligertune.data.local` with one set of rules for a file and a directory, or a hub id, which goes
through ``datasets.load_dataset``. A single local file is the split ``train``.

A hub dataset may name a config (``data.subset``: ``load_dataset(path, subset)``). With
``data.streaming`` the split is an `IterableDataset` read lazily (``streaming=True``); its
columns are checked on its first row, since a stream's features may be unknown.

Each split comes with a `Located`: the name messages use for the dataset, and for each row the
file it came from and its row there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ligertune.data.formats import Located, check_columns, rename_columns
from ligertune.data.local import first_line, load_local, quiet_datasets, refuse_json_columns
from ligertune.errors import DataError
from ligertune.paths import looks_local

if TYPE_CHECKING:
    import datasets

    from ligertune.config import DataSection, Recipe

__all__ = ["Located", "SourceSpec", "load_split", "quiet_datasets", "source_fingerprint", "source_specs"]


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
) -> tuple[datasets.Dataset | datasets.IterableDataset, Located]:
    """One split of a dataset, its columns renamed as ``data.columns`` maps them and checked against
    the format's (a stream's on its first row), and how messages name it and its rows."""
    if spec.local is None:
        name = f"{spec.path} (split {split})" + (f", subset {spec.subset}" if spec.subset else "")
        dataset, located = (
            rename_columns(_load_hub(spec, split, streaming), spec.columns, name),
            Located(name),
        )
        refuse_json_columns(dataset, spec.format, spec.messages_field, name)
    else:
        path = spec.local
        if not path.exists():
            raise DataError(f"{spec.key}: file not found: {path}")
        if spec.subset is not None:
            raise DataError(f"data.subset: {spec.subset!r} names a hub config, but {path} is a local dataset")
        dataset, located = load_local(path, split, spec.format, spec.messages_field, spec.columns)
        if streaming:
            dataset = dataset.to_iterable_dataset()
    if streaming:
        if next(iter(dataset.take(1)), None) is None:
            raise DataError(f"{located}: the dataset is empty (split {split} has no rows)")
        check_columns(spec.format, stream_columns(dataset), str(located), spec.messages_field)
    else:
        if len(dataset) == 0:
            raise DataError(f"{located}: the dataset is empty (split {split} has no rows)")
        check_columns(spec.format, dataset.column_names, str(located), spec.messages_field)
    return dataset, located


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
        raise DataError(f"{spec.key} {spec.path}: {first_line(e)}") from None
    except Exception as e:  # network, authentication, missing repository: all say the same to the user
        raise DataError(
            f"{spec.key}: cannot load {spec.path!r} from the hub ({type(e).__name__}: {first_line(e)}); "
            "no local file has that name either"
        ) from None
