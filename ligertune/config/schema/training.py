"""How to train: the optimizer and loop (`TrainingSection`) and the kernels (`KernelsSection`). The
parallel strategy's section is the catalog's (`ligertune.catalog.strategies`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model, field_validator

from ligertune.catalog.kernels import KERNEL_NAMES, KERNELS
from ligertune.catalog.section import AdamBeta, Section

# The decoder-layer sub-modules ``activation_checkpointing_modules`` can name (the training code
# maps them to each family's attribute: ``self_attn``, ``mlp``).
CHECKPOINT_MODULES = ("attention", "mlp")


# Upper bounds of the fields that size what a step allocates, far above any real run, so that a
# typo (10**9) is refused by `validate` instead of exhausting memory at the first step.
MAX_MICRO_BATCH = 2**16
MAX_ACCUMULATION = 2**14  # the micro-batches of one step are held together on the host
MAX_GLOBAL_BATCH = 2**20


class TrainingSection(Section):
    epochs: int = Field(1, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides epochs.")
    micro_batch_size: int | Literal["auto"] = Field(
        1,
        description="Sequences per forward/backward on each device. auto: the largest that `ligertune plan` "
        "says fits the GPU (with global_batch_size: the largest that also divides it per rank).",
    )
    gradient_accumulation_steps: int = Field(
        1,
        gt=0,
        le=MAX_ACCUMULATION,
        description="Micro-batches per optimizer step (with micro_batch_size auto and global_batch_size: derived).",
    )
    global_batch_size: int | None = Field(
        None,
        gt=0,
        le=MAX_GLOBAL_BATCH,
        description="Sequences per optimizer step over all ranks, kept when micro_batch_size is auto "
        "(gradient accumulation makes up the rest); unset: gradient_accumulation_steps stays as written.",
    )
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
    activation_checkpointing: Literal["auto", "none", "full", "selective"] | bool = Field(
        "none",
        description="Recompute decoder layers in backward (non-reentrant): full (every layer), selective "
        "(every activation_checkpointing_every-th layer, whole or only activation_checkpointing_modules), "
        "none, or auto (the fastest that `ligertune plan` says fits the GPU; none on CPU). true/false "
        "(older recipes) read as full/none.",
    )
    activation_checkpointing_every: int = Field(
        2, gt=0, description="selective checkpointing: checkpoint layers 0, k, 2k, ... (k=1: every layer)."
    )
    activation_checkpointing_modules: list[Literal[CHECKPOINT_MODULES]] = Field(
        default_factory=list,
        description="selective checkpointing: recompute only this sub-module, attention or mlp, of the "
        "layers activation_checkpointing_every chooses (set it to 1 for every layer); e.g. [attention] "
        "keeps the MLP's activations and recomputes attention. Empty: whole layers.",
    )
    activation_offload: bool = Field(
        False,
        description="Copy what autograd saves in the decoder layers not checkpointed whole to pinned CPU "
        "memory on a side CUDA stream, and back ahead of their backward: long sequences at the cost of "
        "PCIe traffic (the GPU waits when the copies are slower than a layer's compute); a no-op on CPU.",
    )
    tiled_mlp: bool | int = Field(
        False,
        description="Run each decoder layer's MLP over its tokens in tiles of this many (true: the hidden "
        "size) and recompute it tile by tile in backward, so its [tokens × intermediate] activations are "
        "those of one tile: for long rows, where they are a layer's largest; costs one more MLP forward "
        "per layer. false: off.",
    )
    memory_budget_gib: float | None = Field(
        None,
        gt=0,
        description="GPU memory (GiB per GPU) the auto choices plan against; default: the device's total.",
    )
    compile: bool = Field(False, description="torch.compile each decoder layer.")
    fp8: Literal["none", "rowwise", "tensorwise"] = Field(
        "none",
        description="FP8 matmuls in the decoder layers' linear layers through torchao (pip install "
        "'ligertune[fp8]'; pays with compile: true on an H100/H200): rowwise or tensorwise scaling "
        "(tensorwise under fsdp also all-gathers the weights in float8).",
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

    @field_validator("micro_batch_size", mode="wrap")
    @classmethod
    def _count_or_auto(cls, value, handler):
        """A positive integer or ``auto``, with one message for anything else (a union would
        report each member's complaint)."""
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"got {value!r}; input should be a valid integer, or auto")
        if value <= 0:
            raise ValueError(f"got {value!r}; input should be greater than 0, or auto")
        if value > MAX_MICRO_BATCH:
            raise ValueError(
                f"got {value!r}; input should be less than or equal to {MAX_MICRO_BATCH}, or auto"
            )
        return value

    @field_validator("activation_checkpointing", mode="wrap")
    @classmethod
    def _checkpointing_mode(cls, value, handler) -> str:
        """Older recipes say true/false: full/none, normalised here so the code sees one spelling."""
        if isinstance(value, bool):
            return "full" if value else "none"
        if value not in ("auto", "none", "full", "selective"):
            raise ValueError(
                f"got {value!r}; allowed: 'auto', 'none', 'full' or 'selective' (true/false: full/none)"
            )
        return value

    @field_validator("tiled_mlp", mode="wrap")
    @classmethod
    def _tile_tokens(cls, value, handler) -> bool | int:
        """true, false or a positive number of tokens, with one message for anything else."""
        if isinstance(value, bool) or (isinstance(value, int) and value > 0):
            return value
        raise ValueError(
            f"got {value!r}; input should be true, false or a positive number of tokens per tile"
        )

    @field_validator("activation_checkpointing_modules")
    @classmethod
    def _one_sub_module(cls, value: list[str]) -> list[str]:
        """One sub-module at most: both would recompute the whole layer but its norms, and save
        more than checkpointing the layer whole (each sub-module keeps its own input)."""
        if len(value) > 1:
            raise ValueError(
                f"got {value!r}; name one of {', '.join(CHECKPOINT_MODULES)}, or leave it empty to recompute "
                "whole layers"
            )
        return value

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


# One field per `ligertune.catalog.kernels.KERNELS` entry, in its order: adding a kernel to the
# registry adds its recipe key, its documentation line and its command-line spelling.
KernelsSection = create_model(
    "KernelsSection",
    __base__=_KernelSwitches,
    __doc__="Which Triton kernels to patch in: one switch per kernel of the registry.",
    **{k.name: (bool, Field(k.default, description=k.summary)) for k in KERNELS},
)
