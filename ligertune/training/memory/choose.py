"""From a recipe to `Setting`s, the table of choices, and the ``auto`` picks.

`base_setting` reads what the recipe fixes (precision, strategy, kernels, sequence length);
`candidates` varies what the plan chooses among (micro-batch size, activation checkpointing
none / selective every 2nd layer / selective attention in every layer / full, activation
offload); `relative_speed` orders them; `choose` picks the fastest
candidate that fits with the safety margin (`HEADROOM_FRACTION` of the GPU left free), which is
what ``training.activation_checkpointing: auto`` and ``training.micro_batch_size: auto`` do.

The global batch when ``micro_batch_size`` is auto: ``training.global_batch_size`` (sequences
per optimizer step over all ranks) when the recipe sets it, and then the micro-batch is the
largest that fits *and* divides ``global_batch_size / world_size``, with the gradient
accumulation steps making up the rest. Without it, ``gradient_accumulation_steps`` stays as
written and the global batch is whatever micro-batch fits × accumulation × world size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ligertune.config.schema.data import PAIR_FORMATS
from ligertune.training.memory.estimate import (
    GIB,
    HEADROOM_FRACTION,
    Breakdown,
    ModelShape,
    Setting,
    checkpointed_layers,
    estimate,
    layer_saved,
)
from ligertune.training.memory.shape import section_shape

if TYPE_CHECKING:
    from ligertune.config import Recipe

# Micro-batch sizes the plan tries (and the largest ``auto`` considers).
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SELECTIVE_EVERY = 2  # the plan's selective candidate: every other layer checkpointed
# The plan's other selective candidate: attention recomputed in every layer, the MLP's
# activations kept (the cheapest recompute: attention holds a fifth of a Llama layer's weights).
SELECTIVE_ATTENTION = (1, ("attention",))


def recipe_checkpointing(recipe: Recipe) -> str:
    """The recipe's checkpointing as none/selective/full/auto (true/false read as full/none)."""
    value = recipe.training.activation_checkpointing
    return {True: "full", False: "none"}.get(value, value)


def native_gqa(recipe: Recipe) -> bool:
    """Whether attention takes k and v at the key/value heads. flash-attn and flex attention do;
    transformers' sdpa path does only without a mask (`use_gqa_in_sdpa`), and unpacked rows are
    padded, so there it expands them with ``repeat_kv`` first (packed rows go to flex on CUDA)."""
    return recipe.data.packing or recipe.model.attn_implementation in ("flash_attention_2", "flex_attention")


def rows_per_sample(recipe: Recipe) -> int:
    """2 for preference and kto data (a micro-batch of B pairs is [2B, S]), else 1."""
    data = recipe.data
    formats = {m.format or data.format for m in data.mix} if data.mix else {data.format}
    return 2 if formats & set(PAIR_FORMATS) else 1


def frozen_shape(recipe: Recipe) -> ModelShape | None:
    """The shape of the frozen model the objective holds on the GPU besides the policy: the
    distill teacher, or the dpo/kto reference when it is frozen and there is no LoRA (with LoRA
    the reference is the policy with its adapters off: no second model). None otherwise
    (sft, orpo, simpo, precomputed or no reference)."""
    objective = recipe.objective
    if objective.name == "distill" and objective.teacher is not None:
        return section_shape(recipe, objective.teacher)
    if objective.name in ("dpo", "kto") and objective.reference_kind == "frozen" and recipe.lora is None:
        return section_shape(recipe, objective.reference_model or recipe.model)
    return None


def base_setting(recipe: Recipe, world_size: int) -> Setting:
    """The recipe as a `Setting`; ``auto`` values read as micro-batch 1 / no checkpointing."""
    training, parallel = recipe.training, recipe.parallel
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
        kernels=frozenset(recipe.kernels.enabled()),
        precision=training.precision,
        strategy=parallel.strategy,
        world_size=world_size,
        zero_stage=parallel.deepspeed.zero_stage,
        fsdp_mixed_precision=parallel.fsdp.mixed_precision,
        fsdp_reshard_after_forward=parallel.fsdp.reshard_after_forward,
        fsdp_cpu_offload=parallel.fsdp.cpu_offload,
        deepspeed_offload_optimizer=parallel.deepspeed.offload_optimizer,
        deepspeed_offload_params=parallel.deepspeed.offload_params,
        gqa_native=gqa_native,
        rows_per_sample=rows_per_sample(recipe),
        objective=recipe.objective.name,
        frozen=frozen_shape(recipe),
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


