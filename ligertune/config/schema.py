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

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

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
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention backend handed to transformers."
    )
    trust_remote_code: bool = Field(False, description="Allow custom modeling code from the hub repository.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the weights.")


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


class DataSection(Section):
    format: Literal["alpaca", "chat", "pretokenized"] = Field(
        "alpaca",
        description="alpaca: instruction/input/output; chat: a messages list; pretokenized: input_ids[/labels].",
    )
    path: str = Field(description="Hub dataset id, or a local JSON/JSONL/Parquet file or directory.")
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
    messages_field: str = Field("messages", description="Column holding the messages list (chat format).")
    max_samples: int | None = Field(None, gt=0, description="Use only the first N samples (after shuffling).")
    shuffle: bool = Field(True, description="Shuffle samples (seeded by the recipe seed).")


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


class LoggingSection(Section):
    log_every: int = Field(10, gt=0, description="Print and record metrics every N optimizer steps.")
    progress: Literal["auto", "rich", "plain"] = Field(
        "auto", description="auto: a rich progress bar on a terminal, plain lines otherwise."
    )
    tensorboard: bool = Field(
        False, description="Also write TensorBoard scalars (needs tensorboard installed)."
    )
    throughput_warmup_steps: int = Field(2, ge=0, description="Steps left out of tokens/s and MFU averages.")


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
