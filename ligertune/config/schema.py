"""The recipe schema: one pydantic model per YAML section, every field typed, defaulted and described.

``docs/recipes.md`` is generated from these models (``python scripts/gen_recipe_docs.py``, checked
by a test). Rules that relate several keys live in `ligertune.config.rules`, not here: a field
validator checks its own value only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ligertune.patching.registry import KERNEL_NAMES, KERNELS
from ligertune.paths import resolve_path


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


# Short names accepted in `plugins`, and the function each stands for.
BUILTIN_PLUGINS = {"liger": "ligertune.patching.liger:apply_liger"}


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


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


DATA_FORMATS = ("alpaca", "chat", "messages", "sharegpt", "prompt_completion", "pretokenized")
DataFormat = Literal["alpaca", "chat", "messages", "sharegpt", "prompt_completion", "pretokenized"]


class DataSource(Section):
    """One dataset of ``data.mix``; unset keys take the data section's value."""

    path: str = Field(description="Hub dataset id, or a local JSON/JSONL/Parquet file or directory.")
    weight: float = Field(
        1.0, gt=0, description="Relative share of the mix's samples (weights need not sum to 1)."
    )
    format: DataFormat | None = Field(None, description="Format of this dataset (default: data.format).")
    subset: str | None = Field(None, description="Hub config/subset (default: data.subset).")
    split: str | None = Field(None, description="Split to train on (default: data.split).")
    messages_field: str | None = Field(None, description="Messages column (default: data.messages_field).")


class DataSection(Section):
    format: DataFormat = Field(
        "alpaca",
        description="alpaca: instruction/input/output; chat (or messages): an OpenAI-style list of "
        "{role, content}; sharegpt: a list of {from, value} (human/gpt/system); prompt_completion: "
        "prompt/completion, loss on the completion; pretokenized: input_ids[/labels].",
    )
    path: str | None = Field(
        None,
        description="Hub dataset id, or a local JSON/JSONL/Parquet file or directory (or set mix instead).",
    )
    subset: str | None = Field(
        None, description="Hub dataset config (subset) name: load_dataset(path, subset)."
    )
    mix: list[DataSource] | None = Field(
        None,
        description="Several datasets instead of path, each {path, weight, format, subset, split, "
        "messages_field}; samples are drawn by weight, seeded (see README).",
    )
    split: str = Field("train", description="Split to train on.")
    validation_split: str | None = Field(
        None, description="Split to evaluate on; when absent, validation_fraction is held out from train."
    )
    validation_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of the training split held out for evaluation."
    )
    max_seq_len: int = Field(
        2048, gt=0, description="Tokens per sequence; longer samples are truncated (and counted)."
    )
    packing: bool = Field(
        True, description="Concatenate samples into max_seq_len rows, attention kept within each sample."
    )
    train_on_inputs: bool = Field(False, description="Also compute the loss on prompt tokens.")
    messages_field: str | None = Field(
        None,
        description="Column holding the conversation (default: messages for chat, conversations for sharegpt).",
    )
    max_samples: int | None = Field(
        None, gt=0, description="Use only the first N samples (after shuffling); with mix: the mix's size."
    )
    shuffle: bool = Field(True, description="Shuffle samples (seeded by the recipe seed).")
    streaming: bool = Field(
        False,
        description="Read and tokenise the data on the fly (load_dataset(streaming=True)) instead of "
        "tokenising it all first; needs training.max_steps.",
    )
    cache: bool = Field(
        True, description="Keep the tokenised samples on disk and reuse them while the inputs are unchanged."
    )
    cache_dir: str | None = Field(
        None,
        description="Where tokenised samples are cached (default: $LIGERTUNE_DATA_CACHE, else "
        "~/.cache/ligertune/datasets).",
    )


