"""What autograd saves for backward, per token, and what the loss head and one layer's backward
allocate on top: the activation half of the memory plan (`ligertune.plan.estimate` explains the
model of a step and lists the assumptions).

`layer_saved` lists, tensor by tensor, what autograd keeps for backward in one Llama-style
decoder layer (RMSNorm → attention with RoPE → RMSNorm → gated MLP, as transformers 5.17
writes them), per token, with and without our kernels. A tensor saved by two nodes (the normed
hidden state feeds q, k and v) is counted once; views share their base's storage.

    HF eager                                         ours (kernels on)
    RMSNorm: x in fp32, x·rstd, rstd, output         RMSNorm kernel: x, rstd (+ the output, saved by the projections)
    RoPE: cos/sin only (shared by every layer)       RoPE kernel: cos/sin only (it saves temporaries, not activations)
    attention (sdpa/flash): q, k, v, out, lse        the same
    MLP: gate, silu(gate), up, silu(gate)·up         SwiGLU kernel: gate, up (+ the product, saved by down_proj)
    loss: fp32 log-probabilities [tokens × vocab]    fused linear CE: dh [tokens × hidden] and dW [vocab × hidden]
    distill: three fp32 [tokens × vocab]             fused distillation: dh and dW, as the fused CE

(``kernels/*.py`` say what each autograd Function saves.) Each tensor is tagged with the
sub-module whose operations save it (a norm's output is saved by the projections after it):
checkpointing a sub-module (``training.activation_checkpointing_modules``) drops its tensors and
keeps its input instead (`checkpointed_layer_saved`); checkpointing a whole layer keeps only the
layer's input. The listing is checked against a measurement on CPU (``tests/test_plan.py``:
``saved_tensors_hooks`` summing the unique storages of a tiny model's forward, with and without
sub-module checkpointing).

With ``training.tiled_mlp`` the dense MLP keeps only its input (the post-attention norm's
output, counted already): gate, up, act(gate) and the product exist for one tile of T tokens at a
time, in that layer's backward, where the tile's forward is run again (`mlp_tile_tokens`,
`layer_backward_bytes`); a whole-layer recompute keeps none of them either. A mixture of
experts is counted untiled (its routed blocks are not tiled).

A mixture of experts (`ModelShape.experts`) sizes the MLP rows by what one token goes through
(k expert widths and a shared expert's) and adds the experts' and the router's own tensors; with
``moe_experts`` on, the experts keep only their pre-activation gate/up rows. An estimate, not
checked against a measurement (docs/moe.md).

The loss head's chunking is the kernels' own (`ligertune.kernels.chunking`, plain arithmetic),
so the plan and the kernels cannot drift.
"""

from __future__ import annotations

from ligertune.catalog.shape import ModelShape
from ligertune.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES, DISTILL_BUFFERS, chunk_rows, sweep_rows
from ligertune.plan.setting import (
    GIB,
    Saved,
    Setting,
    checkpointed_layers,
    compute_bytes,
    stream_bytes,
)

# The norm a decoder layer starts with (its saved tensors' names begin with it).
LAYER_INPUT_NORM = "input_layernorm"


def _norm_saved(
    name: str,
    shape: ModelShape,
    s: Setting,
    fused: bool,
    output_saved: bool,
    consumer: str | None = None,
    width: int | None = None,
) -> list[Saved]:
    """A norm's saved tensors; its output when `output_saved`, as saved by the linear layers of
    the `consumer` sub-module. A norm of the residual stream by default; of `width` inside the
    attention (MLA's latents: a projection's output, in the compute dtype)."""
    es, ea, h = stream_bytes(s), compute_bytes(s), width or shape.hidden
    if width:
        es = ea
    if fused:  # our kernel: x and rstd (rms_norm.py `_rms_norm_setup`)
        saved = [Saved(f"{name}: input x", h, es), Saved(f"{name}: rstd", 1, 4)]
    else:  # HF: x.to(fp32) (pow, mul), rsqrt(var+eps) (mul), x·rstd in the input dtype (weight mul)
        saved = [
            Saved(f"{name}: input in fp32", h, 4),
            Saved(f"{name}: rstd", 1, 4),
            Saved(f"{name}: x·rstd", h, es),
        ]
    if output_saved:  # the next linear layers keep their input (autocast: its bf16 copy)
        saved.append(Saved(f"{name}: output (projections' input)", h, ea, consumer))
    return saved


