"""The Hugging Face Hub before a run: `download` what a recipe needs (on a login node with
network, before the job goes to nodes without). The upload after a run
(``export.push_to_hub``) is `ligertune.training.export.push_to_hub`: the loop calls it, and
the loop's layer may not import this one.

Both go through ``huggingface_hub`` and ``datasets`` as they are configured (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, the token from ``HF_TOKEN`` or ``hf auth login``); nothing
is cached or authenticated our own way. Every failure (offline mode, no network, no token, no
access, a missing repository) is one line, `HubError`, naming the recipe key involved: the
libraries' own messages span many lines and name URLs rather than what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ligertune.config import Recipe
from ligertune.data.sources import source_specs
from ligertune.errors import ExternalError
from ligertune.paths import looks_local

# Weight formats no transformers load reads when safetensors are present: skipped in a download
# (Llama 3 repositories carry a second, consolidated copy of the weights under original/).
_OTHER_WEIGHTS = ["original/*", "*.pth", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "*.tflite"]
# What a tokenizer is made of, for a tokenizer repository other than the model's.
_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


class HubError(ExternalError):
    """A hub operation that failed, in one line naming the recipe key."""


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text[:300] + ("..." if len(text) > 300 else "")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _failure(key: str, what: str, error: BaseException) -> HubError:
    reason = (
        "offline mode is on (HF_HUB_OFFLINE=1)"
        if _offline()
        else f"{type(error).__name__}: {_first_line(error)}"
    )
    return HubError(f"{key}: {what} failed: {reason}")


# --------------------------------------------------------------------------------------------
# Download
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Downloaded:
    key: str  # the recipe key that names it
    name: str  # hub id
    where: str  # the local snapshot folder, or the datasets cache


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and not looks_local(name)


def _model_patterns(repo_id: str, revision: str | None) -> list[str]:
    """What to leave out of a model download: other weight formats, and the PyTorch .bin
    weights when the repository also has safetensors (transformers then reads those only)."""
    from huggingface_hub import HfApi

    files = HfApi().list_repo_files(repo_id, revision=revision)
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    return _OTHER_WEIGHTS + (["*.bin"] if has_safetensors else [])


def download(recipe: Recipe, report=lambda line: None) -> list[Downloaded]:
    """Fetch into the Hugging Face cache everything of `recipe` that comes from the hub: the
    model repository (weights, config, tokenizer) at ``model.revision``, a tokenizer repository
    of its own, and each hub dataset (``datasets.load_dataset``, every split, so ``train`` reads it
    offline). Local paths and random-init models need nothing. `report` gets a line per item as
    it is done."""
    from huggingface_hub import snapshot_download

    done: list[Downloaded] = []
    model = recipe.model
    if _is_hub_id(model.name_or_path):
        try:
            # Offline, a cached snapshot is still found (and is all there is to find).
            ignore = _OTHER_WEIGHTS if _offline() else _model_patterns(model.name_or_path, model.revision)
            where = snapshot_download(model.name_or_path, revision=model.revision, ignore_patterns=ignore)
        except Exception as e:
            raise _failure("model.name_or_path", f"downloading {model.name_or_path!r}", e) from None
        done.append(Downloaded("model.name_or_path", model.name_or_path, where))
        report(f"model.name_or_path {model.name_or_path}: {where}")
    tokenizer = recipe.tokenizer.name_or_path
    if _is_hub_id(tokenizer) and tokenizer != model.name_or_path:
        try:
            where = snapshot_download(tokenizer, allow_patterns=_TOKENIZER_FILES)
        except Exception as e:
            raise _failure("tokenizer.name_or_path", f"downloading {tokenizer!r}", e) from None
        done.append(Downloaded("tokenizer.name_or_path", tokenizer, where))
        report(f"tokenizer.name_or_path {tokenizer}: {where}")
    seen = set()
    for spec in source_specs(recipe):
        if spec.local is not None or (spec.path, spec.subset) in seen:
            continue
        seen.add((spec.path, spec.subset))
        where = _download_dataset(spec.key, spec.path, spec.subset)
        done.append(Downloaded(spec.key, spec.path, where))
        report(f"{spec.key} {spec.path}{f' ({spec.subset})' if spec.subset else ''}: {where}")
    return done


def _download_dataset(key: str, path: str, subset: str | None) -> str:
    import datasets
    from datasets import config as datasets_config

    if _offline():  # datasets would fall back to a cache that may not exist, with a long traceback
        raise HubError(
            f"{key}: downloading the dataset {path!r} failed: offline mode is on (HF_HUB_OFFLINE=1)"
        )
    try:
        loaded = datasets.load_dataset(path, subset)
    except Exception as e:
        raise _failure(key, f"downloading the dataset {path!r}", e) from None
    files = [f["filename"] for split in loaded.values() for f in split.cache_files]
    return str(Path(files[0]).parent) if files else str(datasets_config.HF_DATASETS_CACHE)