class TrainingSection(Section):
    epochs: int = Field(1, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides epochs.")
    micro_batch_size: int = Field(1, gt=0, description="Sequences per forward/backward on each device.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    lr: float = Field(2e-5, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine or linear to min_lr_ratio·lr, or constant."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final lr as a fraction of the peak.")
    weight_decay: float = Field(
        0.0, ge=0.0, description="AdamW weight decay (never applied to norms and biases)."
    )
    adam_betas: tuple[AdamBeta, AdamBeta] = Field(
        (0.9, 0.95), strict=False, description="AdamW beta1, beta2, each in [0, 1)."
    )
    adam_eps: float = Field(1e-8, gt=0, lt=1, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0,
        ge=0,
        description="Clip the global gradient norm to this; 0 or null: no clipping (as in HF Trainer).",
    )
    precision: Literal["bf16", "bf16-mixed", "fp32"] = Field(
        "bf16",
        description="bf16: bf16 weights and optimizer; bf16-mixed: fp32 master weights + bf16 autocast; fp32.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer in backward (non-reentrant)."
    )
    compile: bool = Field(False, description="torch.compile each decoder layer.")
    fp8: Literal["none", "rowwise", "tensorwise"] = Field(
        "none",
        description="FP8 matmuls in the decoder layers' linear layers through torchao (pip install "
        "'ligertune[fp8]'; pays with compile: true on an H100/H200): rowwise or tensorwise scaling.",
    )
    eval_every: int | None = Field(None, gt=0, description="Evaluate on the validation split every N steps.")
    eval_max_batches: int | None = Field(None, gt=0, description="Cap the batches per evaluation.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="NaN/inf loss or grad norm: save the last good state and stop, or skip the step."
    )
    max_skipped_steps: int | None = Field(
        10,
        ge=0,
        description="on_nonfinite=skip: stop as stop does once more steps than this were skipped in the "
        "run, resumes included (null: no limit).",
    )
    max_consecutive_skipped_steps: int | None = Field(
        3,
        gt=0,
        description="on_nonfinite=skip: stop as stop does once more steps than this were skipped in a row "
        "(null: no limit).",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where to train; auto picks CUDA when present."
    )

    @field_validator("max_grad_norm")
    @classmethod
    def _zero_is_no_clipping(cls, value: float | None) -> float | None:
        """0 means no clipping, as HF Trainer users expect; read literally it would scale every
        gradient to zero. Normalised here so every strategy sees one spelling (None)."""
        return None if value == 0 else value


class _KernelSwitches(Section):
    """Methods of `KernelsSection`, whose fields (one bool per kernel) come from the registry."""

    @classmethod
    def preset(cls, name: str) -> KernelsSection:
        """``all``: every kernel at its default (the loss kernel is the fused linear CE);
        ``none``: every kernel off."""
        if name == "all":
            return cls()
        return cls(**dict.fromkeys(KERNEL_NAMES, False))

    def enabled(self) -> list[str]:
        return [k for k in KERNEL_NAMES if getattr(self, k)]


# One field per `ligertune.patching.registry.KERNELS` entry, in its order: adding a kernel to the
# registry adds its recipe key, its documentation line and its command-line spelling.
KernelsSection = create_model(
    "KernelsSection",
    __base__=_KernelSwitches,
    __doc__="Which Triton kernels to patch in: one switch per kernel of the registry.",
    **{k.name: (bool, Field(k.default, description=k.summary)) for k in KERNELS},
)


class FSDPOptions(Section):
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3 style)."
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters and gradients on the CPU.")
    mixed_precision: bool = Field(True, description="bf16 parameters in compute, fp32 gradient reduction.")


class DeepSpeedOptions(Section):
    zero_stage: Literal[1, 2, 3] = Field(3, description="ZeRO stage.")
    offload_optimizer: bool = Field(False, description="Offload optimizer states to the CPU.")
    offload_params: bool = Field(False, description="Offload parameters to the CPU (stage 3).")
    config: str | None = Field(None, description="A DeepSpeed JSON file merged over the generated config.")

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, value):
        """``True == 1`` in Python, so a Literal[1, 2, 3] would read ``zero_stage: true`` as 1."""
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}; allowed: 1, 2 or 3")
        return value


