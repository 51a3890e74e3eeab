"""The end of a run: the trained model written as a plain Hugging Face model, and uploaded to the
hub when the recipe asks (``export.push_to_hub``)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
from torch import nn

from ligertune.config import recipe_to_yaml
from ligertune.config.schema import ExportSection
from ligertune.distributed import Runtime
from ligertune.errors import TrainingError
from ligertune.files import describe_os_error
from ligertune.lora import is_adapted, merged_state_dict, save_adapter
from ligertune.models.build import auto_class
from ligertune.run.checkpoint import atomic_directory


def export_hf(
    model: nn.Module,
    tokenizer,
    runtime: Runtime,
    directory: Path,
    *,
    merge: bool = False,
    recipe_yaml: str | None = None,
) -> Path:
    """Save weights (safetensors), config and tokenizer so that plain
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads the trained model. Weights are
    written in their training dtype (fp32 for ``bf16-mixed``), so the export is exact.

    A LoRA run (a peft model) writes the adapter instead (`_export_lora`), and with `merge`
    (``export.merge_lora``) a merged plain model beside it. `recipe_yaml`, the run's recipe, goes
    along as ``recipe.yaml``: what rebuilds a LoRA adapter's base, and the data format that
    `ligertune generate` prompts in.

    Written atomically (`atomic_directory`, which replaces a link in the export's place rather
    than writing through it); a folder that cannot be written is a `TrainingError` of one line:
    the run is complete and checkpointed, so a resume after the fix only exports."""
    try:
        return _export(model, tokenizer, runtime, directory, merge, recipe_yaml)
    except OSError as e:
        raise TrainingError(
            f"cannot write the export {directory}: {describe_os_error(e)}; the run's last checkpoint is "
            "kept: fix that and resume (a resumed complete run only exports)"
        ) from e


def _export(
    model: nn.Module, tokenizer, runtime: Runtime, directory: Path, merge: bool, recipe_yaml: str | None
) -> Path:
    from transformers.utils import logging as hf_logging

    state = runtime.full_model_state_dict(model)
    if is_adapted(runtime.unwrap(model)):
        return _export_lora(model, tokenizer, runtime, directory, state, merge, recipe_yaml)
    if runtime.is_main:
        hf_model = runtime.unwrap(model)
        with atomic_directory(directory) as tmp:
            # Inference wants its KV cache back; training had it off. The shard progress bar
            # would only clutter the run log.
            hf_model.config.use_cache = True
            hf_logging.disable_progress_bar()
            try:
                hf_model.save_pretrained(tmp, state_dict=state)
            finally:
                hf_model.config.use_cache = False
                hf_logging.enable_progress_bar()
            tokenizer.save_pretrained(tmp)
            _write_recipe(tmp, recipe_yaml)
    runtime.barrier()
    return directory


def _write_recipe(directory: Path, recipe_yaml: str | None) -> None:
    if recipe_yaml is not None:
        (directory / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")


def merged_directory(directory: Path) -> Path:
    """Where ``export.merge_lora`` writes the merged model: ``final-merged`` beside ``final``."""
    return directory.with_name(f"{directory.name}-merged")


def _export_lora(
    model, tokenizer, runtime: Runtime, directory: Path, state: dict, merge: bool, recipe_yaml: str | None
) -> Path:
    """`directory`: the adapter in peft's format plus the tokenizer
    (``PeftModel.from_pretrained(base, directory)``); with `merge`, `merged_directory`: a plain
    Hugging Face model with the adapters merged in (`ligertune.lora.merged_state_dict`), which
    loads with ``AutoModelForCausalLM.from_pretrained`` alone. The merged weights are loaded
    strictly into a fresh model of the base's config first, so a key that is not a plain model's
    fails here and not at the user's load. Without quantisation config: the merged model is
    written in the training dtype (bf16 for a 4-bit base, dequantised)."""
    from transformers.utils import logging as hf_logging

    if runtime.is_main:
        peft_model = runtime.unwrap(model)
        hf_logging.disable_progress_bar()
        try:
            with atomic_directory(directory) as tmp:
                save_adapter(peft_model, state, tmp)
                tokenizer.save_pretrained(tmp)
                _write_recipe(tmp, recipe_yaml)
            if merge:
                config = copy.deepcopy(peft_model.get_base_model().config)
                config.use_cache = True
                if hasattr(config, "quantization_config"):
                    del config.quantization_config
                merged = merged_state_dict(peft_model, state)
                with torch.device("meta"):
                    plain = auto_class(config).from_config(config)
                plain.load_state_dict(merged, strict=True, assign=True)
                plain.tie_weights()
                with atomic_directory(merged_directory(directory)) as tmp:
                    plain.save_pretrained(tmp)
                    tokenizer.save_pretrained(tmp)
                    _write_recipe(tmp, recipe_yaml)
        finally:
            hf_logging.enable_progress_bar()
    runtime.barrier()
    return directory


def export_run(model: nn.Module, tokenizer, runtime: Runtime, recipe, log) -> Path:
    """The finished run's Hugging Face export (``final/``, see `export_hf`) and its upload
    (``export.push_to_hub``), each with a line in the run's log."""
    started = time.perf_counter()
    directory = export_hf(
        model,
        tokenizer,
        runtime,
        recipe.run_dir / "final",
        merge=recipe.export.merge_lora,
        recipe_yaml=recipe_to_yaml(recipe),
    )
    log(f"exported the model in Hugging Face format to {directory} in {time.perf_counter() - started:.1f} s")
    pushed = push_export(directory, recipe.export, runtime)
    if pushed:
        log(f"uploaded the export to {pushed}")
    return directory


def push_export(directory: Path, export: ExportSection, runtime: Runtime) -> str | None:
    """Upload the export folder to ``export.push_to_hub`` from the main rank (the others have
    nothing to do and wait in no collective). Returns the repository URL; None when no push is
    asked for, and on the other ranks."""
    if not export.push_to_hub or not runtime.is_main:
        return None
    return push_to_hub(directory, export.push_to_hub, private=export.private)


def push_to_hub(directory: Path, repo_id: str, private: bool = True) -> str:
    """Upload a folder to the model repository `repo_id` (created, `private` or not, when it
    does not exist; an existing one gets a new commit) through ``huggingface_hub``, configured
    as usual (``HF_TOKEN`` or ``hf auth login``, ``HF_HUB_OFFLINE``). Returns the repository URL.

    Offline mode and a missing token are checked first, without the network: an anonymous
    upload can only fail, after the folder was hashed. Any failure is a `TrainingError` of one
    line naming ``export.push_to_hub`` and where the export is (it stays on disk: the library's
    own messages span lines and name URLs, not the key to change)."""
    from huggingface_hub import HfApi, constants, get_token

    key, kept = "export.push_to_hub", f"; the export is saved in {directory}"
    if constants.HF_HUB_OFFLINE:
        raise TrainingError(f"{key}: cannot upload to {repo_id}: offline mode is on (HF_HUB_OFFLINE=1){kept}")
    if get_token() is None:
        raise TrainingError(
            f"{key}: cannot upload to {repo_id}: no Hugging Face token (set HF_TOKEN or run `hf auth login`){kept}"
        )
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=str(directory),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload from ligertune",
        )
    except Exception as e:  # network, authentication, permissions: one line for each
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TrainingError(
            f"{key}: upload to {repo_id} failed: {type(e).__name__}: {reason}{kept}"
        ) from None
    return str(url)
