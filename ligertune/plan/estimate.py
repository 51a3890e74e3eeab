"""How much GPU memory a training step needs: the arithmetic behind ``ligertune plan`` and the
``auto`` choices of ``training.activation_checkpointing`` and ``training.micro_batch_size``.

Everything here is counted from shapes, never measured: a `ModelShape` (read from the model's
config and an empty, meta-device build) and a `Setting` (batch, checkpointing, offload,
kernels, precision, the parallel strategy and world size, and what the objective adds: rows per
sample, how its loss runs at the lm_head, a frozen model). The result is a `Breakdown`: named byte counts per GPU, grouped into model
states, activations, temporaries and allocator headroom, and the predicted peak.

The model of a step
-------------------
The tokens of a micro-batch are ``micro_batch_size × seq_len``, twice that for preference and
kto data: a micro-batch of B pairs is one [2B, S] batch (`ligertune.data.preference`), and the
policy's forward and backward run over all 2B rows at once, so every per-token count
(activations, the loss head, the working sets) is of 2B rows.

The peak allocated memory of a training step is the largest of three moments (four with a
frozen reference, five with an objective that generates, one more with a frozen vision tower):

1. *the loss*: the end of the forward, when every saved activation is alive, plus the loss
   head's temporaries (eager: the ``[tokens × vocab]`` logits, their fp32 copy, log-softmax and
   its gradient; fused linear cross entropy: one chunk buffer and the fp32 dW accumulator);
2. *the start of backward*, the last layer's backward: every saved activation but the final
   norm's and the loss head's (their backward, the first, has freed them), the loss head's
   gradients, and the working set of one layer's backward (with checkpointing: that layer's
   recomputed activations too, the whole layer's or its checkpointed sub-module's; with
   offload: one layer's tensors copied back ahead of their backward);
3. *the end of backward / the optimizer step*: every gradient, the last layer's working set;
4. *the frozen reference's forward* (an objective with a frozen reference and no LoRA):
   the reference's log-probs are computed first, under ``no_grad``, before the policy's forward
   (`ligertune.objectives.pairs`), so none of the policy's activations are alive and the
   reference saves none of its own: its gathered weights (sharded strategies), one layer's
   forward working set and its log-prob head (fused: one chunk of `fused_linear_logprobs`;
   materialised: the logits, their fp32 copy and its log_softmax) are the temporaries.

5. *the generation* (an objective that generates its completions, grpo: `generation_bytes`):
   before the step, so no gradients and no saved activations; the KV cache of the window's rows
   (every micro-batch of the step, generated as one batch) at their full length, the prefill's
   one-layer working set, the sampling's temporaries of the last position's logits, and under
   FSDP2 every layer gathered at once (the gathered weights serve every token:
   `ligertune.distributed.fsdp.FSDPRuntime.gathered`). Its loss head (``policy``) runs on the
   completion positions only (`Setting.head_tokens`): chunks of whole completions, at least one
   (``generated_tokens`` × vocab logits) whatever the budget.

6. *the frozen vision tower's forward* (a vision-language model whose tower does not train):
   at the start of the forward, before the language model's; one block's tensors at a time,
   nothing saved (`ligertune.plan.vision`). A tower that trains adds its saved activations to
   the others instead.

A distillation teacher's forward runs *inside* the student's loss: on the fused path the
student's lm_head call runs the teacher's forward, whose own lm_head call computes the loss
(`ligertune.objectives.distill`); on the materialised path it runs right after the student's
forward, with the student's logits alive. So it is counted at the loss moment: every saved
activation of the student, the teacher's gathered weights, and the larger of one teacher
layer's forward working set and the distillation loss head (fused: the kernel's chunk buffers,
both models' chunk logits, its fp32 dW accumulator and the teacher's final hidden states;
materialised: both models' logits and the fp32 tensors of `distillation_token_losses`).

Model states (weights, gradients, AdamW moments, fp32 master weights, the bf16 weight copies
that autocast keeps, FSDP2's gathered layers, ZeRO-3's prefetch, a frozen reference's or
teacher's weights) sit under all of them. The gradients are counted only where they exist:
``zero_grad(set_to_none=True)`` frees them after each step, so at the loss only the loss head's
own gradient (which the fused kernel computes in the forward) is there.

A frozen model (`ligertune.objectives.reference.build_frozen`: a dpo/kto reference, from
``objective.reference_model`` or the model section, or the distill ``objective.teacher``, which
may be another size; its shape comes from its own meta-device build) holds its weights for the
whole run, in `build_model`'s parameter dtype (bf16 for bf16, fp32 for bf16-mixed and fp32,
autocast casting per matmul; ZeRO-3's engine: bf16 module weights), with no gradients and no
optimizer state. Placed as the strategy places the policy (``wrap_frozen``): a whole replica on
each GPU (none, DDP, ZeRO-1/2); sharded per decoder layer and root under FSDP2 (weights/world
on each GPU, plus while its forward runs two gathered layers and its root, always resharded
after forward) and ZeRO-3 (an inference engine: the same). With LoRA a reference is the policy
with its adapters off: no second model, and its no-grad forward holds less than the policy's
own (one layer's working set against every saved activation, and the loss head's no-grad pass
against its training one), so it adds nothing. orpo and simpo have no reference, and a
precomputed one lives in the data.

Activations (what autograd saves, tensor by tensor) are counted in `ligertune.plan.activations`.

Context parallelism (``parallel.context_parallel: N``, `Setting.shards`) changes the activations
and temporaries only; the model states are the strategy's over the whole world, as without it.
Every per-token count is of this GPU's shard of each row (2 chunks of S/(2N) tokens, the row
padded to a multiple of 2N). On top, what `ligertune.models.attention` allocates: each
attention layer gathers K and V over the whole row, ``2 · S · kv_heads · head_dim`` elements,
and keeps them for its backward instead of the shard's own (`activations.layer_saved`: in every
layer not checkpointed, and in the layer being recomputed); its backward holds their
whole-row gradients, the reduce-scatter's input (`activations.gathered_kv_gradient_bytes`,
in the backward working set); and one mask serves every layer from the forward's pre-hook to
the first layer's backward (`activations.context_parallel_mask_bytes`: sdpa's dense boolean
``[S/N, S]`` per row, or flex's BlockMask), counted at every moment. Building sdpa's mask holds
three dense booleans at once before the first layer, a moment of its own. The all-gather's
transient pieces (one tensor's N shards next to their concatenation, during a layer's forward
or recomputation) come before that layer's backward peak and are smaller than it.

Dtypes: the *compute* dtype (matmul outputs: bf16 unless fp32) and the *stream* dtype (the
residual stream between layers: fp32 for fp32, and for bf16-mixed where autocast alone
casts, i.e. without FSDP2's or DeepSpeed's bf16 parameters; bf16 otherwise).

Assumptions (what the GPU check, ``scripts/gpu_plan_accuracy.sh``, validates)
------------------------------------------------------------------------------
- Every row is ``max_seq_len`` tokens (packed rows, or padding to the longest row at worst);
  preference and kto data put two rows per sample in the micro-batch.
- Attention keeps q, k, v, out and the log-sum-exp (flash, cuDNN, flex, CPU flash); k and v at
  the key/value heads when the backend handles GQA natively, else expanded (``gqa_native``).
- The eager loss holds three fp32 ``[tokens × vocab]`` tensors at its peak, in log_softmax's
  backward: the saved log-probabilities, their gradient and the logits' fp32 gradient (checked
  against the measured eager peaks of docs/benchmarks.md, within 0.4%); ``cross_entropy`` keeps one
  gradient-sized tensor; fused linear CE one chunk buffer (the kernel's own `sweep_rows`) and,
  with several chunks and bf16 weights, its fp32 dW accumulator.
- The preference objectives' fused lm_head is counted as its kernel runs it: those whose loss
  head is ``pairs`` (each objective declares it) evaluate the loss per chunk of whole pairs (`pair_sequence_loss`: at least one pair,
  2 × seq_len rows, whatever the budget; an fp32 dW accumulator with several chunks) and keep
  dh and dW as the fused CE does; the ``logprobs`` head's two-step path (the fused CE with ``reduction="none"``,
  which computes dh and dW in the backward instead) is counted as the fused CE, the same bytes
  at slightly different moments. Their materialised paths (kernels off; our cross entropy kernel
  serves only the ``causal`` head) keep the fp32 log-probabilities, as eager sft does.
- A layer's backward holds, next to what the layer saved, the larger of two moments: the
  MLP's (the arriving gradient and the gradient of down_proj's input; two [tokens ×
  intermediate] gradients without the fused kernel) and the attention's, once the MLP's saved
  tensors are freed (q's, k's and v's gradients, and under context parallelism the gathered K
  and V's) (`layer_backward_bytes`). Counting four hidden-sized gradients and both moments at
  once over-predicted the measured peaks of full checkpointing by 3-5% at 32k tokens a GPU and
  by 14-22% at 262k-1M tokens under context parallelism (docs/benchmarks.md); a storage-by-storage
  measurement on CPU agrees with this count within 4% (``tests/test_plan.py``). A frozen layer's no-grad
  forward holds about the MLP's gate, up and product and a few hidden-sized tensors
  (`frozen_layer_forward_bytes`).
- A frozen model's temporaries are counted at the moment its forward runs, on top of every
  state counted at the loss, FSDP2's and ZeRO-3's gathered policy layers and root included:
  while the reference runs, before the policy's forward, those are not gathered yet, so that
  moment is overcounted by them (it is rarely the peak).
- The eager distillation holds, for forward or reverse KL, three saved fp32 [tokens × vocab]
  tensors and, at its forward's peak, both models' logits, their fp32 copies and three more fp32
  tensors; JSD keeps a couple more (its mixture), not counted.
- Offload keeps two layers' saved tensors on the GPU at the loss: the last layer's (still
  referenced) and the one before it (its copy to the CPU still in flight); in backward, one more,
  the layer prefetched back.
- AdamW keeps two moments in the parameters' dtype; fp32 master weights for bf16-mixed; LoRA
  trains only its adapters, and ``model.freeze`` leaves the parts it names untrained (frozen
  weights have no gradient or moments: `ModelShape.trainable`).
- A vision-language model's images: as many of the largest image as a row holds, the tower's
  blocks counted per patch (`ligertune.plan.vision`).
- How a strategy spreads the model states over the GPUs, and places a frozen model, is its own
  (`ligertune.catalog.strategies`: the ``memory_*`` and ``frozen_memory`` methods of each).
  FSDP2: each decoder layer is a unit; one is gathered at a time plus one prefetched, in bf16
  with ``mixed_precision``; the root (embeddings, final norm, lm_head) stays gathered from forward
  to backward; gradients are reduced in fp32 through a layer-sized buffer. DeepSpeed: ZeRO-1/2/3
  with bf16 module weights and fp32 master weights and moments in the optimizer; ZeRO-3
  prefetches about one layer ahead.
- Context parallelism: the terms above are read from the code, not measured on a GPU. SDPA
  may turn the boolean mask into an additive one in the compute dtype inside each call, which
  some of its kernels keep for backward: not counted (long rows should use flex_attention, whose
  mask is small). ``auto`` attention is read as flex_attention for packed rows and sdpa for
  padded ones (a GPU without flash-attn, which context parallelism refuses).
- The caching allocator's fragmentation is not modelled: a fixed headroom fraction of the GPU
  is kept free (`HEADROOM_FRACTION`) when deciding what fits.
"""

