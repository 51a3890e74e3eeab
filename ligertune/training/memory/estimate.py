"""How much GPU memory a training step needs: the arithmetic behind ``ligertune plan`` and the
``auto`` choices of ``training.activation_checkpointing`` and ``training.micro_batch_size``.

Everything here is counted from shapes, never measured: a `ModelShape` (read from the model's
config and an empty, meta-device build) and a `Setting` (batch, checkpointing, offload,
kernels, precision, strategy, world size, and what the objective adds: rows per sample, a
frozen model). The result is a `Breakdown`: named byte counts per GPU, grouped into model
states, activations, temporaries and allocator headroom, and the predicted peak.

The model of a step
-------------------
The tokens of a micro-batch are ``micro_batch_size × seq_len``, twice that for preference and
kto data: a micro-batch of B pairs is one [2B, S] batch (`ligertune.data.preference`), and the
policy's forward and backward run over all 2B rows at once, so every per-token count
(activations, the loss head, the working sets) is of 2B rows.

The peak allocated memory of a training step is the largest of three moments (four with a
frozen reference):

1. *the loss*: the end of the forward, when every saved activation is alive, plus the loss
   head's temporaries (eager: the ``[tokens × vocab]`` logits, their fp32 copy, log-softmax and
   its gradient; fused linear cross entropy: one chunk buffer and the fp32 dW accumulator);
2. *the start of backward*: every saved activation, the loss head's gradients, and the
   working set of one layer's backward (with checkpointing: that layer's recomputed
   activations too, the whole layer's or its checkpointed sub-module's; with offload: one
   layer's tensors copied back ahead of their backward);
3. *the end of backward / the optimizer step*: every gradient, the last layer's working set;
4. *the frozen reference's forward* (dpo/kto with ``objective.reference: frozen`` and no LoRA):
   the reference's log-probs are computed first, under ``no_grad``, before the policy's forward
   (`ligertune.objectives.pairs`), so none of the policy's activations are alive and the
   reference saves none of its own: its gathered weights (sharded strategies), one layer's
   forward working set and its log-prob head (fused: one chunk of `fused_linear_logprobs`;
   materialised: the logits, their fp32 copy and its log_softmax) are the temporaries.

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

Activations: what autograd saves
--------------------------------
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
- The preference objectives' fused lm_head is counted as its kernel runs it: dpo, orpo and
  simpo evaluate the loss per chunk of whole pairs (`pair_sequence_loss`: at least one pair,
  2 × seq_len rows, whatever the budget; an fp32 dW accumulator with several chunks) and keep
  dh and dW as the fused CE does; kto's two-step path (the fused CE with ``reduction="none"``,
  which computes dh and dW in the backward instead) is counted as the fused CE, the same bytes
  at slightly different moments. Their materialised paths (kernels off; our cross entropy kernel
  serves only sft's loss) keep the fp32 log-probabilities, as eager sft does.
- A layer's backward needs about the gradients of its largest activations: the MLP's gate/up
  gradients and a few hidden-sized ones (`layer_backward_bytes`). A frozen layer's no-grad
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
  trains only its adapters (frozen weights have no gradient or moments).
- FSDP2: each decoder layer is a unit; one is gathered at a time plus one prefetched, in bf16
  with ``mixed_precision``; the root (embeddings, final norm, lm_head) stays gathered from forward
  to backward; gradients are reduced in fp32 through a layer-sized buffer.
- DeepSpeed: ZeRO-1/2/3 with bf16 module weights and fp32 master weights and moments in the
  optimizer; ZeRO-3 prefetches about one layer ahead.
- The caching allocator's fragmentation is not modelled: a fixed headroom fraction of the GPU
  is kept free (`HEADROOM_FRACTION`) when deciding what fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ligertune.kernels.fused_linear_cross_entropy import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows, sweep_rows
from ligertune.kernels.fused_linear_logprobs import DISTILL_BUFFERS

GIB = 2**30
# Part of the GPU left free when deciding "fits": the caching allocator's fragmentation, the
# CUDA context and library workspaces (cuBLAS, NCCL), which are not allocated tensors.
HEADROOM_FRACTION = 0.08

CHECKPOINTING = ("none", "selective", "full")
# Objectives whose fused lm_head evaluates the loss per chunk of whole pairs and computes its
# gradient in the same pass (`ligertune.objectives.logps.pair_sequence_loss`); kto takes the
# two-step path (log-probs, then the loss), as the fused CE with ``reduction="none"``.
ONE_PASS_PAIRS = ("dpo", "orpo", "simpo")


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory, read from a (meta-device) model and its config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int  # all parameters
    layer_params: int  # one decoder layer
    embed_params: int  # the input embedding
    head_params: int  # the lm_head (0 when tied to the embedding)
    lora_params: int = 0  # trainable adapter parameters (0: full fine-tuning)

    @property
    def trainable(self) -> int:
        return self.lora_params or self.params


@dataclass(frozen=True)
class Setting:
    """One way to run the recipe: what the plan varies, and what it takes from the recipe."""

    micro_batch_size: int
    seq_len: int
    checkpointing: str = "none"  # none | selective | full
    every: int = 2  # selective: every k-th layer is checkpointed
    modules: tuple[str, ...] = ()  # selective: the sub-module recomputed in those layers (empty: all)
    offload: bool = False  # activation offload to pinned CPU memory (layers not checkpointed whole)
    kernels: frozenset[str] = frozenset()
    precision: str = "bf16"  # bf16 | bf16-mixed | fp32
    strategy: str = "none"  # none | ddp | fsdp | deepspeed
    world_size: int = 1
    zero_stage: int = 3
    fsdp_mixed_precision: bool = True
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    deepspeed_offload_optimizer: bool = False
    deepspeed_offload_params: bool = False
    gqa_native: bool = True
    # Rows of the micro-batch per sample: 2 for preference and kto data, whose micro-batch of B
    # pairs is a [2B, S] batch (`ligertune.data.preference`), 1 otherwise.
    rows_per_sample: int = 1
    objective: str = "sft"  # objective.name: decides the loss head and when a frozen model runs
    # A frozen model held for the whole run besides the policy: the dpo/kto reference (frozen,
    # without LoRA) or the distill teacher. None: no second model.
    frozen: ModelShape | None = None

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch: every row is ``seq_len`` long, and a pair is two rows."""
        return self.micro_batch_size * self.rows_per_sample * self.seq_len

    @property
    def frozen_role(self) -> str:
        """What the frozen model is: the distill ``teacher`` or the dpo/kto ``reference``."""
        return "teacher" if self.objective == "distill" else "reference"

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
    as the norms')."""

    name: str
    per_token: int
    bytes_per_element: int
    module: str | None = None

    def bytes(self, tokens: int) -> int:
        return tokens * self.per_token * self.bytes_per_element