class ParallelSection(Section):
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = Field(
        "none", description="none (one device), ddp, fsdp (FSDP2 fully_shard) or deepspeed (ZeRO)."
    )
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions, description="Options for strategy fsdp.")
    deepspeed: DeepSpeedOptions = Field(
        default_factory=DeepSpeedOptions, description="Options for strategy deepspeed."
    )
    sharded_init: Literal["auto"] | bool = Field(
        "auto",
        description="Build the model empty (meta device), shard it, then fill each rank's shards from "
        "rank 0 (fsdp) or build it inside deepspeed.zero.Init (ZeRO-3), so no GPU holds the whole "
        "model. auto: on for fsdp (without cpu_offload) and deepspeed stage 3 (off with lora); true "
        "elsewhere is an error.",
    )

    @property
    def shards_at_init(self) -> bool:
        """Whether the model is built sharded (``sharded_init`` with ``auto`` resolved)."""
        sharding = self.strategy == "fsdp" or (
            self.strategy == "deepspeed" and self.deepspeed.zero_stage == 3
        )
        if self.sharded_init == "auto":  # not yet with FSDP's CPU offload (docs/distributed.md)
            return sharding and not (self.strategy == "fsdp" and self.fsdp.cpu_offload)
        return bool(self.sharded_init)


class LoggingSection(Section):
    log_every: int = Field(10, gt=0, description="Print and record metrics every N optimizer steps.")
    progress: Literal["auto", "rich", "plain"] = Field(
        "auto", description="auto: a rich progress bar on a terminal, plain lines otherwise."
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers that also receive the metrics, e.g. [tensorboard, wandb]. Each is "
        "an extra (pip install 'ligertune[wandb]'); a selected one that is not installed is a recipe error.",
    )
    run_name: str | None = Field(
        None, description="The run's name in W&B and MLflow (default: the run directory's name)."
    )
    wandb_project: str | None = Field(None, description="W&B project (default: ligertune).")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user; default: yours).")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else ./mlruns)."
    )
    mlflow_experiment: str | None = Field(None, description="MLflow experiment (default: ligertune).")
    tensorboard: bool = Field(
        False, description="Deprecated spelling of loggers: [tensorboard]; still honoured."
    )
    throughput_warmup_steps: int = Field(2, ge=0, description="Steps left out of tokens/s and MFU averages.")

    def selected_loggers(self) -> list[str]:
        """`loggers`, plus tensorboard when the deprecated `tensorboard: true` asks for it."""
        extra = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.loggers else []
        return [*self.loggers, *extra]


class CheckpointSection(Section):
    every_steps: int | None = Field(
        None, gt=0, description="Save a resumable checkpoint every N steps (and at the end)."
    )
    keep_last: int = Field(2, gt=0, description="Resumable checkpoints to keep; older ones are deleted.")
    save_final: bool = Field(
        True,
        description="Save a resumable checkpoint when the run ends (a stop by SIGTERM/SIGINT always saves).",
    )
    resume: str = Field(
        "auto", description="auto (newest complete checkpoint in output_dir), none, or a checkpoint path."
    )
    export_hf: bool = Field(
        True, description="Write a Hugging Face model (safetensors + config + tokenizer) at the end."
    )


class ExportSection(Section):
    push_to_hub: str | None = Field(
        None,
        description="Hub repository id (owner/name) to upload the Hugging Face export to at the end "
        "(needs checkpoint.export_hf; token from HF_TOKEN or `hf auth login`).",
    )
    private: bool = Field(True, description="Create the hub repository as private (when it does not exist).")
    merge_lora: bool = Field(
        False,
        description="With lora: besides the adapter (final/, peft format), the export (checkpoint.export_hf) "
        "writes final-merged/, a plain Hugging Face model with the adapters merged into the weights.",
    )

    @field_validator("push_to_hub")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is not None and not HUB_REPO_ID.fullmatch(value):
            raise ValueError(
                f"got {value!r}; a hub repository id is owner/name, e.g. my-org/llama3-8b-alpaca"
            )
        return value


