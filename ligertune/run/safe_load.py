"""Reading the sharded checkpoint formats without running code that a checkpoint could carry.

A checkpoint directory may come from someone else (a run copied to resume or to `generate`
from), and Python's pickle runs whatever a file names: a ``__reduce__`` that calls
``os.system`` is an ordinary pickle. Our own files are read with
``torch.load(weights_only=True)`` (`ligertune.run.manifest.load_file`), which resolves only
tensors, containers and numbers. The two formats whose files are read by other libraries did not:

torch.distributed.checkpoint ("dcp", FSDP)
    ``FileSystemReader.read_metadata`` reads ``dcp/.metadata`` with a bare ``pickle.load``, and
    ``DefaultLoadPlanner.load_bytes`` reads every non-tensor value (the optimizer's param-group
    settings) with ``torch.load(weights_only=False)``. We keep DCP, and read both without
    running code: `SafeReader` unpickles the metadata with `MetadataUnpickler`, which resolves
    only the metadata's own classes (the dataclasses of ``torch.distributed.checkpoint.metadata``,
    the filesystem's ``_StorageInfo``, ``torch.Size``, dtypes and layouts, paths) and refuses any
    other name before anything is called; `SafePlanner` reads the non-tensor values with
    ``weights_only=True``. The metadata is also checked for what it makes the reader do: every
    storage file it names must be a plain name inside ``dcp/`` (no ``../``, no absolute path).
    Considered and not chosen: loading DCP only from directories "this user's runs created"
    (ownership says nothing about a directory copied with ``cp -r``), and writing a second,
    safetensors copy of every FSDP checkpoint for `generate` (a second model on disk per save).
    The price of ours: `SafeReader` overrides one method of torch's ``FileSystemReader`` and
    `SafePlanner` one of ``DefaultLoadPlanner`` (with torch's private ``set_element``); a torch
    release that changes those is caught by tests/test_faults.py's planted pickles and the
    FSDP resume tests.

DeepSpeed ("deepspeed")
    DeepSpeed loads its files with ``torch.load(weights_only=False)``, in its engine (resume)
    and in ``zero_to_fp32`` (`generate`). Before handing a checkpoint to DeepSpeed,
    `check_deepspeed_files` loads every ``.pt`` file under it with ``weights_only=True`` (memory
    mapped: the tensors are not read), allowing besides tensors only the two DeepSpeed types its
    optimizer files hold (`DEEPSPEED_TYPES`). A file that names anything else is refused before
    DeepSpeed reads it; a file that passes names nothing but those, so DeepSpeed's own load of
    it runs no other code.

Any refusal is a `DamagedCheckpoint` naming the file and the name it carries.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ligertune.run.manifest import DamagedCheckpoint

METADATA_FILE = ".metadata"

# (module, name) → object: everything a DCP metadata file may name.
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    # torch pickles a layout as _get_layout("torch.strided"): a look-up in a table of layouts.
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PurePosixPath,  # StorageMeta.checkpoint_id: kept as a plain path
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "Path"): PurePosixPath,
    ("collections", "OrderedDict"): dict,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the names a DCP metadata file holds (the
    "restricting globals" recipe of the `pickle` documentation): anything else, ``os.system``
    included, is refused when the pickle names it, before it could be called."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")
        return found


def read_dcp_metadata(directory: Path) -> dcp_metadata.Metadata:
    """The metadata of the DCP checkpoint in `directory` (``<checkpoint>/dcp``), read without
    running code and checked to name only files inside `directory`. DamagedCheckpoint otherwise."""
    checkpoint = directory.parent
    name = f"{directory.name}/{METADATA_FILE}"
    try:
        with open(directory / METADATA_FILE, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DamagedCheckpoint(checkpoint, f"{name} is missing") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
    ) as e:
        raise DamagedCheckpoint(checkpoint, f"{name} is refused: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise DamagedCheckpoint(checkpoint, f"{name} is not DCP metadata")
    for info in metadata.storage_data.values():
        path = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_name(path):
            raise DamagedCheckpoint(
                checkpoint, f"{name} names the storage file {path!r}, outside {directory.name}/"
            )
    return metadata


def _plain_name(path: Any) -> bool:
    return isinstance(path, str) and len(PurePosixPath(path).parts) == 1 and path not in ("", ".", "..")


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` with the metadata read by `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: a layout we never write
            raise DamagedCheckpoint(Path(self.path).parent, "per-rank DCP metadata is not supported")
        metadata = read_dcp_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` reading the non-tensor values with ``weights_only=True``."""

    def __init__(self, checkpoint: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise DamagedCheckpoint(
                self.checkpoint,
                f"the saved value of {read_item.dest_index.fqn} is refused: it is not plain data "
                "(loading it would run the code it names)",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state: dict[str, Any], directory: Path) -> None:
    """``torch.distributed.checkpoint.load`` of `directory` into `state` (in place), through
    `SafeReader` and `SafePlanner`. The metadata is read once first, so that a refusal is a
    DamagedCheckpoint of its own rather than one wrapped in DCP's per-rank exception."""
    read_dcp_metadata(directory)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        try:
            dcp.load(state, storage_reader=SafeReader(directory), planner=SafePlanner(directory.parent))
        except CheckpointException as e:  # DCP wraps each rank's exception: ours is the message
            refused = [exc for exc, _ in e.failures.values() if isinstance(exc, DamagedCheckpoint)]
            if refused:
                raise refused[0] from None
            raise


# --------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------


def _deepspeed_types() -> list[type]:
    """The DeepSpeed types a ZeRO optimizer file holds: its loss scaler and its stage enum."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, DynamicLossScaler, ZeroStageEnum]


DEEPSPEED_TYPES = ("LossScaler", "DynamicLossScaler", "ZeroStageEnum")


def check_deepspeed_files(checkpoint: Path, directory: Path) -> None:
    """Refuse (DamagedCheckpoint) a DeepSpeed checkpoint folder with a ``.pt`` file that names
    anything but tensors, containers, numbers and `DEEPSPEED_TYPES` (module docstring)."""
    files = sorted(p for p in directory.rglob("*.pt") if p.is_file() and not p.is_symlink())
    if not files:
        raise DamagedCheckpoint(checkpoint, f"{directory.name}/ holds no DeepSpeed files")
    with torch.serialization.safe_globals(_deepspeed_types()):
        for file in files:
            name = file.relative_to(checkpoint).as_posix()
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(file)) or "code"
                raise DamagedCheckpoint(
                    checkpoint,
                    f"{name} is refused: it names {names}, which a DeepSpeed checkpoint does not hold "
                    "(loading it would run that code)",
                ) from None
            except (RuntimeError, OSError, EOFError) as e:
                raise DamagedCheckpoint(checkpoint, f"{name} cannot be loaded: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines() or [type(error).__name__])[0][:300]