@dataclass
class Breakdown:
    """Named byte counts per GPU and the predicted peak, with the moment it happens."""

    setting: Setting
    states: dict[str, int] = field(default_factory=dict)
    activations: dict[str, int] = field(default_factory=dict)
    temporaries: dict[str, int] = field(default_factory=dict)
    moments: dict[str, int] = field(default_factory=dict)  # the three candidate peaks

    @property
    def peak(self) -> int:
        return max(self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.get)

    def fits(self, gpu_bytes: int, headroom: float = HEADROOM_FRACTION) -> bool:
        return self.peak <= gpu_bytes * (1 - headroom)


# --------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------


def compute_bytes(s: Setting) -> int:
    """Bytes per element of matmul outputs (bf16 unless fp32)."""
    return 4 if s.precision == "fp32" else 2


def stream_bytes(s: Setting) -> int:
    """Bytes per element of the residual stream between layers."""
    if s.precision == "fp32":
        return 4
    if s.precision == "bf16-mixed":
        bf16_params = (s.strategy == "fsdp" and s.fsdp_mixed_precision) or s.strategy == "deepspeed"
        return 2 if bf16_params else 4
    return 2


def weight_bytes(s: Setting) -> int:
    """Bytes per element of the parameters as the optimizer holds them (before sharding)."""
    return 2 if s.precision == "bf16" else 4


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------