from __future__ import annotations

from dataclasses import replace

from ligertune.catalog.shape import ModelShape
from ligertune.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows
from ligertune.plan.activations import (
    CONTEXT_PARALLEL_MASK,
    activation_bytes,
    context_parallel_mask_build_bytes,
    head_path,
    head_saved,
    layer_activation_bytes,
    layer_backward_bytes,
    loss_temporary_bytes,
    recomputed_bytes,
    saved_bytes,
)
from ligertune.plan.setting import Breakdown, Setting, compute_bytes, stream_bytes, weight_bytes
from ligertune.plan.vision import frozen_tower_bytes, vision_activation_bytes


def state_bytes(shape: ModelShape, s: Setting) -> tuple[dict[str, int], int]:
    """Persistent model states per GPU, and the gradients' bytes (counted where they exist): the
    strategy's (`ParallelOptions.memory_states`), and a frozen model's weights."""
    states, grads = s.parallel.memory_states(shape, s.precision, s.world_size)
    if s.frozen is not None:
        weights, _, held = s.parallel.frozen_memory(s.frozen, s.precision, s.world_size)
        states[f"frozen {s.frozen_role} ({held})"] = weights
    return states, grads


# --------------------------------------------------------------------------------------------
# A frozen reference or teacher's forward
# --------------------------------------------------------------------------------------------


