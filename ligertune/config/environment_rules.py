"""The rules that need more than the recipe: *model* rules read the model's files or
transformers' list of architectures (so `validate` and `train` refuse an unknown model type or
custom code before any model work), *machine* rules need the machine the run goes on (is CUDA
there). Registered in `ligertune.config.rules`, which lists them with the others, in this order.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ligertune.catalog.rules import runs_on_cuda
from ligertune.errors import RecipeError
from ligertune.models.config import build_config, config_problems
from ligertune.paths import looks_local

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe


# --------------------------------------------------------------------------------------------
# Model rules
# --------------------------------------------------------------------------------------------


def _local_model_config(recipe: Recipe) -> tuple[Path | None, dict | None, list[str]]:
    """A local ``model.name_or_path``'s config.json: (its path, its content, problems reading it).
    (None, None, []) for a hub id or a random-init model: there is nothing local to read."""
    name = recipe.model.name_or_path
    if name is None or not looks_local(name):
        return None, None, []
    directory = recipe.resolve(name)
    if not directory.exists():
        return None, None, []  # files.exist has said so
    config_file = directory / "config.json"
    if not config_file.is_file():
        return (
            None,
            None,
            [f"model.name_or_path: {directory} is not a Hugging Face model folder (no config.json in it)"],
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, None, [f"model.name_or_path: cannot read {config_file} as JSON: {e}"]
    if not isinstance(config, dict):
        return None, None, [f"model.name_or_path: {config_file} must hold a JSON object"]
    return config_file, config, []


def _unknown_model_type(model_type: str) -> str | None:
    """Why transformers cannot build `model_type` (naming the closest ones it knows), or None."""
    import transformers
    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type in known:
        return None
    close = difflib.get_close_matches(model_type, known, n=3, cutoff=0.5)
    hint = f"; closest known: {', '.join(close)}" if close else ""
    return f"model_type {model_type!r} is not one transformers {transformers.__version__} knows{hint}"


def _known_type(model_type: object) -> bool:
    return isinstance(model_type, str) and _unknown_model_type(model_type) is None


def _model_type_known(recipe: Recipe) -> list[str]:
    """The model's model_type is one the installed transformers knows, or its own code is trusted.

    A local model whose model_type transformers knows loads with transformers' class even when
    its config.json also names custom code (auto_map), as transformers itself does without
    trust_remote_code: that class is also the one our kernels know how to patch."""
    config = recipe.model.config
    if isinstance(config, dict) and isinstance(config.get("model_type"), str):
        problem = _unknown_model_type(config["model_type"])
        return [f"model.config.model_type: {problem}"] if problem else []
    config_file, local, problems = _local_model_config(recipe)
    if local is None:
        return problems
    model_type = local.get("model_type")
    problem = _unknown_model_type(model_type) if isinstance(model_type, str) else None
    if "auto_map" in local and (problem or model_type is None):
        if recipe.model.trust_remote_code:
            return []
        return [
            f"model.trust_remote_code: {config_file} needs the custom modeling code it names (auto_map), "
            "which runs only with model.trust_remote_code=true; set it if you trust that code"
        ]
    if problem:
        return [
            f"model.name_or_path: {config_file}: {problem}; a model with its own code needs auto_map in "
            "config.json and model.trust_remote_code=true"
        ]
    return []


def _config_builds(recipe: Recipe) -> list[str]:
    """model.config and model.config_overrides build a transformers config with positive sizes (a hub model: at train)."""
    if recipe.model.name_or_path is not None and not looks_local(recipe.model.name_or_path):
        return []  # a hub id: its config needs the hub; `validate --check` and `train` build it
    if _model_type_known(recipe):
        return []  # model.type_known has said what is wrong
    _, local, _ = _local_model_config(recipe)
    if local is not None and "auto_map" in local and not _known_type(local.get("model_type")):
        return []  # its own config class: building it would run the model's code, which train does
    key = "model.config_overrides" if recipe.model.config_overrides else "model.config"
    try:
        config = build_config(recipe)
    except RecipeError as e:
        return e.problems
    except Exception as e:  # transformers' validation of the config's fields, in its own words
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return [f"{key}: transformers refuses the config: {lines[-1] if lines else type(e).__name__}"]
    return config_problems(config, key)


# --------------------------------------------------------------------------------------------
# Machine rules
# --------------------------------------------------------------------------------------------


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_available(recipe: Recipe) -> list[str]:
    """training.device cuda needs a CUDA GPU that torch sees."""
    if recipe.training.device == "cuda" and not cuda_available():
        return [
            "training.device: cuda was asked for but torch sees no CUDA GPU; use training.device=cpu "
            "(slow, for testing) or check the driver and the torch build (`ligertune env`)"
        ]
    return []


def _fp32_on_cpu(recipe: Recipe) -> list[str]:
    """A run on the CPU trains in fp32."""
    precision = recipe.training.precision
    if precision != "fp32" and recipe.training.device != "cuda" and not runs_on_cuda(recipe):
        return [
            f"training.precision: {precision} on CPU is not supported (slow, and Triton's CPU interpreter gets "
            "bf16 arithmetic wrong); set training.precision=fp32"
        ]
    return []


def _quantize_on_cuda(recipe: Recipe) -> list[str]:
    """model.quantize runs on CUDA only, with bitsandbytes installed (a machine rule: it installs on GPU machines)."""
    quantize = recipe.model.quantize
    if quantize == "none":
        return []
    if not runs_on_cuda(recipe):
        return [
            f"model.quantize: {quantize} (bitsandbytes) runs on CUDA only; set model.quantize=none to train "
            "LoRA on the CPU"
        ]
    if importlib.util.find_spec("bitsandbytes") is None:
        return [
            f"model.quantize: {quantize} needs bitsandbytes, which is not installed; install it with: "
            "pip install 'ligertune[qlora]'"
        ]
    return []


def _flash_attention_on_cuda(recipe: Recipe) -> list[str]:
    """flash_attention_2 runs on CUDA only."""
    if recipe.model.attn_implementation == "flash_attention_2" and not runs_on_cuda(recipe):
        return ["model.attn_implementation: flash_attention_2 runs on CUDA only; use auto or sdpa on CPU"]
    return []


# --------------------------------------------------------------------------------------------
# Machine advice: what runs here but cannot help, said before the run spends the time
# --------------------------------------------------------------------------------------------


def machine_warnings(recipe: Recipe) -> list[str]:
    """Settings that run on this machine but only slowly and for nothing, one line each, for the
    start of `train` (warnings, so ``-q`` shows them). Not refused: the tests and a user checking
    the path on a laptop run them on purpose; the line says what it costs and what to set."""
    if runs_on_cuda(recipe):
        return []
    warnings = []
    if recipe.training.fp8 != "none":
        warnings.append(
            f"training.fp8: {recipe.training.fp8} on the CPU is emulated by torchao: many times slower than "
            "fp32 and it speeds nothing up (FP8 matmuls need an H100-class GPU); set training.fp8=none "
            "unless you are testing the FP8 path"
        )
    if recipe.parallel.cpu_warning:
        warnings.append(
            f"parallel.strategy: {recipe.parallel.strategy} on the CPU {recipe.parallel.cpu_warning}"
        )
    return warnings


# (rule name, phase, check), in the order `ligertune.config.rules` registers them.
ENVIRONMENT_RULES = [
    ("model.type_known", "model", _model_type_known),
    ("model.config_builds", "model", _config_builds),
    ("training.device_available", "machine", _device_available),
    ("training.fp32_on_cpu", "machine", _fp32_on_cpu),
    ("model.quantize_on_cuda", "machine", _quantize_on_cuda),
    ("model.flash_attention_on_cuda", "machine", _flash_attention_on_cuda),
]