def _norm_saved(
    name: str, shape: ModelShape, s: Setting, fused: bool, output_saved: bool, consumer: str | None = None
) -> list[Saved]:
    """A norm's saved tensors; its output when `output_saved`, as saved by the linear layers of
    the `consumer` sub-module."""
    es, ea, h = stream_bytes(s), compute_bytes(s), shape.hidden
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
    kv_attn = kv if s.gqa_native else q  # repeat_kv expands k and v before sdpa
    saved = _norm_saved("input_layernorm", shape, s, "rms_norm" in k, True, "attention")
    # RoPE, eager or ours, saves only cos and sin (once per model): q·cos needs cos for q's
    # gradient, and cos needs none.
    saved += [
        Saved("attention: q", q, ea, "attention"),
        Saved("attention: k", kv_attn, ea, "attention"),
        Saved("attention: v", kv_attn, ea, "attention"),
        Saved("attention: output (o_proj's input)", q, ea, "attention"),
        Saved("attention: log-sum-exp", shape.heads, 4, "attention"),
    ]
    saved += _norm_saved("post_attention_layernorm", shape, s, "rms_norm" in k, True, "mlp")
    i = shape.intermediate
    saved += [Saved("mlp: gate", i, ea, "mlp"), Saved("mlp: up", i, ea, "mlp")]
    if not ({"swiglu", "geglu"} & k):
        saved.append(Saved("mlp: act(gate)", i, ea, "mlp"))
    saved.append(Saved("mlp: act(gate)·up (down_proj's input)", i, ea, "mlp"))
    return saved


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
    or what its checkpointed sub-modules save."""
    saved = layer_saved(shape, s)
    if not s.whole_layers:
        saved = [t for t in saved if t.module in s.modules]
    return sum(t.bytes(s.tokens) for t in saved)


def model_saved(shape: ModelShape, s: Setting) -> list[Saved]:
    """What is saved once per model, outside the decoder layers: cos/sin, the final norm and
    the loss head's per-token tensors (the fused CE's dW is per model: see `head_fixed_bytes`)."""
    ea, k = compute_bytes(s), s.kernels
    # cos/sin follow the position ids: one row per sequence position, or per token when packed
    # rows carry their own; counted per token (the larger).
    saved = [
        Saved("input ids (the embedding's backward)", 1, 8),
        Saved("rope: cos and sin (shared by the layers)", 2 * shape.head_dim, ea),
    ]
    head = loss_head(s)
    saved += _norm_saved("final norm", shape, s, "rms_norm" in k, head != "fused")
    if head == "fused":  # the gradients, computed in the forward
        saved.append(Saved("loss: fused CE dh", shape.hidden, ea))
    elif head == "ce":  # the logits' gradient, written over the logits
        saved.append(Saved("loss: logits' gradient", shape.vocab, ea))
    elif s.objective == "distill":  # `distillation_token_losses` on the whole batch's logits
        saved += [
            Saved("loss: student fp32 log-probabilities (CE)", shape.vocab, 4),
            Saved("loss: student fp32 log-probabilities at T (divergence)", shape.vocab, 4),
            Saved("loss: teacher fp32 probabilities (divergence)", shape.vocab, 4),
            Saved("loss: targets", 1, 8),
        ]
    else:  # log_softmax keeps its fp32 output, nll_loss (or the log-probs' gather) the targets
        saved += [Saved("loss: fp32 log-probabilities", shape.vocab, 4), Saved("loss: targets", 1, 8)]
    return saved


def loss_head(s: Setting) -> str:
    """How the lm_head and the loss run: ``fused`` (our fused linear CE, and for the other
    objectives its log-prob and distillation kernels: no [tokens × vocab] logits), ``ce`` (our
    cross entropy on HF's logits: only sft's loss goes through it) or ``eager`` (the logits,
    then torch's log_softmax: sft without kernels, and the objectives' materialised paths)."""
    if "fused_linear_cross_entropy" in s.kernels:
        return "fused"
    return "ce" if "cross_entropy" in s.kernels and s.objective == "sft" else "eager"


def head_fixed_bytes(shape: ModelShape, s: Setting) -> int:
    """The fused CE's lm_head gradient [vocab × hidden], held from the forward to the backward
    (the fused log-prob and distillation kernels hold theirs the same way)."""
    if loss_head(s) != "fused":
        return 0
    return shape.vocab * shape.hidden * compute_bytes(s)


def loss_temporary_bytes(shape: ModelShape, s: Setting) -> int:
    """What the loss head allocates on top of what it saves, at its peak."""
    n, v, ea = s.tokens, shape.vocab, compute_bytes(s)
    head = loss_head(s)
    wide = 4 if ea != 4 else 0  # an fp32 dW accumulator over chunks (none for fp32 weights)
    if head == "fused" and s.objective == "distill" and s.frozen is not None:
        # `fused_linear_distillation`, inside the teacher's lm_head call: per chunk both models'
        # logits and its fp32 buffers (the kernel's own count), the fp32 dW accumulator it always
        # allocates, and the teacher's final hidden states (its lm_head's input).
        rows = chunk_rows(n, v, 4 * DISTILL_BUFFERS, DEFAULT_MEMORY_BUDGET_BYTES)
        return (
            rows * v * (4 * DISTILL_BUFFERS + 2 * ea)
            + v * shape.hidden * wide
            + (n * s.frozen.hidden * stream_bytes(s))
        )
    if head == "fused" and s.objective in ONE_PASS_PAIRS:
        # `pair_sequence_loss`: chunks of whole pairs (at least one, 2 × seq_len rows, whatever
        # the budget), and the fp32 dW accumulator when there are several chunks.
        pair_rows = s.rows_per_sample * s.seq_len
        pairs = chunk_rows(s.micro_batch_size, pair_rows * v, ea, DEFAULT_MEMORY_BUDGET_BYTES)
        accumulator = v * shape.hidden * wide if pairs < s.micro_batch_size else 0
        return pairs * pair_rows * v * ea + accumulator
    if head == "fused":
        rows = sweep_rows(
            n, v, shape.hidden, ea, DEFAULT_MEMORY_BUDGET_BYTES, accumulator_bytes=wide, weight_bytes=ea
        )
        accumulator = shape.vocab * shape.hidden * wide if rows < n else 0
        return rows * v * ea + accumulator
    if head == "ce":  # the logits (then their gradient in place) and the fp32 row stats
        return n * 8
    if s.objective == "distill":
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
    """Working set of one decoder layer's backward: gradients of its largest activations."""
    ea = compute_bytes(s)
    gated = 1 if {"swiglu", "geglu"} & s.kernels else 2  # the fused kernel overwrites gate/up
    return s.tokens * (gated * shape.intermediate + 4 * shape.hidden) * ea


