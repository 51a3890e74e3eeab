"""What to train: the model (`ModelSection`, from the catalog: objectives name models too), the
tokenizer and LoRA adapters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ligertune.catalog.section import ModelSection, Section


class TokenizerSection(Section):
    name_or_path: str | None = Field(
        None, description="Hub id or local directory; defaults to model.name_or_path."
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's own (chat format only)."
    )
    pad_token: str | None = Field(
        None, description="Pad token to set when the tokenizer has none (default: EOS)."
    )


class LoraSection(Section):
    """LoRA adapters through peft: every base weight frozen, W·x + (alpha/r)·B·A·dropout(x) on the target
    linear layers, only A and B (and modules_to_save) trained."""

    r: int = Field(16, gt=0, le=2**16, description="Rank of the adapters (A is r × in, B is out × r).")
    alpha: float = Field(
        32, gt=0, description="Scale numerator: the update is (alpha/r)·B·A (alpha/√r with use_rslora)."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (not the base path)."
    )
    target_modules: Literal["all-linear"] | Annotated[list[str], Field(min_length=1)] = Field(
        "all-linear",
        description="Linear layers that get an adapter, by name (q_proj, v_proj, gate_proj, ...; lm_head "
        "for an adapter on the output layer), or all-linear: every linear layer but the lm_head.",
    )
    target_parameters: Literal["experts"] | Annotated[list[str], Field(min_length=1)] | None = Field(
        None,
        description="Mixture-of-experts weights that get an adapter (peft target_parameters; axolotl's "
        "lora_target_parameters): experts for both of the routed experts' 3-D weights, or a list of them "
        "(gate_up_proj, down_proj), one adapter per expert of every MoE layer. Needs dropout 0; no DoRA, "
        "no model.quantize. Unset: the experts stay frozen.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full besides the adapters and saved with them, e.g. [embed_tokens, "
        "lm_head] for new tokens.",
    )
    use_dora: bool = Field(False, description="DoRA: also train a per-output-row magnitude (peft use_dora).")
    use_rslora: bool = Field(False, description="Rank-stabilised scale alpha/√r instead of alpha/r.")


__all__ = ["LoraSection", "ModelSection", "TokenizerSection"]