def layer_saved(shape: ModelShape, s: Setting) -> list[Saved]:
    """What autograd saves for one decoder layer, per token (see the module docstring)."""
    ea, k = compute_bytes(s), s.kernels
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved = _norm_saved(LAYER_INPUT_NORM, shape, s, "rms_norm" in k, True, "attention")
    # RoPE, eager or ours, saves only cos and sin (once per model): q·cos needs cos for q's
    # gradient, and cos needs none.
    if s.shards > 1:
        # Context parallelism: the attention keeps the K and V it gathered over the whole row,
        # at the key/value heads (``enable_gqa``); the shard's own k and v are saved by nothing.
        keys = [
            Saved("attention: k gathered over the row (context parallel)", kv, ea, "attention", True),
            Saved("attention: v gathered over the row (context parallel)", kv, ea, "attention", True),
        ]
    else:
        kv_attn = kv if s.gqa_native else q  # repeat_kv expands k and v before sdpa
        keys = [
            Saved("attention: k", kv_attn, ea, "attention"),
            Saved("attention: v", kv_attn, ea, "attention"),
        ]
    if shape.latent:
        saved += _latent_saved(shape, s)
    else:
        saved += [
            Saved("attention: q", q, ea, "attention"),
            *keys,
            Saved("attention: output (o_proj's input)", q, ea, "attention"),
            Saved("attention: log-sum-exp", shape.heads, 4, "attention"),
        ]
    saved += _norm_saved("post_attention_layernorm", shape, s, "rms_norm" in k, True, "mlp")
    i = shape.intermediate
    if shape.experts and "moe_experts" in k:
        # Our experts kernel keeps only the pre-activation gate/up [T·k, 2I] (kernels/moe.py; the
        # input rows and the activation are recomputed in backward); the router keeps its fp32
        # probabilities. Approximation: a shared expert's rows (in `intermediate`) are counted
        # the same way, though its dense SwiGLU MLP also keeps its product.
        return saved + [
            Saved("experts: pre-activation gate/up (moe_experts)", 2 * i, ea, "mlp"),
            Saved("router: probabilities", shape.experts, 4, "mlp"),
        ]
    if not tiles_mlp(shape, s):
        saved += mlp_intermediates(shape, s)
    if shape.experts:
        # transformers' grouped_mm experts (integrations/moe.py) run on each token's k copies,
        # gathered and sorted by expert (the up projection's saved input), and keep the experts'
        # outputs for the routing weights' gradient; the router keeps its fp32 probabilities.
        # The gate/up rows above are `intermediate` = k expert widths (+ a shared expert) wide.
        k, h = shape.top_k, shape.hidden
        saved += [
            Saved("experts: each token's k input copies", k * h, ea, "mlp"),
            Saved("experts: outputs before the routing weights", k * h, ea, "mlp"),
            Saved("router: probabilities", shape.experts, 4, "mlp"),
        ]
    return saved


def _latent_saved(shape: ModelShape, s: Setting) -> list[Saved]:
    """What DeepSeek-V3's multi-head latent attention saves per token (`LatentAttention`, as
    transformers writes it): the latents' norms (q_a_layernorm, kv_a_layernorm) and their outputs,
    kept by q_b_proj and kv_b_proj (kv_a_layernorm's input is a view of kv_a_proj_with_mqa's
    output, which keeps k's rotary columns alive with it); q and k at every head's ``head_dim``
    (k's ``k_nope | k_rope`` is a new tensor), v as sdpa keeps it: a view of kv_b_proj's output,
    whose whole storage (``k_nope | v`` per head) it keeps alive; sdpa's output and its
    log-sum-exp, and o_proj's input, a copy: q is ``[B, H, S, D]`` in memory (a concatenation),
    so sdpa's output is too, and its ``[B, S, H·D]`` reshape copies it. RoPE keeps cos/sin;
    ours, for the interleaved layout, its own copies of their first halves, repeated
    (`ligertune.patching.rope.apply_rotary_pos_emb_interleave`), per layer. Checked against
    autograd's record on a tiny model, eager and ours, in fp32 (``tests/test_moe.py``)."""
    ea, latent, heads = compute_bytes(s), shape.latent, shape.heads
    fused = "rms_norm" in s.kernels
    saved = []
    if latent.q_rank:
        saved += _norm_saved("attention: q_a_layernorm", shape, s, fused, True, "attention", latent.q_rank)
    saved += _norm_saved("attention: kv_a_layernorm", shape, s, fused, True, "attention", latent.kv_rank)
    nope = shape.head_dim - latent.rope_dim
    saved += [
        Saved("attention: q", heads * shape.head_dim, ea, "attention"),
        Saved("attention: k", heads * shape.head_dim, ea, "attention"),
        Saved(
            "attention: k's rotary columns (kv_a_layernorm's input is a view)",
            latent.rope_dim,
            ea,
            "attention",
        ),
        Saved("attention: v (kv_b_proj's output)", heads * (nope + latent.v_head_dim), ea, "attention"),
        Saved("attention: output", heads * latent.v_head_dim, ea, "attention"),
        Saved("attention: log-sum-exp", heads, 4, "attention"),
        Saved("attention: o_proj's input (the output, copied)", heads * latent.v_head_dim, ea, "attention"),
    ]
    if "rope" in s.kernels:
        saved.append(
            Saved("rope: cos and sin halves, repeated (per layer)", 2 * latent.rope_dim, ea, "attention")
        )
    return saved