class LoraSection(Section):
    """LoRA adapters through peft: every base weight frozen, W·x + (alpha/r)·B·A·dropout(x) on the target
    linear layers, only A and B (and modules_to_save) trained."""

    r: int = Field(16, gt=0, description="Rank of the adapters (A is r × in, B is out × r).")
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


class Recipe(Section):
    name: str = Field(
        "run",
        description="Run name (letters, digits, '.', '_', '-'); also the default output directory under runs/.",
    )
    description: str = Field("", description="One line shown by `ligertune recipes`.")
    seed: int = Field(
        42, ge=0, lt=2**32, description="Seed for weights (random init), data order and dropout; 0 to 2³²−1."
    )
    output_dir: str | None = Field(
        None, description="Where checkpoints, metrics and the export go (default runs/<name>); ~ expands."
    )
    model: ModelSection = Field(description="What to train.")
    plugins: list[str] = Field(
        default_factory=list,
        description="Functions applied to the model after our kernels, as 'module:function' (called with "
        "the model and the recipe) or a built-in name (liger: Liger-Kernel's patch, for comparisons).",
    )
    tokenizer: TokenizerSection = Field(
        default_factory=TokenizerSection, description="Tokenizer source and padding."
    )
    data: DataSection = Field(description="Dataset, format and sequence layout.")
    training: TrainingSection = Field(
        default_factory=TrainingSection, description="Optimizer, schedule and loop."
    )
    kernels: KernelsSection = Field(
        default_factory=KernelsSection,
        description="Which Triton kernels to patch in: all, none, or per kernel.",
    )
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="Multi-GPU strategy.")
    logging: LoggingSection = Field(
        default_factory=LoggingSection, description="Metrics and progress output."
    )
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Saving and resuming."
    )
    export: ExportSection = Field(
        default_factory=ExportSection, description="Where the final export goes besides the run directory."
    )
    lora: LoraSection | None = Field(
        None,
        description="Train LoRA adapters instead of every weight (peft; pip install 'ligertune[lora]'). "
        "Absent: full fine-tuning.",
    )

    # The directory the recipe file lives in: relative paths resolve against it.
    _base_dir: Path | None = None

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        """The default output folder is runs/<name>: a name with a separator or ``..`` would write
        outside runs/, which is what output_dir is for."""
        if not RUN_NAME.fullmatch(value) or value in (".", ".."):
            raise ValueError(
                f"got {value!r}; a run name is a plain name (letters, digits, '.', '_', '-'); "
                "to choose where the run writes, set output_dir"
            )
        return value

    @model_validator(mode="after")
    def _lora_builds_whole(self) -> Recipe:
        """``parallel.sharded_init: auto`` resolves to off with lora: the sharded build fills the
        shards from a plain model's state dict, whose names are not the adapted model's. The
        rule ``lora.sharded_init`` refuses an explicit true."""
        if self.lora is not None and self.parallel.sharded_init == "auto":
            self.parallel.sharded_init = False
        return self

    @field_validator("kernels", mode="before")
    @classmethod
    def _kernel_preset(cls, value):
        if isinstance(value, str):
            if value not in ("all", "none"):
                raise ValueError(f"expected 'all', 'none' or a mapping of kernel: true/false, got {value!r}")
            return KernelsSection.preset(value)
        return value

    @property
    def run_dir(self) -> Path:
        """Where the run writes: output_dir (``~`` expanded, relative to the working directory),
        else runs/<name>."""
        return Path(os.path.expanduser(self.output_dir)) if self.output_dir else Path("runs") / self.name

    def resolve(self, path: str) -> Path:
        return resolve_path(path, self._base_dir)