def activation_bytes(shape: ModelShape, s: Setting) -> dict[str, int]:
    """Saved activations on the GPU at the end of the forward, by part. Offloaded layers count
    as two of the largest one: when the loss is computed the last layer's tensors are still
    referenced, and the layer before it is held until its device→host copy is done
    (`ligertune.training.memory.offload`). The copies run at PCIe speed, slower than a layer's
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
        each = sum(t.bytes(n) for t in checkpointed_layer_saved(shape, s))
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
    parts["outside the layers (cos/sin, final norm, loss)"] = sum(t.bytes(n) for t in model_saved(shape, s))
    fixed = head_fixed_bytes(shape, s)
    if fixed:
        parts["fused CE: lm_head gradient"] = fixed
    return parts


def layer_activation_bytes(shape: ModelShape, s: Setting) -> int:
    """What one decoder layer not checkpointed saves."""
    return sum(t.bytes(s.tokens) for t in layer_saved(shape, s))


# --------------------------------------------------------------------------------------------
# Model states and the strategies
# --------------------------------------------------------------------------------------------


def state_bytes(shape: ModelShape, s: Setting) -> tuple[dict[str, int], int]:
    """Persistent model states per GPU, and the gradients' bytes (counted where they exist)."""
    w, p, t = s.world_size, shape.params, shape.trainable
    ew = weight_bytes(s)
    lora = shape.lora_params > 0
    states: dict[str, int] = {}
    if s.strategy == "fsdp":
        on_gpu = 0 if s.fsdp_cpu_offload else 1
        states["weights (sharded)"] = on_gpu * p * ew // w
        states["AdamW moments (sharded)"] = on_gpu * 2 * t * ew // w
        grads = on_gpu * t * ew // w
        gathered = fsdp_gathered_bytes(s)
        # One layer gathered, one prefetched; the root's parameters gathered forward to backward.
        states["FSDP2 gathered layers (current + prefetch)"] = 2 * shape.layer_params * gathered
        states["FSDP2 gathered root (embeddings, lm_head, norm)"] = (
            shape.embed_params + shape.head_params
        ) * gathered
    elif s.strategy == "deepspeed":
        stage = s.zero_stage
        module = 2 if s.precision != "fp32" else 4  # DeepSpeed's bf16 mode: bf16 module weights
        states["weights" + (" (sharded)" if stage == 3 else "")] = (
            0 if s.deepspeed_offload_params else p * module // (w if stage == 3 else 1)
        )
        master = 4 * t if s.precision != "fp32" else 0
        optimizer = 0 if s.deepspeed_offload_optimizer else (master + 8 * t) // w
        states["fp32 master weights + AdamW moments (sharded)"] = optimizer
        grads = t * module // (1 if stage == 1 else w) + (t * 4 // w if s.precision != "fp32" else 0)
        if stage == 3:
            states["ZeRO-3 gathered layers (current + prefetch)"] = 2 * shape.layer_params * module
            states["ZeRO-3 gathered embeddings and lm_head"] = (
                shape.embed_params + shape.head_params
            ) * module
    else:
        states["weights"] = p * ew
        states["AdamW moments"] = 2 * t * ew
        if s.precision == "bf16-mixed":
            # autocast's bf16 copies of the weights, kept by the graph until backward frees them
            states["autocast bf16 weight copies"] = (t if not lora else p) * 2
        grads = t * ew
    if s.frozen is not None:
        states[frozen_label(s)] = frozen_weight_bytes(s.frozen, s)
    return states, grads