def tiles_mlp(shape: ModelShape, s: Setting) -> bool:
    """Whether the layers' MLP runs in tiles (``training.tiled_mlp`` on a dense model)."""
    return s.tiled_mlp is not False and not shape.experts


def mlp_tile_tokens(shape: ModelShape, s: Setting) -> int:
    """Tokens whose MLP intermediates exist at once: this GPU's tokens of the micro-batch, or
    with a tiled MLP one tile of them (true: the hidden size; `ligertune.training.transforms.tiled_mlp`)."""
    if not tiles_mlp(shape, s):
        return s.tokens
    return min(s.tokens, shape.hidden if s.tiled_mlp is True else s.tiled_mlp)


def mlp_intermediates(shape: ModelShape, s: Setting) -> list[Saved]:
    """What the gated MLP saves per token beyond its input: gate and up, act(gate) without our
    fused kernel (which recomputes it), and the product down_proj keeps."""
    ea, i = compute_bytes(s), shape.intermediate
    saved = [Saved("mlp: gate", i, ea, "mlp"), Saved("mlp: up", i, ea, "mlp")]
    if not ({"swiglu", "geglu"} & s.kernels):
        saved.append(Saved("mlp: act(gate)", i, ea, "mlp"))
    return saved + [Saved("mlp: act(gate)·up (down_proj's input)", i, ea, "mlp")]


def checkpointed_layer_saved(shape: ModelShape, s: Setting) -> list[Saved]:
    """What a layer whose sub-modules `s.modules` are checkpointed saves, per token: the rest of
    `layer_saved`, and each checkpoint's input (the normed hidden state, in the stream dtype:
    under autocast the checkpoint keeps the norm's output, not the projections' bf16 copy)."""
    kept = [t for t in layer_saved(shape, s) if t.module not in s.modules]
    return kept + [
        Saved(f"{m}: input (kept by its checkpoint)", shape.hidden, stream_bytes(s)) for m in s.modules
    ]


def recomputed_bytes(shape: ModelShape, s: Setting) -> int:
    """What one checkpointed layer materialises again in backward: all it saves (whole layers),
    or what its checkpointed sub-modules save. A whole layer's input is its checkpoint's, counted
    with the saved activations: our RMSNorm kernel saves that very tensor, so it is not counted
    again here."""
    saved = layer_saved(shape, s)
    if s.whole_layers:
        saved = [t for t in saved if t.name != f"{LAYER_INPUT_NORM}: input x"]
    else:
        saved = [t for t in saved if t.module in s.modules]
    return sum(saved_bytes(t, s) for t in saved)


# The activations' part that lives until the end of the backward (`estimate` counts it there too).
CONTEXT_PARALLEL_MASK = "context-parallel attention mask (the whole step)"

# FlexAttention's tile (`ligertune.models.attention.FLEX_BLOCK`, which imports torch).
FLEX_BLOCK = 128

# The loss head's tensors (`model_saved`): one per token that reaches the loss (`Setting.head_tokens`).
HEAD = "loss head"


def saved_bytes(t: Saved, s: Setting) -> int:
    """A saved tensor's bytes in setting `s`: over the loss head's tokens for the head's own
    tensors, over the whole rows for a `Saved.whole_row` one, over this GPU's tokens of the
    micro-batch for the rest."""
    if t.module == HEAD:
        return t.bytes(s.head_tokens)
    return t.bytes(s.rows * s.row_len if t.whole_row else s.tokens)