def frozen_layer_forward_bytes(frozen: ModelShape, s: Setting) -> int:
    """One decoder layer of the frozen model running forward under ``no_grad``: nothing is
    saved, so what is alive is the residual stream and the layer's largest intermediates, the
    MLP's gate, up and their product [tokens × intermediate] and a few hidden-sized tensors."""
    return s.tokens * (3 * frozen.intermediate * compute_bytes(s) + 4 * frozen.hidden * stream_bytes(s))


def frozen_head_bytes(frozen: ModelShape, s: Setting) -> int:
    """The reference's log-probs under ``no_grad``: its final hidden states and, fused, one
    [rows × vocab] chunk of `fused_linear_logprobs` (losses only, no gradient pass); else the
    materialised path's logits, their fp32 copy and its log_softmax (`logps_from_logits`)."""
    n, v, ea = s.tokens, frozen.vocab, compute_bytes(s)
    hidden = n * frozen.hidden * stream_bytes(s)
    if head_path(s) == "fused":
        return hidden + chunk_rows(n, v, ea, DEFAULT_MEMORY_BUDGET_BYTES) * v * ea
    return hidden + n * v * (ea + 4 + (4 if ea != 4 else 0))


TEACHER_LAYER = "frozen teacher: one layer's forward (no grad)"