def fsdp_gathered_bytes(s: Setting) -> int:
    """Bytes per element of a layer FSDP2 gathers: bf16 with ``mixed_precision`` (unless fp32)."""
    return 2 if s.fsdp_mixed_precision and s.precision != "fp32" else weight_bytes(s)


# --------------------------------------------------------------------------------------------
# A frozen reference or teacher
# --------------------------------------------------------------------------------------------


def frozen_element_bytes(s: Setting) -> int:
    """Bytes per element of a frozen model's weights as stored: `build_model`'s parameter dtype
    (bf16 for bf16; fp32 for bf16-mixed and fp32, autocast casting per matmul), except under
    ZeRO-3, whose inference engine holds bf16 module weights as the policy's does."""
    if s.strategy == "deepspeed" and s.zero_stage == 3:
        return 2 if s.precision != "fp32" else 4
    return weight_bytes(s)


def frozen_sharded(s: Setting) -> bool:
    """Whether the strategy shards the frozen model (`wrap_frozen`): FSDP2 and ZeRO-3 do;
    none, DDP and ZeRO-1/2 (which shard only optimizer state and gradients) keep a replica."""
    return s.strategy == "fsdp" or (s.strategy == "deepspeed" and s.zero_stage == 3)


def frozen_offloaded(s: Setting) -> bool:
    """Whether the strategy keeps the frozen model's shards on the CPU, as it does the policy's."""
    return (s.strategy == "fsdp" and s.fsdp_cpu_offload) or (
        s.strategy == "deepspeed" and s.zero_stage == 3 and s.deepspeed_offload_params
    )


def frozen_label(s: Setting) -> str:
    """The frozen model's state line, e.g. ``frozen reference (bf16, replica)``."""
    dtype = "bf16" if frozen_element_bytes(s) == 2 else "fp32"
    where = ("sharded" + (", on the CPU" if frozen_offloaded(s) else "")) if frozen_sharded(s) else "replica"
    return f"frozen {s.frozen_role} ({dtype}, {where})"