def model_saved(shape: ModelShape, s: Setting) -> list[Saved]:
    """What is saved once per model, outside the decoder layers: the input ids, cos/sin, and the
    tensors of the final norm and the loss head (`head_saved`; the fused CE's dW is per model:
    see `head_fixed_bytes`)."""
    # cos/sin follow the position ids: one row per sequence position, or per token when packed
    # rows carry their own; counted per token (the larger).
    return [
        Saved("input ids (the embedding's backward)", 1, 8),
        Saved("rope: cos and sin (shared by the layers)", 2 * shape.rotary_dim, compute_bytes(s)),
        *head_saved(shape, s),
    ]


def head_saved(shape: ModelShape, s: Setting) -> list[Saved]:
    """The final norm's and the loss head's saved tensors: the first nodes of the backward, so
    they are freed before the last layer's backward starts (`estimate`'s "start of backward")."""
    k = s.kernels
    head = head_path(s)
    saved = _norm_saved("final norm", shape, s, "rms_norm" in k, head != "fused")
    if head == "fused":  # the gradients, computed in the forward
        saved.append(Saved("loss: fused CE dh", shape.hidden, compute_bytes(s), HEAD))
    elif head == "ce":  # the logits' gradient, written over the logits
        saved.append(Saved("loss: logits' gradient", shape.vocab, compute_bytes(s), HEAD))
    elif s.loss_head == "distillation":  # `distillation_token_losses` on the whole batch's logits
        saved += [
            Saved("loss: student fp32 log-probabilities (CE)", shape.vocab, 4, HEAD),
            Saved("loss: student fp32 log-probabilities at T (divergence)", shape.vocab, 4, HEAD),
            Saved("loss: teacher fp32 probabilities (divergence)", shape.vocab, 4, HEAD),
            Saved("loss: targets", 1, 8, HEAD),
        ]
    else:  # log_softmax keeps its fp32 output, nll_loss (or the log-probs' gather) the targets
        saved += [
            Saved("loss: fp32 log-probabilities", shape.vocab, 4, HEAD),
            Saved("loss: targets", 1, 8, HEAD),
        ]
    return saved


def head_path(s: Setting) -> str:
    """How the lm_head and the loss run: ``fused`` (our fused linear CE, and for the other
    objectives its log-prob and distillation kernels: no [tokens × vocab] logits), ``ce`` (our
    cross entropy on HF's logits: only sft's loss goes through it) or ``eager`` (the logits,
    then torch's log_softmax: sft without kernels, and the objectives' materialised paths)."""
    if "fused_linear_cross_entropy" in s.kernels:
        return "fused"
    return "ce" if "cross_entropy" in s.kernels and s.loss_head == "causal" else "eager"


def head_fixed_bytes(shape: ModelShape, s: Setting) -> int:
    """The fused CE's lm_head gradient [vocab × hidden], held from the forward to the backward
    (the fused log-prob and distillation kernels hold theirs the same way)."""
    if head_path(s) != "fused":
        return 0
    return shape.vocab * shape.hidden * compute_bytes(s)