def frozen_temporaries(s: Setting) -> dict[str, int]:
    """What the frozen model's forward holds while it runs, by part (its weights are a state)."""
    if s.frozen is None:
        return {}
    f, parts = s.frozen, {}
    _, gathered, _ = s.parallel.frozen_memory(f, s.precision, s.world_size)
    if gathered:
        parts[f"frozen {s.frozen_role}: {s.parallel.label} gathered layers (current + prefetch) and root"] = (
            gathered
        )
    if s.frozen_role == "teacher":
        parts[TEACHER_LAYER] = frozen_layer_forward_bytes(f, s)
    else:
        parts["frozen reference: one layer's forward (no grad)"] = frozen_layer_forward_bytes(f, s)
        parts["frozen reference: log-probs head (no grad)"] = frozen_head_bytes(f, s)
    return parts


# --------------------------------------------------------------------------------------------
# An objective's generation phase
# --------------------------------------------------------------------------------------------


def generation_bytes(shape: ModelShape, s: Setting) -> dict[str, int]:
    """What generating a window's completions holds on top of the states (an objective with
    `Setting.generated_tokens`, before the step: no gradients, no saved activations), by part.
    The window (``accumulation`` micro-batches) is generated as one batch: the KV cache of its
    rows at their full length (``seq_len``: prompt and completion), the prefill's one-layer
    working set (a no-grad forward over the prompts), the last position's logits and the
    sampling's fp32 copies (softmax, top-p's sort with its int64 indices and the scatter back,
    the cumulative sum), and the strategy's whole model gathered (FSDP2: every layer)."""
    if not s.generated_tokens:
        return {}
    ea, window = compute_bytes(s), replace(s, micro_batch_size=s.micro_batch_size * s.accumulation)
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * window.rows * s.seq_len * ea
    parts = {
        f"generation: KV cache ({window.rows} rows × {s.seq_len} tokens)": kv,
        "generation: one layer's prefill forward (no grad)": frozen_layer_forward_bytes(shape, window),
        "generation: last position's logits and sampling": window.rows
        * shape.vocab
        * (ea + 4 + 4 + 12 + 4 + 4),
    }
    gathered = s.parallel.memory_whole_gathered(shape, s.precision)
    if gathered:
        parts[f"generation: {s.parallel.label} whole model gathered"] = gathered
    return parts


