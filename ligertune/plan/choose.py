"""The table of choices and the ``auto`` picks.

`ligertune.plan.recipe.base_setting` reads what the recipe fixes (precision, strategy, kernels,
sequence length); `candidates` varies what the plan chooses among (micro-batch size, activation checkpointing
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

from ligertune.catalog.shape import ModelShape
from ligertune.plan.activations import layer_saved, saved_bytes
from ligertune.plan.estimate import estimate
from ligertune.plan.setting import GIB, HEADROOM_FRACTION, Breakdown, Setting, checkpointed_layers

SELECTIVE_EVERY = 2  # the plan's selective candidate: every other layer checkpointed
# The plan's other selective candidate: attention recomputed in every layer, the MLP's
# activations kept (the cheapest recompute: attention holds a fifth of a Llama layer's weights).
SELECTIVE_ATTENTION = (1, ("attention",))


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
    """Weights of a decoder layer's sub-module: attention's four projections, or the gated MLP's
    three (a mixture of experts: those one token computes with, `ModelShape.intermediate`)."""
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
    saved = sum(saved_bytes(t, s) for t in layer_saved(shape, s) if t.module not in s.modules) / s.tokens
    compute = 6 * shape.layer_active_params / ACHIEVED_FLOPS
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
    share = (
        1.0 if s.whole_layers else sum(module_params(shape, m) for m in s.modules) / shape.layer_active_params
    )
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


def context_parallel_sizes(shape: ModelShape, base: Setting) -> list[int]:
    """The ``parallel.context_parallel`` values that could split the recipe's rows over its GPUs,
    smallest first: the divisors of the world size above the recipe's own, where the recipe
    (strategy ddp or fsdp, sft, attention sdpa or flex_attention: `Setting.context_parallel_problems`)
    and the model (`ModelShape.row_split_problem`) allow it; none otherwise."""
    if base.context_parallel_problems or shape.row_split_problem is not None:
        return []
    return [n for n in range(base.shards + 1, base.world_size + 1) if base.world_size % n == 0]


def cheapest_fix(shape: ModelShape, base: Setting, gpu_bytes: int) -> str:
    """What would make a recipe that fits in no setting fit: the first change, in order of how
    little it changes the training (same math first: kernels; context parallelism, the smallest
    N that fits, on the same GPUs; sharding, offload; then numerics, data, and what is trained),
    whose smallest setting (micro-batch 1, full checkpointing) fits.

    Context parallelism is only proposed, never applied by ``auto``: it changes the run's
    process layout (data-parallel groups, what each rank loads), which is the recipe's to say.
    It comes before shortening the rows, which changes what is trained, and before asking for
    more GPUs; its all-gathers cost time (docs/distributed.md)."""
    smallest = replace(base, micro_batch_size=1, checkpointing="full", modules=(), offload=False)
    fixes: list[tuple[str, Setting, ModelShape]] = []

    def fix(text: str, setting: Setting, fixed_shape: ModelShape = shape) -> None:
        fixes.append((text, setting, fixed_shape))

    if not OUR_KERNELS <= base.kernels:
        fix("kernels=all", replace(smallest, kernels=(smallest.kernels - {"cross_entropy"}) | OUR_KERNELS))
    # moe_experts (on under `kernels: all`, but a recipe may turn it off) changes the bytes of a
    # mixture of experts only: a dense recipe is never told to turn it on.
    if shape.experts and "moe_experts" not in base.kernels:
        fix("kernels.moe_experts=true", replace(smallest, kernels=smallest.kernels | {"moe_experts"}))
    for n in context_parallel_sizes(shape, base):
        fix(
            f"parallel.context_parallel={n}",
            replace(smallest, parallel=base.parallel.model_copy(update={"context_parallel": n})),
        )
    for text, changes in base.parallel.memory_fixes(base.precision, base.world_size):
        fix(text, replace(smallest, **changes))
    if base.precision != "bf16" and base.parallel.supports("bf16 weights"):
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
