"""The memory plan under context parallelism (``parallel.context_parallel: N``): the terms
counted by hand from the shape's numbers, and the fix it proposes when a long row fits nowhere."""

from __future__ import annotations

from dataclasses import replace

from ligertune.catalog.shape import ModelShape
from ligertune.catalog.strategies import FSDPParallel
from ligertune.config import load_recipe
from ligertune.plan.choose import cheapest_fix
from ligertune.plan.estimate import estimate
from ligertune.plan.recipe import base_setting
from ligertune.plan.setting import GIB, Setting
from tests.helpers import QUICKSTART

OURS = frozenset({"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"})

# A Llama-3-8B-like shape, written out (no model build).
L, H, HEADS, KV, D, I, V = 32, 4096, 32, 8, 128, 14336, 128256  # noqa: E741
LAYER = 2 * H * HEADS * D + 2 * H * KV * D + 3 * H * I + 2 * H  # q, o; k, v; MLP; two norms
SHAPE = ModelShape(
    layers=L,
    hidden=H,
    heads=HEADS,
    kv_heads=KV,
    head_dim=D,
    intermediate=I,
    vocab=V,
    params=L * LAYER + 2 * V * H + H,
    layer_params=LAYER,
    embed_params=V * H,
    head_params=V * H,
)


def fsdp(n: int = 1) -> FSDPParallel:
    return FSDPParallel(context_parallel=n)


def setting(seq: int, n: int, attention: str = "sdpa", world: int = 4, **kw) -> Setting:
    return Setting(
        micro_batch_size=1,
        seq_len=seq,
        kernels=OURS,
        parallel=fsdp(n),
        world_size=world,
        attention=attention,
        **kw,
    )


def test_one_shard_is_the_plan_without_context_parallelism():
    """N = 1 (the field's default) is exactly the plan of a recipe that never names it."""
    for ckpt in ("none", "full"):
        for attention in ("sdpa", "flex_attention"):
            base = Setting(
                micro_batch_size=2,
                seq_len=4096,
                checkpointing=ckpt,
                kernels=OURS,
                parallel=FSDPParallel(),
                world_size=4,
            )
            one = replace(base, parallel=fsdp(1), attention=attention)
            assert estimate(SHAPE, one) == replace(estimate(SHAPE, base), setting=one)


def test_shards_divide_the_per_token_terms_and_add_the_gathered_kv_and_the_mask():
    """Per GPU at N = 2 and 4: every per-token term over S/N tokens; each attention layer keeps
    the K and V gathered over all S (2·S·kv·D·2 bytes) instead of its shard's; the backward holds
    their gradients; sdpa's dense boolean mask [S/N × S] lives the whole step, and building it
    holds three booleans of that size; the model states do not change."""
    seq = 65536
    e = 2  # bf16
    gathered = 2 * seq * KV * D * e  # K and V over the whole row, one layer
    for n in (2, 4):
        t = seq // n
        for ckpt in ("none", "full"):
            one = estimate(SHAPE, setting(seq, 1, checkpointing=ckpt))
            cp = estimate(SHAPE, setting(seq, n, checkpointing=ckpt))
            assert cp.states == one.states
            # One layer's saved tensors (kernels on): norms x, rstd, output (twice), q, k, v, out,
            # lse, MLP gate, up, product; under CP k and v are the gathered ones.
            norms = 2 * (H * e + 4 + H * e)
            per_token = norms + (HEADS * D + HEADS * D) * e + HEADS * 4 + 3 * I * e
            local_kv = 2 * KV * D * e
            layer_one = seq * (per_token + local_kv)
            layer_cp = t * per_token + gathered
            mask = t * seq  # one byte an element, one row
            outside = t * (8 + 2 * D * e + H * e + 4 + H * e)  # ids, cos/sin, final norm (x, rstd), dh
            if ckpt == "none":
                assert one.activations[f"{L} layers × {layer_one / GIB:.2f} GiB"] == L * layer_one
                assert cp.activations[f"{L} layers × {layer_cp / GIB:.2f} GiB"] == L * layer_cp
            else:
                assert cp.activations[f"{L} checkpointed layers (their inputs)"] == L * t * H * e
                # The layer's input x, which our norm kernel saves, is the checkpoint's own.
                recomputed = cp.temporaries["one layer recomputed / copied back in backward"]
                assert recomputed == layer_cp - t * H * e
            assert cp.activations["outside the layers (cos/sin, final norm, loss)"] == outside
            assert cp.activations["context-parallel attention mask (the whole step)"] == mask
            # The MLP's moment: the arriving gradient and down_proj's input gradient (the swiglu
            # kernel writes gate's and up's over gate and up). The attention's, after the MLP's
            # saved tensors (post-norm output, gate, up, product) are freed: the arriving
            # gradient, q's, k's and v's, and the gathered K and V's. At this shape the MLP's is larger.
            mlp = t * (H + I) * e
            attention = t * (H + (HEADS + 2 * KV) * D) * e + gathered - t * (H + 3 * I) * e
            assert attention < mlp
            assert one.temporaries["one layer's backward"] == seq * (H + I) * e
            assert cp.temporaries["one layer's backward"] == mlp
            assert cp.temporaries["context-parallel mask being built (start of the forward)"] == 3 * mask
            states = sum(cp.states.values()) - cp.states["gradients (at the end of backward)"]
            assert cp.moments["context-parallel mask built (start of the forward)"] == states + 3 * mask
            assert cp.peak < one.peak