def frozen_weight_bytes(frozen: ModelShape, s: Setting) -> int:
    """The frozen model's weights on each GPU for the whole run (no gradients, no optimizer
    state): a whole replica, or 1/world of them where the strategy shards it (none on the GPU
    when it offloads the shards to the CPU, as it does the policy's)."""
    if frozen_offloaded(s):
        return 0
    total = frozen.params * frozen_element_bytes(s)
    return total // s.world_size if frozen_sharded(s) else total


def frozen_gathered_bytes(frozen: ModelShape, s: Setting) -> int:
    """What a sharded frozen model gathers while its forward runs: one decoder layer and the
    next (the prefetch), and its root (embeddings, lm_head: FSDP2 gathers the root for the whole
    forward and, as it is told to reshard after forward, frees it at the end; ZeRO-3 as for the
    policy). Nothing for a replica."""
    if not frozen_sharded(s):
        return 0
    each = fsdp_gathered_bytes(s) if s.strategy == "fsdp" else frozen_element_bytes(s)
    return (2 * frozen.layer_params + frozen.embed_params + frozen.head_params) * each


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
    if loss_head(s) == "fused":
        return hidden + chunk_rows(n, v, ea, DEFAULT_MEMORY_BUDGET_BYTES) * v * ea
    return hidden + n * v * (ea + 4 + (4 if ea != 4 else 0))


# --------------------------------------------------------------------------------------------
# The breakdown
# --------------------------------------------------------------------------------------------


def estimate(shape: ModelShape, s: Setting) -> Breakdown:
    """The per-GPU memory of one training step in setting `s` (see the module docstring)."""
    b = Breakdown(s)
    b.states, grads = state_bytes(shape, s)
    b.activations = activation_bytes(shape, s)
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
    if s.strategy == "fsdp":
        b.temporaries["FSDP2 reduce-scatter of one layer's gradients (fp32)"] = shape.layer_params * 4
    frozen = frozen_temporaries(s)
    b.temporaries.update(frozen)
    states = sum(b.states.values())
    saved = sum(b.activations.values())
    head_grad = shape.head_params * weight_bytes(s) // (s.world_size if s.strategy == "fsdp" else 1)
    backward = b.temporaries["one layer's backward"] + recompute
    loss = b.temporaries["loss head at its peak"]
    if s.frozen is not None and s.frozen_role == "teacher":
        # The teacher's forward runs inside the student's loss (its lm_head call, or right after
        # its forward on the materialised path): every saved activation is alive, the teacher's
        # gathered weights too, and its layers' working set comes before the loss head's peak.
        loss = frozen_gathered_bytes(s.frozen, s) + max(loss, frozen[TEACHER_LAYER])
    b.moments = {
        "loss (end of forward)": states + saved + loss,
        "start of backward": states + saved + head_grad + backward,
        "end of backward": states
        + grads
        + backward
        + b.temporaries.get("FSDP2 reduce-scatter of one layer's gradients (fp32)", 0),
    }
    if s.frozen is not None and s.frozen_role == "reference":
        # Before the policy's forward (its activations not yet alive), no gradients (as at the
        # loss): the reference's log-probs under no_grad, one layer at a time, then its head.
        b.moments["frozen reference forward (before the policy's)"] = states + sum(frozen.values())
    b.states["gradients (at the end of backward)"] = grads
    return b


TEACHER_LAYER = "frozen teacher: one layer's forward (no grad)"


def frozen_temporaries(s: Setting) -> dict[str, int]:
    """What the frozen model's forward holds while it runs, by part (its weights are a state)."""
    if s.frozen is None:
        return {}
    f, parts = s.frozen, {}
    gathered = frozen_gathered_bytes(f, s)
    if gathered:
        strategy = "FSDP2" if s.strategy == "fsdp" else "ZeRO-3"
        parts[f"frozen {s.frozen_role}: {strategy} gathered layers (current + prefetch) and root"] = gathered
    if s.frozen_role == "teacher":
        parts[TEACHER_LAYER] = frozen_layer_forward_bytes(f, s)
    else:
        parts["frozen reference: one layer's forward (no grad)"] = frozen_layer_forward_bytes(f, s)
        parts["frozen reference: log-probs head (no grad)"] = frozen_head_bytes(f, s)
    return parts
