"""The end of a run: the trained model written as a plain Hugging Face model."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ligertune.distributed import Runtime
from ligertune.run.checkpoint import atomic_directory


def export_hf(model: nn.Module, tokenizer, runtime: Runtime, directory: Path) -> Path:
    """Save weights (safetensors), config and tokenizer so that plain
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads the trained model. Weights are
    written in their training dtype (fp32 for ``bf16-mixed``), so the export is exact."""
    from transformers.utils import logging as hf_logging

    state = runtime.full_model_state_dict(model)
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
    runtime.barrier()
    return directory