def selective_variants(base: Setting) -> list[tuple[int, tuple[str, ...]]]:
    """(every, modules) of the selective candidates: the recipe's own when it is selective, else
    every 2nd layer whole; and attention recomputed in every layer."""
    own = (base.every, base.modules) if base.checkpointing == "selective" else (SELECTIVE_EVERY, ())
    return list(dict.fromkeys([own, SELECTIVE_ATTENTION]))


def candidates(
    base: Setting, micro_batches: tuple[int, ...], checkpointing: tuple[str, ...]
) -> list[Setting]:
    """Every combination the plan's table shows: micro-batch × checkpointing (selective in each
    of its `selective_variants`) × offload (offload only where some layer is not checkpointed
    whole: a checkpointed layer saves little to offload)."""
    settings = []
    for micro in micro_batches:
        for ckpt in checkpointing:
            variants = selective_variants(base) if ckpt == "selective" else [(base.every, ())]
            for every, modules in variants:
                for offload in (False, True):
                    if offload and ckpt == "full":
                        continue
                    settings.append(
                        replace(
                            base,
                            micro_batch_size=micro,
                            checkpointing=ckpt,
                            every=every,
                            modules=modules,
                            offload=offload,
                        )
                    )
    return settings


def module_params(shape: ModelShape, module: str) -> int:
    """Weights of a decoder layer's sub-module: attention's four projections, or the gated MLP's three."""
    if module == "attention":
        return shape.hidden * 2 * (shape.heads + shape.kv_heads) * shape.head_dim
    return 3 * shape.hidden * shape.intermediate


# Offload's cost model (assumptions of an H100/H200 host, not measurements): about 50 GB/s per
# direction over a PCIe 5 x16 link, and about 400 TFLOP/s of bf16 work achieved in a decoder layer
# (half the dense peak, what the end-to-end benchmarks reach).
PCIE_BYTES_PER_S = 50e9
ACHIEVED_FLOPS = 400e12


def offload_slowdown(shape: ModelShape, s: Setting) -> float:
    """How much longer an offloaded layer takes than the same layer kept on the GPU.

    Its saved bytes cross PCIe once each way on a side stream, overlapped with the layer's
    forward (a third of its 6 FLOPs per parameter and token) and its backward (two thirds), so
    each pass costs the longer of its compute and its copy. A Llama-3-8B layer with our kernels
    saves ~140 kB a token against ~3.3 µs of work: the copies (~2.8 µs each way) outlast both
    passes, and the layer takes ~1.7× as long; the 1B shape's layers, whose saved bytes shrink
    more slowly than their work, take ~3.3× as long. What a sub-module checkpoint recomputes is not offloaded (only its
    input is saved)."""
    saved = sum(t.per_token * t.bytes_per_element for t in layer_saved(shape, s) if t.module not in s.modules)
    compute = 6 * shape.layer_params / ACHIEVED_FLOPS
    copy = saved / PCIE_BYTES_PER_S
    return (max(compute / 3, copy) + max(2 * compute / 3, copy)) / compute - 1


