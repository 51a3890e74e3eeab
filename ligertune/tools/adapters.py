"""A LoRA run's model outside training: its base rebuilt from the recipe, its adapter loaded and
merged, for `generate`, `merge` and `export`.

A LoRA export (``final/``) holds the adapter in peft's format and the tokenizer, not the base:
the base is what the run's recipe builds (the same pretrained weights, or the same seeded random
init). That recipe is the export's own ``recipe.yaml`` (written since exports carry it), else the
newest checkpoint's of the run the folder belongs to; without either, peft's
``base_model_name_or_path`` (a hub id or a folder) names the base. A LoRA checkpoint holds the
adapters only: `adapt_for_checkpoint` wraps the rebuilt base as training did, so the checkpoint's
keys load into it.

The base is built in fp32 on the CPU without quantisation (``model.quantize`` needs CUDA and
bitsandbytes; a QLoRA adapter then merges into the unquantised weights, which differ from the 4-bit
ones it trained against by their rounding), and the merge is peft's own (``merge_and_unload``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ligertune.config import Recipe, load_recipe
from ligertune.errors import DataError, RecipeError, UsageError
from ligertune.lora import apply_lora
from ligertune.models.build import build_model
from ligertune.run.checkpoint import CheckpointManager


def rebuild_overrides(trust_remote_code: bool) -> list[str]:
    """How a run's model is rebuilt outside training: fp32 on the CPU, as generate has always
    loaded it, with ``model.trust_remote_code`` the command line's (`trust_remote_code`), never the
    stored recipe's: a recipe that came with a run directory cannot let its model's code run."""
    return [
        "training.precision=fp32",
        "training.device=cpu",
        "model.quantize=none",
        f"model.trust_remote_code={str(trust_remote_code).lower()}",
    ]


class AdapterError(UsageError):
    """An adapter that cannot be loaded, in one line."""


def is_adapter(directory: Path) -> bool:
    return (directory / "adapter_config.json").is_file()


def recipe_of(directory: Path) -> Path | None:
    """The recipe that trained the model in `directory` (an export, an adapter or a run folder):
    its own ``recipe.yaml``, else the newest checkpoint's of the run it belongs to."""
    if (directory / "recipe.yaml").is_file():
        return directory / "recipe.yaml"
    for run in (directory, directory.parent):
        latest = CheckpointManager(run / "checkpoints", keep_last=1).latest()
        if latest is not None:
            return latest / "recipe.yaml"
    return None


def rebuild_recipe(path: Path, trust_remote_code: bool = False) -> Recipe:
    """A run's saved recipe, read to rebuild its model (`rebuild_overrides`)."""
    try:
        return load_recipe(path, rebuild_overrides(trust_remote_code))
    except RecipeError as e:
        raise AdapterError(f"cannot rebuild the model from {path}: {'; '.join(e.problems)}") from None


def load_adapted(adapter: Path, trust_remote_code: bool = False) -> tuple[nn.Module, object]:
    """(the base with the adapter in `adapter` merged into it, on the CPU in fp32; the tokenizer).
    `trust_remote_code`: the command line's, for the base's and the tokenizer's own code."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe_path = recipe_of(adapter)
    try:
        if recipe_path is not None:
            recipe = rebuild_recipe(recipe_path, trust_remote_code)
            torch.manual_seed(recipe.seed)
            base = build_model(recipe, torch.device("cpu"))
        else:
            name = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if not name:
                raise AdapterError(
                    f"{adapter}: an adapter without the recipe that trained it (recipe.yaml) nor a base model "
                    "in its adapter_config.json; generate from the run directory instead"
                )
            base = AutoModelForCausalLM.from_pretrained(
                name, dtype=torch.float32, trust_remote_code=trust_remote_code
            )
        tokenizer = AutoTokenizer.from_pretrained(adapter, trust_remote_code=trust_remote_code)
        model = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    except (OSError, ValueError, RecipeError, DataError) as e:
        detail = "; ".join(e.problems) if isinstance(e, RecipeError) else str(e).strip().splitlines()[0]
        raise AdapterError(f"cannot load the adapter in {adapter}: {detail}") from None
    return model, tokenizer


def adapt_for_checkpoint(model: nn.Module, recipe: Recipe) -> nn.Module:
    """A rebuilt base wrapped with the recipe's LoRA adapters as training wrapped it, so that a
    LoRA checkpoint's keys (adapters only) load into it."""
    adapted, _ = apply_lora(model, recipe)
    return adapted
