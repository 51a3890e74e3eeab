"""The vocabulary every recipe section and every component's options share: the strict `Section`
base, the model section (a frozen reference or a distillation teacher is one too) and the small
shared value types.

It sits in the catalog, not in `ligertune.config`, because the components' options models
(`ligertune.catalog.objectives`, `ligertune.catalog.strategies`) are built from it and the
recipe schema is built from them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every section. Strict types: YAML already says what type a value is, so ``lr: true``
    or ``packing: 1`` are mistakes to report, not values to coerce (pydantic's default would read
    them as 1.0 and True). An int is still a valid float (``lr: 1``). Infinity and NaN are refused
    wherever a float is expected: no key means anything with them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


# An Adam beta: a decay rate in [0, 1). A YAML list is accepted for the pair (hence not strict on
# the tuple itself), each element strictly a number.
AdamBeta = Annotated[float, Field(strict=True, ge=0.0, lt=1.0)]

# A run name becomes a folder under runs/: one plain path component.
RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
# A hub repository id: owner/name, each a plain name.
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

# Short names accepted in `plugins` (each stands for a function of `ligertune.training.transforms`).
BUILTIN_PLUGINS = ("liger",)


class ModelSection(Section):
    name_or_path: str | None = Field(
        None, description="Hub id (meta-llama/Meta-Llama-3-8B) or local directory with weights to fine-tune."
    )
    config: str | dict[str, Any] | None = Field(
        None,
        description="Random-init architecture instead of weights: a shipped name (llama3-8b, llama3.2-1b, "
        "qwen2.5-7b, gemma2-2b, ...) or a transformers config mapping with model_type.",
    )
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Config fields to change after loading, e.g. {num_hidden_layers: 2}.",
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"] = Field(
        "auto",
        description="Attention backend. auto: flash_attention_2 on CUDA when flash-attn is installed, else "
        "flex_attention on CUDA with packed rows (skips cross-sample blocks), else sdpa; the start log "
        "says which.",
    )
    router_aux_loss: bool | None = Field(
        None,
        description="Mixture-of-experts models: add the router's load-balancing loss, times the config's "
        "router_aux_loss_coef (change it with model.config_overrides), to the training loss, as transformers "
        "does with output_router_logits; in SFT, weighted by each micro-batch's share of the window's label "
        "tokens (docs/moe.md). Unset: on for a model with a router, whatever its config says; false: off. A dense "
        "model refuses true.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom modeling code from the hub repository.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the weights.")
    quantize: Literal["none", "4bit", "8bit"] = Field(
        "none",
        description="Load the frozen base weights quantised by bitsandbytes (QLoRA; needs a lora section, a "
        "GPU and pip install 'ligertune[qlora]'): 4bit is NF4 with double quantisation and bf16 compute, "
        "8bit is LLM.int8(). The embeddings, norms and lm_head stay in the training precision.",
    )

    freeze: list[Literal["vision", "projector", "language_model"]] = Field(
        default_factory=list,
        description="Vision-language models: parts whose weights do not train: vision (the vision tower "
        "without its projector), projector (vision features → language model), language_model.",
    )

    def source_problem(self, key: str) -> str | None:
        """Why this section names no model, or names two (`key`: its dotted place in the recipe)."""
        if (self.name_or_path is None) == (self.config is None):
            return f"{key}: set exactly one of name_or_path (weights) or config (random init)"
        return None