def relative_speed(shape: ModelShape, s: Setting) -> float:
    """A throughput score for ordering settings (higher is faster), not a prediction of tokens/s.

    Work per token is 6 FLOPs per parameter (forward + backward); a checkpointed layer adds a
    second forward (2 per parameter), of its checkpointed sub-module only when `s.modules` names
    one (its share of the layer's parameters). Offloaded layers take `offload_slowdown` longer.
    A larger micro-batch amortises the per-step costs (optimizer, gathers, launches), modelled
    as a fixed cost equal to 2048 tokens' work."""
    checkpointed = checkpointed_layers(shape.layers, s) / shape.layers
    share = 1.0 if s.whole_layers else sum(module_params(shape, m) for m in s.modules) / shape.layer_params
    recompute = checkpointed * share * 2 / 6
    offloaded = 1 - checkpointed if s.whole_layers else 1.0
    offload = offloaded * offload_slowdown(shape, s) if s.offload else 0.0
    amortised = s.tokens / (s.tokens + 2048)
    return amortised / (1 + recompute + offload)


@dataclass(frozen=True)
class Choice:
    setting: Setting
    breakdown: Breakdown
    speed: float


def rank_choices(shape: ModelShape, settings: list[Setting]) -> list[Choice]:
    """Each setting with its breakdown, fastest first by `relative_speed`."""
    choices = [Choice(s, estimate(shape, s), relative_speed(shape, s)) for s in settings]
    return sorted(choices, key=lambda c: -c.speed)


def choose(
    shape: ModelShape, settings: list[Setting], gpu_bytes: int, headroom: float = HEADROOM_FRACTION
) -> Choice | None:
    """The fastest setting that fits, or None when none does."""
    return next((c for c in rank_choices(shape, settings) if c.breakdown.fits(gpu_bytes, headroom)), None)


OUR_KERNELS = frozenset({"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"})
# A stand-in for LoRA's trainable share when suggesting it (rank 16 on every linear layer of a
# Llama is about 0.5% of the parameters).
LORA_SHARE = 0.005


def cheapest_fix(shape: ModelShape, base: Setting, gpu_bytes: int) -> str:
    """What would make a recipe that fits in no setting fit: the first change, in order of how
    little it changes the training (same math first: kernels, sharding, offload; then numerics,
    data, and what is trained), whose smallest setting (micro-batch 1, full checkpointing) fits."""
    smallest = replace(base, micro_batch_size=1, checkpointing="full", modules=(), offload=False)
    more = max(2, base.world_size * 2)
    fixes: list[tuple[str, Setting, ModelShape]] = []

    def fix(text: str, setting: Setting, fixed_shape: ModelShape = shape) -> None:
        fixes.append((text, setting, fixed_shape))

    if not OUR_KERNELS <= base.kernels:
        fix("kernels=all", replace(smallest, kernels=(smallest.kernels - {"cross_entropy"}) | OUR_KERNELS))
    if base.strategy in ("none", "ddp"):
        fix(
            f"parallel.strategy=fsdp with --nproc-per-node {more}",
            replace(smallest, strategy="fsdp", world_size=more),
        )
    else:
        fix(f"--nproc-per-node {more}", replace(smallest, world_size=more))
    if base.strategy == "fsdp":
        fix("parallel.fsdp.cpu_offload=true", replace(smallest, fsdp_cpu_offload=True))
    if base.strategy == "deepspeed":
        fix("parallel.deepspeed.offload_optimizer=true", replace(smallest, deepspeed_offload_optimizer=True))
    if base.precision != "bf16" and base.strategy != "deepspeed":
        fix("training.precision=bf16", replace(smallest, precision="bf16"))
    for seq in (base.seq_len // 2, base.seq_len // 4):
        if seq >= 128:
            fix(f"data.max_seq_len={seq}", replace(smallest, seq_len=seq))
    if not shape.lora_params:
        # With LoRA a dpo/kto reference is the policy with its adapters off: no frozen copy.
        reference = base.frozen is not None and base.frozen_role == "reference"
        fix(
            "a lora section (adapters instead of full fine-tuning"
            + ("; the reference becomes the policy with its adapters off" if reference else "")
            + ")",
            replace(smallest, frozen=None) if reference else smallest,
            replace(shape, lora_params=int(shape.params * LORA_SHARE)),
        )
    for text, setting, fixed_shape in fixes:
        if estimate(fixed_shape, setting).fits(gpu_bytes):
            return text
    return "a GPU with more memory"


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"
