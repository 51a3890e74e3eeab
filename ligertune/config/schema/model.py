"""What to train and how: the model, tokenizer, LoRA adapters and the training objective.

`ObjectiveSection` sits beside `ModelSection`: its reference and teacher models are `ModelSection`s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ligertune.config.schema.base import Section


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
    trust_remote_code: bool = Field(False, description="Allow custom modeling code from the hub repository.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the weights.")
    quantize: Literal["none", "4bit", "8bit"] = Field(
        "none",
        description="Load the frozen base weights quantised by bitsandbytes (QLoRA; needs a lora section, a "
        "GPU and pip install 'ligertune[qlora]'): 4bit is NF4 with double quantisation and bf16 compute, "
        "8bit is LLM.int8(). The embeddings, norms and lm_head stay in the training precision.",
    )


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
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full besides the adapters and saved with them, e.g. [embed_tokens, "
        "lm_head] for new tokens.",
    )
    use_dora: bool = Field(False, description="DoRA: also train a per-output-row magnitude (peft use_dora).")
    use_rslora: bool = Field(False, description="Rank-stabilised scale alpha/√r instead of alpha/r.")


class ObjectiveSection(Section):
    """The training objective (ligertune/objectives/). Absent: sft. dpo, orpo and simpo train on
    data.format preference, kto on kto; sft and distill on the other formats."""

    name: Literal["sft", "dpo", "orpo", "simpo", "kto", "distill"] = Field(
        "sft", description="sft, dpo (with loss_type), orpo, simpo, kto, or distill (from objective.teacher)."
    )
    beta: float | None = Field(
        None,
        gt=0,
        description="Strength: dpo/kto β (default 0.1), orpo λ (0.1), simpo β (2.0).",
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="dpo: sigmoid (DPO), ipo (IPO, on mean token log-probs) or hinge (SLiC)."
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo sigmoid / simpo: assumed fraction of flipped labels (cDPO)."
    )
    reference: Literal["frozen", "precomputed", "none"] | None = Field(
        None,
        description="dpo/kto reference log-probs: frozen (a frozen copy of reference_model, or with lora "
        "the policy with its adapters off), precomputed (data columns ref_chosen_logps/ref_rejected_logps, "
        "kto: ref_logps/ref_kl_logps) or none (reference-free). Default frozen; orpo/simpo use none.",
    )
    reference_model: ModelSection | None = Field(
        None, description="The frozen reference (default: the model section, i.e. the starting weights)."
    )
    gamma_beta_ratio: float = Field(0.5, ge=0.0, description="simpo: target margin γ as a fraction of β.")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of desirable examples' losses.")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of undesirable examples' losses.")
    teacher: ModelSection | None = Field(
        None, description="distill: the frozen teacher (same vocabulary), as a model section."
    )
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = Field(
        "forward_kl", description="distill: KL(teacher‖student), KL(student‖teacher) or the generalised JSD."
    )
    temperature: float = Field(1.0, gt=0, description="distill: softmax temperature T of both models.")
    jsd_beta: float = Field(0.5, gt=0, lt=1, description="distill jsd: mixture weight β of the teacher.")
    ce_weight: float = Field(
        0.5, ge=0, le=1, description="distill: α in α·CE(labels) + (1 − α)·T²·divergence."
    )

    @property
    def strength(self) -> float:
        """beta, or the objective's default."""
        return self.beta if self.beta is not None else {"simpo": 2.0}.get(self.name, 0.1)

    @property
    def reference_kind(self) -> str:
        """reference, or the objective's default: frozen for dpo and kto, none otherwise."""
        if self.reference is not None:
            return self.reference
        return "frozen" if self.name in ("dpo", "kto") else "none"