def loss_temporary_bytes(shape: ModelShape, s: Setting) -> int:
    """What the loss head allocates on top of what it saves, at its peak."""
    n, v, ea = s.head_tokens, shape.vocab, compute_bytes(s)
    head = head_path(s)
    wide = 4 if ea != 4 else 0  # an fp32 dW accumulator over chunks (none for fp32 weights)
    if head == "fused" and s.loss_head == "distillation" and s.frozen is not None:
        # `fused_linear_distillation`, inside the teacher's lm_head call: per chunk both models'
        # logits and its fp32 buffers (the kernel's own count), the fp32 dW accumulator it always
        # allocates, and the teacher's final hidden states (its lm_head's input).
        rows = chunk_rows(n, v, 4 * DISTILL_BUFFERS, DEFAULT_MEMORY_BUDGET_BYTES)
        return (
            rows * v * (4 * DISTILL_BUFFERS + 2 * ea)
            + v * shape.hidden * wide
            + (n * s.frozen.hidden * stream_bytes(s))
        )
    if head == "fused" and s.loss_head == "pairs":
        # `pair_sequence_loss`: chunks of whole pairs (at least one, 2 × seq_len rows, whatever
        # the budget), and the fp32 dW accumulator when there are several chunks.
        pair_rows = s.rows_per_sample * s.seq_len
        pairs = chunk_rows(s.micro_batch_size, pair_rows * v, ea, DEFAULT_MEMORY_BUDGET_BYTES)
        accumulator = v * shape.hidden * wide if pairs < s.micro_batch_size else 0
        return pairs * pair_rows * v * ea + accumulator
    if head == "fused" and s.loss_head == "policy":
        # `fused_linear_policy_loss`: chunks of whole completions (at least one, generated_tokens
        # rows, whatever the budget), the completion positions' hidden states copied contiguous
        # [N, H], and the fp32 dW accumulator when there are several chunks.
        rows = chunk_rows(s.rows, s.generated_tokens * v, ea, DEFAULT_MEMORY_BUDGET_BYTES)
        accumulator = v * shape.hidden * wide if rows < s.rows else 0
        return rows * s.generated_tokens * v * ea + n * shape.hidden * ea + accumulator
    if head == "fused":
        rows = sweep_rows(
            n, v, shape.hidden, ea, DEFAULT_MEMORY_BUDGET_BYTES, accumulator_bytes=wide, weight_bytes=ea
        )
        accumulator = shape.vocab * shape.hidden * wide if rows < n else 0
        return rows * v * ea + accumulator
    if head == "ce":  # the logits (then their gradient in place) and the fp32 row stats
        return n * 8
    if s.loss_head == "distillation":
        # On top of the three saved fp32 tensors, in `distillation_token_losses`' forward: both
        # models' logits, their fp32 copies (none in fp32), the teacher's log-probabilities, and
        # the divergence's difference and product.
        return n * v * (2 * ea + (8 if ea != 4 else 0) + 12)
    # On top of the saved fp32 log-probabilities, at log_softmax's backward: their gradient and
    # the logits' fp32 gradient. The logits in the compute dtype are gone by then (nothing saves
    # them), and the gradient's compute-dtype copy is made after the two fp32 inputs of that
    # backward are freed. Counting a compute-dtype [N, V] on top over-predicted every measured
    # eager peak by exactly that tensor (1B bs8 and bs4-full on an H100, a 4-layer model).
    return n * v * 8


def layer_backward_bytes(shape: ModelShape, s: Setting) -> int:
    """Working set of one decoder layer's backward on top of what the layer saved, at the larger
    of its two moments. The MLP's, which comes first: the gradient arriving at the layer and,
    at down_proj's backward, the gradient of its [tokens × intermediate] input (without the fused
    kernel, at the product's backward, act(gate)'s and up's: two; ours then writes gate's and
    up's gradients over the saved gate and up), over `mlp_tile_tokens`, and with a tiled MLP the
    tile's recomputed intermediates. The attention's, once the MLP's saved tensors are freed:
    the arriving gradient, q's, k's and v's, and under context parallelism the gradients of the
    gathered K and V (`gathered_kv_gradient_bytes`). Measured on CPU by a dispatch mode that
    follows every storage through a checkpointed layer's backward (``tests/test_plan.py``)."""
    ea = compute_bytes(s)
    gated = 1 if {"swiglu", "geglu"} & s.kernels else 2
    tile = mlp_tile_tokens(shape, s)
    arriving = s.tokens * shape.hidden * ea
    mlp = arriving + tile * gated * shape.intermediate * ea
    if tiles_mlp(shape, s):
        mlp += sum(t.bytes(tile) for t in mlp_intermediates(shape, s))
    mlp_saved = sum(saved_bytes(t, s) for t in layer_saved(shape, s) if t.module == "mlp")
    qkv = s.tokens * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * ea
    attention = arriving + qkv + gathered_kv_gradient_bytes(shape, s) - mlp_saved
    return max(mlp, attention)


def gathered_kv_gradient_bytes(shape: ModelShape, s: Setting) -> int:
    """Context parallelism: the attention's backward returns the gradients of the K and V it
    gathered, over the whole rows (the reduce-scatter's input: every rank's queries' share of
    every rank's keys), while the gathered K and V it saved are still alive (counted with the
    layer's saved or recomputed tensors). Each gradient is then cut into contiguous pieces for
    the reduce-scatter (a copy of one gradient at a time, after the attention's saved tensors
    are freed: less than this moment). 0 without context parallelism."""
    if s.shards == 1:
        return 0
    return 2 * s.rows * s.row_len * shape.kv_heads * shape.head_dim * compute_bytes(s)


