"""What every parallel strategy declares about itself (`ParallelOptions`).

A strategy is the recipe's ``parallel:`` section and the engine it names. Its options model here
is that section (the recipe schema is a union of these models, told apart by ``strategy``), and
its class-level facts and methods are what the rest of the tool asks of it without branching on
its name: whether it runs several processes, the checkpoint format it writes and what a resume
may change, what it supports (LoRA, quantised weights, FP8, a sharded build), its rules, and how
it spreads the model's memory over the GPUs (the `memory_*` methods, torch-free arithmetic over a
`ModelShape`, read by the memory plan `ligertune.plan`). Its engine is a `Runtime` class of
`ligertune.distributed` that names this model as its ``options``.

This base describes one whole replica of the model per process, which is what one process and
DDP both hold; the sharding strategies override the memory methods.

Parallel *dimensions* that compose with a strategy (context parallelism splits each sequence over
ranks on top of FSDP2 or DDP) are fields of this base, not strategies of their own, so that every
strategy can say whether it supports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from ligertune.catalog.rules import Rule
from ligertune.catalog.section import Section
from ligertune.catalog.shape import ModelShape

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

# Bytes per element of a parameter as the optimizer holds it, by training.precision.
WEIGHT_BYTES = {"bf16": 2, "bf16-mixed": 4, "fp32": 4}

# What a resume does with a changed key of a strategy's own options: None applies it (with a log
# line), a string refuses it and says why (`ligertune.training.resume`).
ResumeRule = str | None
PRECISION_SAVED = "the weights and optimizer state were saved for another precision"


# The attention backends the context-parallel attention has a form for (`ligertune.models.attention`).
CONTEXT_PARALLEL_BACKENDS = ("auto", "sdpa", "flex_attention")


def context_parallel_problems(recipe: Recipe) -> list[str]:
    """parallel.context_parallel > 1 needs a strategy that composes with it (ddp, fsdp), the sft objective on a text model, attention sdpa or flex_attention, and no training.compile.

    Why each: one process has no ranks to split a sequence over, and DeepSpeed's engine is
    untried with the per-layer all-gather; the preference, distillation and generating
    objectives compute per-sequence log-probs (a sum over tokens that sit on several ranks) and
    run frozen models the attention hook does not reach; images are spliced into the sequence
    before the first layer, which the split would cut; eager and flash-attention have no form
    of the attention here (flash-attention takes no mask over original positions); and
    torch.compile of a decoder layer has not been tried with the all-gather inside it. The
    model-side limits (mixture-of-experts router losses, sliding windows, softcapping) are
    checked when the model is built (`ligertune.models.attention.context_parallel_problem`)."""
    from ligertune.catalog.objectives.sft import SFTOptions

    parallel = recipe.parallel
    n = parallel.context_parallel
    if n == 1:
        return []
    key = f"parallel.context_parallel: {n}"
    problems = []
    if not parallel.supports("context parallel"):
        problems.append(
            f"{key}: not supported with parallel.strategy {parallel.strategy} "
            f"({parallel.unsupported['context parallel']}); use parallel.strategy ddp or fsdp, or "
            "parallel.context_parallel=1"
        )
    if not isinstance(recipe.objective, SFTOptions):
        problems.append(
            f"{key}: objective.name {recipe.objective.name} is not supported with context parallelism (its "
            "per-sequence log-probs and frozen models are not split); use objective.name sft, or "
            "parallel.context_parallel=1"
        )
    if recipe.model.freeze:
        problems.append(
            f"{key}: vision-language models (model.freeze) are not split; use parallel.context_parallel=1"
        )
    if recipe.model.attn_implementation not in CONTEXT_PARALLEL_BACKENDS:
        problems.append(
            f"model.attn_implementation: {recipe.model.attn_implementation} has no context-parallel form; use "
            f"{', '.join(CONTEXT_PARALLEL_BACKENDS)}, or parallel.context_parallel=1"
        )
    if recipe.training.compile:
        problems.append(
            f"training.compile: not tried with {key} (an all-gather inside every decoder layer); set "
            "training.compile=false"
        )
    return problems


CONTEXT_PARALLEL_RULE = Rule("parallel.context_parallel", context_parallel_problems)


class ParallelOptions(Section):
    """Base of every strategy's options; a subclass sets ``strategy`` to a one-value Literal."""

    strategy: str
    sharded_init: Literal["auto"] | bool = Field(
        "auto",
        description="Build the model empty (meta device), shard it, then fill each rank's shards from "
        "rank 0 (fsdp) or build it inside deepspeed.zero.Init (ZeRO-3), so no GPU holds the whole "
        "model; with lora, rank 0's copy gets the adapters through the same transform. auto: on for "
        "fsdp (without cpu_offload) and deepspeed stage 3; true elsewhere is an error.",
    )

    context_parallel: int = Field(
        1,
        ge=1,
        description="Context parallelism: split every sequence of a micro-batch over this many ranks "
        "(load-balanced head-and-tail chunks; each layer all-gathers K and V over them). The job is a "
        "data-parallel × context-parallel mesh: the world size must be a multiple of it, and the "
        "ranks of a group (consecutive ranks) train the same rows. ddp and fsdp; sft on text models; "
        "attention sdpa or flex_attention. 1: off.",
    )

    summary: ClassVar[str] = ""  # one line for the recipe reference
    label: ClassVar[str] = ""  # how logs and the plan name it
    multi_process: ClassVar[bool] = True  # joins a process group (torchrun, or a job of one)
    checkpoint_format: ClassVar[str] = "full"  # `ligertune.run.checkpoint` says what "full" holds
    # What a checkpoint of that format holds of the model and optimizer (checked by name in a
    # checkpoint saved before manifests existed, which has no list of its own).
    checkpoint_files: ClassVar[tuple[str, ...]] = ("model.pt", "optimizer.pt")
    # Changed options keys (relative to ``parallel.``) a resume accepts or refuses.
    resume_rules: ClassVar[dict[str, ResumeRule]] = {}
    # A resume must run on as many processes as saved the checkpoint (one file per rank).
    resume_same_world_size: ClassVar[bool] = False
    # What it cannot do, and why: "lora" (adapters), "quantized" (bitsandbytes weights, QLoRA),
    # "fp8" (torchao's float8 layers), "bf16 weights" (training.precision bf16), "generation" (an
    # objective that generates its completions with the policy while it trains), "graphed
    # generation" (that generation's decode step captured as a CUDA graph), "eval.tasks"
    # (lm-evaluation-harness on the trained model, which needs one process to hold all of it),
    # "context parallel" (``context_parallel`` > 1), "tiled mlp" (``training.tiled_mlp``: the MLP's
    # forward called again inside its backward).
    unsupported: ClassVar[dict[str, str]] = {}
    # What running it on the CPU costs, when that is more than slowness: a warning at the start.
    cpu_warning: ClassVar[str | None] = None
    package: ClassVar[str | None] = None  # the pip extra (and importable package) it needs
    # Whether its all-gather can carry the weights of torchao's float8 layers in float8 (with
    # ``training.fp8: tensorwise``): half the bytes of a bf16 gather.
    gathers_float8: ClassVar[bool] = False
    rules: ClassVar[tuple[Rule, ...]] = (CONTEXT_PARALLEL_RULE,)

    @classmethod
    def supports(cls, feature: str) -> bool:
        return feature not in cls.unsupported

    def files(self) -> list[tuple[str, str]]:
        """(dotted key, path) of the files its options name, which must exist."""
        return []

    # -- the parameters' layout ---------------------------------------------------------------

    def shards_parameters(self) -> bool:
        """Whether each rank holds a slice of every parameter (FSDP2, ZeRO-3)."""
        return False

    def sharded_init_problem(self) -> str | None:
        """Why ``sharded_init: true`` cannot be honoured, or None."""
        if self.shards_parameters():
            return None
        return (
            f"parallel.sharded_init: true, but parallel.strategy {self.strategy} keeps whole parameters on "
            "every rank; use fsdp or deepspeed with zero_stage 3, or sharded_init auto"
        )

    @property
    def shards_at_init(self) -> bool:
        """Whether the model is built sharded (``sharded_init`` with ``auto`` resolved)."""
        if self.sharded_init == "auto":
            return self.shards_parameters() and self.sharded_init_problem() is None
        return bool(self.sharded_init)

    def sequence_shards(self) -> int:
        """Ranks each sequence is split over (a context-parallel dimension); 1: every rank
        computes whole rows, and the plan counts every token of its micro-batch."""
        return self.context_parallel

    # -- memory (per GPU, in bytes; `ligertune.plan` adds activations and temporaries) ----------

    def bf16_parameters(self, precision: str) -> bool:
        """Whether, under bf16-mixed, the layers compute on bf16 copies of the parameters that
        the strategy makes (so the residual stream between layers is bf16, not autocast's fp32)."""
        return False

    def memory_states(self, shape: ModelShape, precision: str, world_size: int) -> tuple[dict[str, int], int]:
        """The persistent model states on each GPU, by name, and the gradients' bytes (counted
        by the plan only where gradients exist). A whole replica: weights, AdamW's two moments,
        and under bf16-mixed autocast's bf16 copies of the weights it casts."""
        ew = WEIGHT_BYTES[precision]
        states = {"weights": shape.params * ew, "AdamW moments": 2 * shape.trainable * ew}
        if precision == "bf16-mixed":
            # kept by the graph until backward frees them (with LoRA the frozen weights' too)
            states["autocast bf16 weight copies"] = shape.params * 2
        return states, shape.trainable * ew

    def memory_temporaries(self, shape: ModelShape, precision: str) -> dict[str, int]:
        """What the strategy allocates for a moment at the end of backward (a reduction buffer)."""
        return {}

    def memory_host(self, shape: ModelShape, precision: str, world_size: int) -> dict[str, int]:
        """What each rank keeps in the host's memory for the whole run, by name: the model states
        a CPU offload moves off the GPU (`memory_states` counts them as 0 there). They are
        pinned, so they take the host's RAM in full, and every rank of a host has its own.
        Nothing for a strategy that keeps its states on the GPU."""
        return {}

    def memory_whole_gathered(self, shape: ModelShape, precision: str) -> int:
        """What holding the whole model's weights at once (``Runtime.gathered``, while an objective
        generates) adds to `memory_states`: nothing for a replica."""
        return 0

    def lm_head_gradient_share(self, world_size: int) -> int:
        """The lm_head gradient on each GPU is 1/this of the whole at the start of backward."""
        return 1

    def frozen_memory(self, frozen: ModelShape, precision: str, world_size: int) -> tuple[int, int, str]:
        """A frozen model (reference, teacher) placed as the strategy places the policy (its
        ``wrap_frozen``): (its weights on each GPU for the whole run, what it gathers while its
        forward runs, how it is held). A replica here, in `build_model`'s parameter dtype."""
        each = WEIGHT_BYTES[precision]
        return frozen.params * each, 0, f"{_dtype(each)}, replica"

    def memory_fixes(self, precision: str, world_size: int) -> list[tuple[str, dict]]:
        """Changes of the parallel setting that need less memory per GPU, mildest first: (what to
        tell the user, the `ligertune.plan.Setting` fields that change)."""
        return []


def _dtype(element_bytes: int) -> str:
    return "bf16" if element_bytes == 2 else "fp32"


def scale_out(world_size: int) -> tuple[str, dict]:
    """The fix of a sharded strategy that does not fit: twice the GPUs."""
    more = max(2, world_size * 2)
    return f"--nproc-per-node {more}", {"world_size": more}
