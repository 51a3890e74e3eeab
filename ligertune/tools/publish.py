"""`ligertune merge` and `ligertune export`: a trained model written out after training.

`merge` turns a LoRA run (or an adapter folder) into a plain Hugging Face model: the base its
recipe builds with the adapter merged by peft (`ligertune.tools.adapters`), what
``export.merge_lora`` does at the end of training, for a run that did not ask for it then.

`export` writes any model `generate` can load (a run's export or newest checkpoint, a LoRA
adapter, a model folder) as safetensors with its config, tokenizer and the run's recipe, in a
chosen dtype, and uploads the folder with ``--push-to-hub`` (`ligertune.training.export.push_to_hub`:
HF_TOKEN or ``hf auth login``; offline or without a token it fails before hashing anything, and
the folder stays on disk).

Both write through `ligertune.run.checkpoint.atomic_directory` (a temporary folder renamed into
place) and never replace an existing folder unless asked (``--force``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from ligertune.errors import UsageError
from ligertune.run.checkpoint import atomic_directory
from ligertune.tools.adapters import is_adapter, recipe_of
from ligertune.tools.generate import GenerateError, Source, load_for_generation, resolve_source
from ligertune.training.export import merged_directory

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class PublishError(UsageError):
    """What merge or export cannot do, in one line (the CLI exits 2)."""


@dataclass(frozen=True)
class Written:
    directory: Path
    source: Source
    dtype: torch.dtype


def adapter_source(run_or_adapter: str) -> tuple[Source, Path]:
    """The LoRA adapter (or LoRA checkpoint) a merge reads, and where its merged model goes by
    default: beside the adapter as ``<adapter>-merged`` (``final-merged`` for a run's ``final``)."""
    path = Path(run_or_adapter).expanduser()
    for adapter in (path, path / "final"):
        if is_adapter(adapter):
            return Source(str(adapter), adapter=adapter, recipe=recipe_of(adapter)), merged_directory(adapter)
    if not path.is_dir():
        raise PublishError(f"{run_or_adapter}: no such run or adapter directory")
    source = _resolve(str(path))
    if source.checkpoint is None or not _trained_lora(source.recipe):
        raise PublishError(
            f"{path} is neither a LoRA adapter (adapter_config.json) nor a LoRA run (final/ or a checkpoint "
            "of a recipe with a lora section); a full fine-tune's export is already a plain model: "
            "use ligertune export"
        )
    return source, path / "final-merged"


def _trained_lora(recipe: Path | None) -> bool:
    """Whether the saved recipe has a lora section (read as YAML: its files need not exist here)."""
    if recipe is None or not recipe.is_file():
        return False
    return bool((yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("lora"))


def merge(run_or_adapter: str, out: Path | None = None, force: bool = False) -> Written:
    """Merge a LoRA run's adapter into its base and write the plain model (see the module docstring)."""
    source, default = adapter_source(run_or_adapter)
    model, tokenizer = _load(source)
    return _write(model, tokenizer, source, out or default, None, force)


def export(run_or_model: str, out: Path, dtype: str = "auto", force: bool = False) -> Written:
    """Write the model `run_or_model` names to `out` as safetensors in `dtype` (``auto``: the dtype
    it was trained and saved in)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise PublishError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    source = _resolve(run_or_model)
    model, tokenizer = _load(source)
    return _write(model, tokenizer, source, out, DTYPES.get(dtype), force)


def _resolve(run_or_model: str) -> Source:
    try:
        return resolve_source(run_or_model)
    except GenerateError as e:
        raise PublishError(str(e)) from None


def _load(source: Source) -> tuple[nn.Module, object]:
    """The model on the CPU (a merge or an export needs no GPU), weights in fp32 where it had to
    be rebuilt, else as saved."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return load_for_generation(source, torch.device("cpu"))
    except GenerateError as e:
        raise PublishError(str(e)) from None
    finally:
        hf_logging.enable_progress_bar()


def _write(
    model: nn.Module, tokenizer, source: Source, out: Path, dtype: torch.dtype | None, force: bool
) -> Written:
    if out.exists() and not force:
        raise PublishError(f"{out} exists; choose another --out, or --force to replace it")
    if dtype is None:  # the dtype of the weights as trained (a rebuilt model is fp32 on the CPU)
        dtype = _trained_dtype(model)
    from transformers.utils import logging as hf_logging

    model = model.to(dtype)
    model.config.use_cache = True
    hf_logging.disable_progress_bar()  # "Writing model shards" around a one-line report
    try:
        with atomic_directory(out) as tmp:  # replaces `out` (with --force) in one rename
            model.save_pretrained(tmp)  # safetensors, transformers' default
            tokenizer.save_pretrained(tmp)
            if source.recipe is not None and source.recipe.is_file():
                shutil.copyfile(source.recipe, tmp / "recipe.yaml")
    finally:
        hf_logging.enable_progress_bar()
    return Written(out, source, dtype)


def _trained_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the config records (what the run trained in), else the weights' own."""
    recorded = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) else next(model.parameters()).dtype