def context_parallel_mask_bytes(s: Setting) -> int:
    """The context-parallel attention mask (`ligertune.models.attention.shard_mask`), built once
    per forward in a pre-hook on the base model and alive until the first layer's backward is
    done (every layer's attention, and a checkpointed layer's saved inputs, refer to it): for
    sdpa a dense boolean ``[rows, 1, S/N, S]`` (1 byte an element); for flex_attention a
    `BlockMask` over ``(S/N, S)`` in 128-token tiles: four int32 index tensors ``[rows, 1,
    tiles, tiles]`` (the key tiles of each query tile, partial and full, and their transposes
    for the backward), their four int32 counts, and the mask predicate's int64 vectors (query
    and key positions, their document ids). 0 without context parallelism."""
    n, rows, q, k = s.shards, s.rows, s.shard_len, s.row_len
    if n == 1:
        return 0
    if s.attention != "flex_attention":
        return rows * q * k
    q_tiles, k_tiles = -(-q // FLEX_BLOCK), -(-k // FLEX_BLOCK)
    indices = 4 * rows * q_tiles * k_tiles * 4
    counts = 2 * rows * (q_tiles + k_tiles) * 4
    predicate = (q + k) * 8 + rows * (q + k) * 8
    return indices + counts + predicate


def context_parallel_mask_build_bytes(s: Setting) -> int:
    """What building sdpa's dense mask holds at once, at the start of the forward: the causal
    comparison ``[S/N, S]``, the same-document comparison ``[rows, S/N, S]`` and their product
    (the mask), all boolean. FlexAttention's `BlockMask` is built tile by tile (compiled on a
    GPU): nothing dense. 0 without context parallelism or with flex."""
    if s.shards == 1 or s.attention == "flex_attention":
        return 0
    return (1 + 2 * s.rows) * s.shard_len * s.row_len


def activation_bytes(shape: ModelShape, s: Setting) -> dict[str, int]:
    """Saved activations on the GPU at the end of the forward, by part. Offloaded layers count
    as two of the largest one: when the loss is computed the last layer's tensors are still
    referenced, and the layer before it is held until its device→host copy is done
    (`ligertune.training.transforms.offload`). The copies run at PCIe speed, slower than a layer's
    forward, so that copy is still in flight: counting one layer under-predicted the measured
    1B peak on an H100 by 10.0%, one layer's tensors."""
    n = s.tokens
    checkpointed = checkpointed_layers(shape.layers, s)
    plain = shape.layers - checkpointed
    parts = {}
    kept: list[tuple[str, int]] = []  # (what, bytes per layer) of the layers that keep activations
    if checkpointed and s.whole_layers:
        parts[f"{checkpointed} checkpointed layers (their inputs)"] = (
            checkpointed * n * shape.hidden * stream_bytes(s)
        )
    elif checkpointed:
        each = sum(saved_bytes(t, s) for t in checkpointed_layer_saved(shape, s))
        kept.append(
            (f"{checkpointed} layers recomputing {', '.join(s.modules)} × {each / GIB:.2f} GiB", each)
        )
        parts[kept[-1][0]] = checkpointed * each
    if plain:
        each = layer_activation_bytes(shape, s)
        kept.append((f"{plain} layers × {each / GIB:.2f} GiB", each))
        parts[kept[-1][0]] = plain * each
    if s.offload and kept:
        for what, _ in kept:
            del parts[what]
        parts[f"{' and '.join(what for what, _ in kept)} (offloaded to CPU: two on the GPU at a time)"] = (
            2 * max(each for _, each in kept)
        )
    parts["outside the layers (cos/sin, final norm, loss)"] = sum(
        saved_bytes(t, s) for t in model_saved(shape, s)
    )
    fixed = head_fixed_bytes(shape, s)
    if fixed:
        parts["fused CE: lm_head gradient"] = fixed
    mask = context_parallel_mask_bytes(s)
    if mask:
        parts[CONTEXT_PARALLEL_MASK] = mask
    return parts


def layer_activation_bytes(shape: ModelShape, s: Setting) -> int:
    """What one decoder layer not checkpointed saves."""
    return sum(saved_bytes(t, s) for t in layer_saved(shape, s))