def test_flex_attention_keeps_a_block_mask_of_tiles():
    """flex_attention: the BlockMask over (S/N, S) in 128-token tiles, four int32 index tensors
    (partial and full, and their transposes) with their counts, and the predicate's int64
    position and document vectors; nothing dense is built."""
    seq, n, rows = 65536, 4, 2
    t = seq // n
    qt, kt = t // 128, seq // 128
    expected = 4 * rows * qt * kt * 4 + 2 * rows * (qt + kt) * 4 + (t + seq) * 8 + rows * (t + seq) * 8
    b = estimate(SHAPE, replace(setting(seq, n, "flex_attention"), micro_batch_size=rows))
    assert b.activations["context-parallel attention mask (the whole step)"] == expected
    assert not any("being built" in name for name in b.temporaries)


def test_rows_are_padded_to_a_multiple_of_twice_the_shards():
    """A row of 1001 tokens over 4 ranks is padded to 1008 (8 chunks of 126): 252 tokens each."""
    s = setting(1001, 4)
    assert (s.shard_len, s.row_len, s.tokens) == (252, 1008, 252)


def test_context_parallelism_is_proposed_for_a_long_row_that_fits_nowhere():
    """294,912 tokens of the 8B shape on 4 × 80 GiB with FSDP2: micro-batch 1 with full
    checkpointing does not fit without CP; the smallest N that fits is proposed, before
    shortening the rows; N = 2 alone does not fit, so 4 it is."""
    gpu = 80 * GIB
    seq = 294912
    flex = setting(seq, 1, "flex_attention")
    smallest = replace(flex, checkpointing="full")
    assert not estimate(SHAPE, smallest).fits(gpu)
    assert not estimate(SHAPE, replace(smallest, parallel=fsdp(2))).fits(gpu)
    assert estimate(SHAPE, replace(smallest, parallel=fsdp(4))).fits(gpu)
    assert cheapest_fix(SHAPE, flex, gpu) == "parallel.context_parallel=4"
    # sdpa's dense mask (16 GiB a GPU at N = 4, 48 GiB while it is built) costs more than flex's.
    sdpa4 = replace(smallest, parallel=fsdp(4), attention="sdpa")
    assert estimate(SHAPE, sdpa4).peak > estimate(SHAPE, replace(smallest, parallel=fsdp(4))).peak
    # Eight GPUs: FSDP2 shards the states over 8, and N = 2 is then the smallest that fits.
    eight = replace(smallest, world_size=8)
    assert not estimate(SHAPE, eight).fits(gpu)
    assert estimate(SHAPE, replace(eight, parallel=fsdp(2))).fits(gpu)
    assert cheapest_fix(SHAPE, replace(flex, world_size=8), gpu) == "parallel.context_parallel=2"


def test_context_parallelism_is_not_proposed_where_it_cannot_run():
    gpu = 80 * GIB
    flex = setting(262144, 1, "flex_attention")
    # One GPU: no ranks to split over.
    assert not cheapest_fix(SHAPE, replace(flex, world_size=1), gpu).startswith("parallel.context")
    # Two GPUs: N = 2 is all they allow, and it does not fit (test above).
    assert not cheapest_fix(SHAPE, replace(flex, world_size=2), gpu).startswith("parallel.context")
    # The model refuses to be split (a mixture of experts, sliding windows...).
    refused = replace(SHAPE, row_split_problem="a mixture-of-experts model")
    assert not cheapest_fix(refused, flex, gpu).startswith("parallel.context")
    # The recipe's rule refuses it: the problems come from the catalog, read by base_setting.
    refused_recipe = replace(flex, context_parallel_problems=("deepspeed",))
    assert not cheapest_fix(SHAPE, refused_recipe, gpu).startswith("parallel.context")


def test_recipes_say_whether_they_could_split_their_rows():
    """base_setting asks the catalog's rule at N = 2: fsdp with sdpa or flex can; deepspeed,
    eager attention, one process and a preference objective cannot; auto attention reads as
    flex_attention for packed rows and sdpa for padded ones."""

    def read(*overrides: str) -> Setting:
        return base_setting(load_recipe(QUICKSTART, list(overrides)), 4)

    ok = read("parallel.strategy=fsdp", "model.attn_implementation=flex_attention")
    assert ok.context_parallel_problems == () and ok.attention == "flex_attention"
    assert read("parallel.strategy=ddp").context_parallel_problems == ()
    for overrides in (
        ("parallel.strategy=deepspeed",),
        ("parallel.strategy=fsdp", "model.attn_implementation=eager"),
        ("parallel.strategy=none",),
    ):
        assert read(*overrides).context_parallel_problems, overrides
    assert read("parallel.strategy=fsdp", "data.packing=true").attention == "flex_attention"
    assert read("parallel.strategy=fsdp", "data.packing=false").attention == "sdpa"
