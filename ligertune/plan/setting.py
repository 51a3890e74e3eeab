"""The terms of a memory estimate: one way to run a recipe (`Setting`), one tensor autograd saves
(`Saved`), the result (`Breakdown`), and the dtypes they are counted in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ligertune.catalog.shape import ModelShape
from ligertune.catalog.strategies import ParallelOptions, SingleProcess
from ligertune.catalog.strategies.base import WEIGHT_BYTES

GIB = 2**30
# Part of the GPU left free when deciding "fits": the caching allocator's fragmentation, the
# CUDA context and library workspaces (cuBLAS, NCCL), which are not allocated tensors.
HEADROOM_FRACTION = 0.08

CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Setting:
    """One way to run the recipe: what the plan varies, and what it takes from the recipe."""

    micro_batch_size: int
    seq_len: int
    checkpointing: str = "none"  # none | selective | full
    every: int = 2  # selective: every k-th layer is checkpointed
    modules: tuple[str, ...] = ()  # selective: the sub-module recomputed in those layers (empty: all)
    offload: bool = False  # activation offload to pinned CPU memory (layers not checkpointed whole)
    # ``training.tiled_mlp``: false, true (tiles of the hidden size) or tokens per tile.
    tiled_mlp: bool | int = False
    kernels: frozenset[str] = frozenset()
    precision: str = "bf16"  # bf16 | bf16-mixed | fp32
    # The recipe's parallel section: the strategy and its options (`ligertune.catalog.strategies`),
    # whose memory methods say how it spreads the model over the GPUs.
    parallel: ParallelOptions = field(default_factory=SingleProcess)
    world_size: int = 1
    gqa_native: bool = True
    # Rows of the micro-batch per sample: 2 for preference and kto data, whose micro-batch of B
    # pairs is a [2B, S] batch (`ligertune.data.preference`), 1 otherwise.
    rows_per_sample: int = 1
    # How the objective's loss runs at the lm_head (`ligertune.catalog.objectives.base.LossHead`).
    loss_head: str = "causal"
    # A frozen model held for the whole run besides the policy (the objective's `frozen_model`):
    # its shape and its role (reference or teacher). None: no second model.
    frozen: ModelShape | None = None
    frozen_role: str = "reference"
    # Tokens the objective generates after each prompt (`ObjectiveOptions.generated_tokens`): 0,
    # or a generation phase with a KV cache before the step (grpo), and a ``policy`` loss head
    # that reaches only those positions.
    generated_tokens: int = 0
    # Micro-batches per optimizer step (gradient accumulation): an objective that generates does
    # it for the whole window at once.
    accumulation: int = 1
    # The attention backend on the GPU (`ligertune.plan.recipe.gpu_attention`): under context
    # parallelism it decides the mask's form (a dense boolean for sdpa, a BlockMask for flex).
    attention: str = "sdpa"
    # Why the recipe could not run with ``parallel.context_parallel`` > 1 (the catalog's rule:
    # its strategy, objective, attention backend, compile), empty when it could; the plan
    # proposes context parallelism only then.
    context_parallel_problems: tuple[str, ...] = ()

    @property
    def shards(self) -> int:
        """Ranks each row is split over (``parallel.context_parallel``; 1: whole rows)."""
        return self.parallel.sequence_shards()

    @property
    def shard_len(self) -> int:
        """Tokens of one row on one GPU: the whole row, or under context parallelism 2 chunks of
        the row padded to a multiple of 2N (`ligertune.distributed.context.shard_rows`)."""
        n = self.shards
        return self.seq_len if n == 1 else 2 * -(-self.seq_len // (2 * n))

    @property
    def row_len(self) -> int:
        """Tokens of one whole row as the attention sees it: `seq_len`, or padded to a multiple
        of 2N under context parallelism (the length of the gathered K and V)."""
        return self.shard_len * self.shards

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one GPU: every row is ``seq_len`` long, a pair is two
        rows, and context parallelism leaves each rank its shard of every row."""
        return self.rows * self.shard_len

    @property
    def rows(self) -> int:
        """Rows of one micro-batch: samples × rows per sample (pairs; completions per prompt)."""
        return self.micro_batch_size * self.rows_per_sample

    @property
    def head_tokens(self) -> int:
        """Tokens whose hidden states reach the loss at the lm_head: every token, but for the
        ``policy`` head only the generated completions' (`ligertune.objectives.logps.completion_forward`)."""
        if self.loss_head == "policy":
            return self.rows * self.generated_tokens // self.shards
        return self.tokens

    @property
    def whole_layers(self) -> bool:
        """Whether checkpointed layers are recomputed whole (not one sub-module of each)."""
        return self.checkpointing == "full" or not self.modules

    def checkpointing_label(self) -> str:
        """``none``, ``full``, ``selective/k`` or ``selective/k (attention)``."""
        if self.checkpointing != "selective":
            return self.checkpointing
        return f"selective/{self.every}" + (f" ({', '.join(self.modules)})" if self.modules else "")

    def label(self) -> str:
        return f"micro {self.micro_batch_size}, checkpointing {self.checkpointing_label()}" + (
            ", offload" if self.offload else ""
        )


def checkpointed_layers(layers: int, s: Setting) -> int:
    """How many decoder layers are checkpointed (whole, or the sub-module `s.modules` names): all
    (full), layers 0, k, 2k, ... (selective, transformers' ``every_n_layers``), or none."""
    if s.checkpointing == "full":
        return layers
    return math.ceil(layers / s.every) if s.checkpointing == "selective" else 0


@dataclass(frozen=True)
class Saved:
    """One tensor autograd saves, per token: elements and bytes per element, and the decoder
    layer's sub-module whose operations save it (``attention``, ``mlp``; None: the layer's own,
    as the norms'), or for the tensors outside the layers ``loss head`` (`activations.HEAD`:
    counted over the tokens that reach the loss). `whole_row`: counted over the whole rows, not
    this GPU's shard of them (the K and V a context-parallel attention gathers)."""

    name: str
    per_token: int
    bytes_per_element: int
    module: str | None = None
    whole_row: bool = False

    def bytes(self, tokens: int) -> int:
        return tokens * self.per_token * self.bytes_per_element


@dataclass
class Breakdown:
    """Named byte counts per GPU and the predicted peak, with the moment it happens."""

    setting: Setting
    states: dict[str, int] = field(default_factory=dict)
    activations: dict[str, int] = field(default_factory=dict)
    temporaries: dict[str, int] = field(default_factory=dict)
    moments: dict[str, int] = field(default_factory=dict)  # the candidate peaks

    @property
    def peak(self) -> int:
        return max(self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.get)

    def fits(self, gpu_bytes: int, headroom: float = HEADROOM_FRACTION) -> bool:
        return self.peak <= gpu_bytes * (1 - headroom)


def compute_bytes(s: Setting) -> int:
    """Bytes per element of matmul outputs (bf16 unless fp32)."""
    return 4 if s.precision == "fp32" else 2


def stream_bytes(s: Setting) -> int:
    """Bytes per element of the residual stream between layers: fp32 for fp32, and for
    bf16-mixed where autocast alone casts (not where the strategy computes on bf16 copies of
    the parameters); bf16 otherwise."""
    if s.precision == "fp32":
        return 4
    if s.precision == "bf16-mixed":
        return 2 if s.parallel.bf16_parameters(s.precision) else 4
    return 2


def weight_bytes(s: Setting) -> int:
    """Bytes per element of the parameters as the optimizer holds them (before sharding)."""
    return WEIGHT_BYTES[s.precision]
