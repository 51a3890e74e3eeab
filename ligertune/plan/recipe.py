"""A recipe read as the plan's terms: its `Setting` and the micro-batch sizes to consider."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.catalog.formats import PAIR_FORMATS
from ligertune.catalog.shape import ModelShape
from ligertune.catalog.strategies.base import context_parallel_problems as rule_problems
from ligertune.plan.setting import Setting

if TYPE_CHECKING:
    from ligertune.config import Recipe

# Micro-batch sizes the plan tries (and the largest ``auto`` considers).
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def recipe_checkpointing(recipe: Recipe) -> str:
    """The recipe's checkpointing as none/selective/full/auto (true/false read as full/none)."""
    value = recipe.training.activation_checkpointing
    return {True: "full", False: "none"}.get(value, value)


def native_gqa(recipe: Recipe) -> bool:
    """Whether attention takes k and v at the key/value heads. flash-attn and flex attention do;
    transformers' sdpa path does only without a mask (`use_gqa_in_sdpa`), and unpacked rows are
    padded, so there it expands them with ``repeat_kv`` first (packed rows go to flex on CUDA)."""
    return recipe.data.packing or recipe.model.attn_implementation in ("flash_attention_2", "flex_attention")


def gpu_attention(recipe: Recipe) -> str:
    """The attention backend the run uses on a GPU: the recipe's, or for ``auto`` flex_attention
    with packed rows and sdpa with padded ones (`ligertune.models.attention.choose_attention` on a
    GPU without the flash-attn package, which context parallelism has no form for)."""
    backend = recipe.model.attn_implementation
    if backend != "auto":
        return backend
    return "flex_attention" if recipe.data.packing else "sdpa"


def context_parallel_problems(recipe: Recipe) -> tuple[str, ...]:
    """Why the recipe could not split its rows over ranks: the catalog's rule for
    ``parallel.context_parallel`` (`ligertune.catalog.strategies.base.context_parallel_problems`)
    at the recipe's own value, or at 2 when it has none."""
    n = max(2, recipe.parallel.context_parallel)
    split = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"context_parallel": n})})
    return tuple(rule_problems(split))


def rows_per_sample(recipe: Recipe) -> int:
    """2 for preference and kto data (a micro-batch of B pairs is [2B, S]), else the objective's
    (grpo: the completions of each prompt)."""
    data = recipe.data
    formats = {m.format or data.format for m in data.mix} if data.mix else {data.format}
    return 2 if formats & set(PAIR_FORMATS) else recipe.objective.rows_per_sample()


def base_setting(recipe: Recipe, world_size: int, frozen: ModelShape | None = None) -> Setting:
    """The recipe as a `Setting`; ``auto`` values read as micro-batch 1 / no checkpointing.
    `frozen`: the shape of the objective's frozen model (`ligertune.models.shape.frozen_shape`),
    None when it holds none."""
    training = recipe.training
    gqa_native = native_gqa(recipe)
    checkpointing = recipe_checkpointing(recipe)
    micro = training.micro_batch_size
    return Setting(
        micro_batch_size=1 if micro == "auto" else micro,
        seq_len=recipe.data.max_seq_len,
        checkpointing="none" if checkpointing == "auto" else checkpointing,
        every=training.activation_checkpointing_every,
        modules=tuple(training.activation_checkpointing_modules),
        offload=training.activation_offload,
        tiled_mlp=training.tiled_mlp,
        kernels=frozenset(recipe.kernels.enabled()),
        precision=training.precision,
        parallel=recipe.parallel,
        world_size=world_size,
        gqa_native=gqa_native,
        rows_per_sample=rows_per_sample(recipe),
        loss_head=recipe.objective.loss_head,
        frozen=frozen,
        frozen_role=held.role if (held := recipe.objective.frozen_model(recipe)) else "reference",
        generated_tokens=recipe.objective.generated_tokens(),
        accumulation=recipe.training.gradient_accumulation_steps,
        attention=gpu_attention(recipe),
        context_parallel_problems=context_parallel_problems(recipe),
    )


def micro_batch_choices(recipe: Recipe, world_size: int) -> tuple[int, ...]:
    """Micro-batch sizes to consider: the recipe's own, or (auto) the powers of two that divide
    ``global_batch_size / world_size`` when the recipe sets a global batch."""
    micro = recipe.training.micro_batch_size
    if micro != "auto":
        return tuple(sorted({micro, *MICRO_BATCHES}))
    per_rank = global_per_rank(recipe, world_size)
    return tuple(b for b in MICRO_BATCHES if per_rank is None or per_rank % b == 0)


def global_per_rank(recipe: Recipe, world_size: int) -> int | None:
    """Sequences per optimizer step on each rank when the recipe sets ``global_batch_size``."""
    total = recipe.training.global_batch_size
    return None if total is None else total // world_size