# --------------------------------------------------------------------------------------------
# The breakdown
# --------------------------------------------------------------------------------------------


VISION_FORWARD = "frozen vision tower: one block's forward (nothing saved)"


def estimate(shape: ModelShape, s: Setting) -> Breakdown:
    """The per-GPU memory of one training step in setting `s` (see the module docstring)."""
    b = Breakdown(s)
    b.states, grads = state_bytes(shape, s)
    b.activations = activation_bytes(shape, s) | vision_activation_bytes(shape, s)
    # In backward, one layer's tensors come back: copied back from the CPU (the prefetch), or
    # recomputed (a whole layer, or its checkpointed sub-module).
    if s.offload:
        recompute = layer_activation_bytes(shape, s)
    else:
        recompute = recomputed_bytes(shape, s) if s.checkpointing != "none" else 0
    b.temporaries = {
        "loss head at its peak": loss_temporary_bytes(shape, s),
        "one layer's backward": layer_backward_bytes(shape, s),
    }
    if recompute:
        b.temporaries["one layer recomputed / copied back in backward"] = recompute
    reduction = s.parallel.memory_temporaries(shape, s.precision)
    b.temporaries.update(reduction)
    frozen = frozen_temporaries(s)
    b.temporaries.update(frozen)
    states = sum(b.states.values())
    saved = sum(b.activations.values())
    head_grad = shape.head_params * weight_bytes(s) // s.parallel.lm_head_gradient_share(s.world_size)
    backward = b.temporaries["one layer's backward"] + recompute
    head_freed = sum(saved_bytes(t, s) for t in head_saved(shape, s))
    loss = b.temporaries["loss head at its peak"]
    if s.frozen is not None and s.frozen_role == "teacher":
        # The teacher's forward runs inside the student's loss (its lm_head call, or right after
        # its forward on the materialised path): every saved activation is alive, the teacher's
        # gathered weights too, and its layers' working set comes before the loss head's peak.
        _, gathered, _ = s.parallel.frozen_memory(s.frozen, s.precision, s.world_size)
        loss = gathered + max(loss, frozen[TEACHER_LAYER])
    b.moments = {
        "loss (end of forward)": states + saved + loss,
        # The last layer's backward: the loss head's and the final norm's tensors are freed.
        "start of backward": states + saved - head_freed + head_grad + backward,
        "end of backward": states
        + grads
        + backward
        + sum(reduction.values())
        + b.activations.get(CONTEXT_PARALLEL_MASK, 0),
    }
    build = context_parallel_mask_build_bytes(s)
    if build:  # the pre-hook, before the first layer: nothing saved yet, no gradients
        b.temporaries["context-parallel mask being built (start of the forward)"] = build
        b.moments["context-parallel mask built (start of the forward)"] = states + build
    if s.frozen is not None and s.frozen_role == "reference":
        # Before the policy's forward (its activations not yet alive), no gradients (as at the
        # loss): the reference's log-probs under no_grad, one layer at a time, then its head.
        b.moments["frozen reference forward (before the policy's)"] = states + sum(frozen.values())
    tower = frozen_tower_bytes(shape, s)
    if tower:  # before the language model's forward: nothing is saved yet, no gradients
        b.temporaries[VISION_FORWARD] = tower
        b.moments["frozen vision tower forward (start of the forward)"] = states + tower
    generation = generation_bytes(shape, s)
    if generation:  # before the step: the previous step's gradients are freed, nothing is saved
        b.temporaries.update(generation)
        b.moments["generation (before the step)"] = states + sum(generation.values())
    b.states["gradients (at the end of backward)"] = grads
    return b
