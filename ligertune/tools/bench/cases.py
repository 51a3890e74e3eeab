"""What `ligertune bench` measures: one `KernelSpec` per kernel.

A spec says how to build the inputs for a shape, how each provider computes the op, and the
*minimal bytes* (and, for the fused linear cross entropy, FLOPs) of each pass, from which the
speed of light follows. How things are measured lives in `ligertune.tools.bench.run`.

Providers, all called with the same positional tensors (``Inputs.tensors``, in order):

* ``eager``: what a Hugging Face model runs without our kernels: ``LlamaRMSNorm``,
  ``nn.LayerNorm``, HF ``apply_rotary_pos_emb``, ``ACT2FN[...](gate) * up``, ``Qwen3MoeExperts``
  with ``experts_implementation="eager"`` (its per-expert loop), the Qwen-VL vision attention's
  one SDPA call per window or image (split at ``cu_seqlens``), and for the losses
  HF's recipe, logits upcast to fp32 then ``F.cross_entropy`` (so "eager" for the losses is the
  fp32-upcast loss that ``ForCausalLMLoss`` computes);
* ``compile``: ``torch.compile`` of that same eager function (default mode, static shapes);
* ``liger``: Liger-Kernel's functional API (``liger_kernel.transformers.functional``), when it is
  importable on a CUDA device; for the MoE experts its ``LigerFusedMoEFunction``
  (``liger_kernel.ops.fused_moe``, recent releases), which takes the same gate/up-halves layout;
* ``ligertune``: ours, ``ligertune.kernels`` (for ``vision_attention``: one FlexAttention call
  under the segments' block mask, `ligertune.models.attention.segment_attention`; Liger has none).

RMSNorm variants run with ``in_place=False`` for both liger and ligertune (liger's default is
in place), so the two are compared on the same contract: dy is left intact.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PASSES = ("fwd", "bwd", "full")
PROVIDERS = ("eager", "compile", "liger", "ligertune")

RMS_EPS = 1e-6  # LlamaRMSNorm's default
LN_EPS = 1e-5  # nn.LayerNorm's default
IGNORE_INDEX = -100
IGNORED_FRACTION = 0.1  # share of targets set to ignore_index, as padding/prompt tokens are
ROPE_THETA = 500000.0  # Llama 3


class ProviderUnavailable(Exception):
    """The provider cannot run here (library missing, no CUDA); reported, never fatal."""


@dataclass
class Inputs:
    """The positional arguments every provider takes, and the upstream gradients of its outputs.

    ``grad_outputs`` is None for losses: their upstream gradient is the implicit 1.
    """

    tensors: dict[str, torch.Tensor]
    grad_outputs: tuple[torch.Tensor, ...] | None = None

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors.values())

    @property
    def differentiable(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in self.tensors.values() if t.requires_grad)

    def clone(self) -> Inputs:
        """Same values, fresh leaves: one provider's in-place writes or autograd state never
        reach another's inputs."""

        def fresh(t: torch.Tensor) -> torch.Tensor:
            c = t.detach().clone()
            if isinstance(t, nn.Parameter):
                return nn.Parameter(c)
            return c.requires_grad_(t.requires_grad)

        return Inputs({k: fresh(t) for k, t in self.tensors.items()}, self.grad_outputs)


Shape = tuple[int, ...]
Builder = Callable[[Inputs], Callable[..., object]]


@dataclass(frozen=True)
class KernelSpec:
    name: str
    dims: tuple[str, ...]  # names of the shape's integers, e.g. ("rows", "hidden")
    shapes: tuple[Shape, ...]  # the full GPU benchmark (docs/benchmarks.md lists them)
    quick_shapes: tuple[Shape, ...]  # --quick on a GPU: one representative size
    cpu_shapes: tuple[Shape, ...]  # CPU (interpreter): tiny, to exercise the code path only
    make_inputs: Callable[[Shape, torch.dtype, torch.device], Inputs]
    eager: Builder
    liger: Builder
    ligertune: Builder
    loss: bool = False  # a scalar loss: fwd+bwd can fuse into one pass (see MINIMAL_BYTES)

    def build(self, provider: str, inputs: Inputs) -> Callable[..., object]:
        """The callable `provider` runs on ``inputs.args``; raises ProviderUnavailable."""
        if provider == "compile":
            # A fresh dynamo state per case: each case compiles once for its own static shape
            # and never runs into the recompile limit left by earlier cases.
            torch._dynamo.reset()
            return torch.compile(self.eager(inputs), dynamic=False)
        return getattr(self, provider)(inputs)

    def shape_str(self, shape: Shape) -> str:
        return "x".join(map(str, shape))


# ---------------------------------------------------------------------------------------------
# Minimal bytes and FLOPs
# ---------------------------------------------------------------------------------------------
# Each entry gives (fwd, bwd, full) bytes for one call: every input read once, every output
# written once, nothing else (saved statistics such as rstd are a few bytes per row and can be
# recomputed, so they are not counted). e = bytes per element of the benchmark dtype; targets
# are int64 (8 bytes); a loss is one fp32 scalar (4 bytes).
#
# For layers (not losses) dy only exists once the next layer has run its backward, so nothing
# can fuse across the two passes: full = fwd + bwd. A loss's upstream gradient is the constant 1,
# so a fused implementation computes the loss and its gradient in one sweep: full = read the
# inputs once, write the loss and the gradients once.
MINIMAL_BYTES: dict[str, Callable[..., tuple[int, int, int]]] = {
    # y = w·x/rms(x).  fwd: read x, w; write y.  bwd: read x, w, dy; write dx, dw.
    "rms_norm": lambda e, n, h: (e * (2 * n * h + h), e * (3 * n * h + 2 * h), e * (5 * n * h + 3 * h)),
    # s = x + r, y = rms_norm(s).  fwd: read x, r, w; write y, s.  bwd: read dy, ds, s, w; write
    # dx and dw (dr equals dx, so one write serves both).
    "add_rms_norm": lambda e, n, h: (e * (4 * n * h + h), e * (4 * n * h + 2 * h), e * (8 * n * h + 3 * h)),
    # fwd: read x, w, b; write y.  bwd: read x, w, dy; write dx, dw, db.
    "layer_norm": lambda e, n, h: (e * (2 * n * h + 2 * h), e * (3 * n * h + 3 * h), e * (5 * n * h + 5 * h)),
    # q [B,S,Hq,D], k [B,S,Hkv,D], cos and sin [B,S,D] (materialised per batch, as HF's rotary
    # embedding returns them).  fwd: read q, k, cos, sin; write q', k'.  bwd: read dq', dk', cos,
    # sin; write dq, dk (rotation by -θ: q and k are not needed).
    "rope": lambda e, b, s, hq, hkv, d: (
        e * (2 * b * s * d * (hq + hkv) + 2 * b * s * d),
        e * (2 * b * s * d * (hq + hkv) + 2 * b * s * d),
        e * (4 * b * s * d * (hq + hkv) + 4 * b * s * d),
    ),
    # o = act(g)·u.  fwd: read g, u; write o.  bwd: read g, u, do; write dg, du.
    "swiglu": lambda e, n, i: (3 * e * n * i, 5 * e * n * i, 8 * e * n * i),
    "geglu": lambda e, n, i: (3 * e * n * i, 5 * e * n * i, 8 * e * n * i),
    # fwd: read logits, targets; write the loss.  bwd: read logits, targets, dloss; write
    # dlogits.  full (fused): read logits, targets; write loss, dlogits.
    "cross_entropy": lambda e, n, v: (
        e * n * v + 8 * n + 4,
        2 * e * n * v + 8 * n + 4,
        2 * e * n * v + 8 * n + 4,
    ),
    # hidden [N,H], weight [V,H]; the logits are never stored.  fwd: read hidden, weight,
    # targets; write loss.  bwd: read hidden, weight, targets, dloss; write dhidden, dweight.
    # full (fused): read hidden, weight, targets; write loss, dhidden, dweight.
    "fused_linear_cross_entropy": lambda e, n, h, v: (
        e * (n * h + v * h) + 8 * n + 4,
        2 * e * (n * h + v * h) + 8 * n + 4,
        2 * e * (n * h + v * h) + 8 * n + 4,
    ),
    # MoE experts, gate/up halves: hidden [T,H], top_k_index [T,k] int64, top_k_weights [T,k],
    # gate_up_proj [E,2I,H], down_proj [E,H,I] (3·E·H·I weights).  fwd: read them all; write
    # out [T,H].  bwd: read dout and the inputs again (what an implementation saves instead is
    # its choice); write d hidden, d weights, d gate_up_proj, d down_proj.
    # Vision attention, q/k/v/out [H, L, D] with L = images·patches, in segments of ``window``
    # patches (each image's last one shorter when window does not divide patches), cu_seqlens
    # int32.  fwd: read q, k, v, cu_seqlens; write out.  bwd: read dout, q, k, v, out,
    # cu_seqlens (a flash-style backward needs out, or its row sums with dout); write dq, dk, dv.
    "vision_attention": lambda e, n_img, p, w, h, d: (
        4 * e * h * n_img * p * d + 4 * (n_img * -(-p // w) + 1),
        8 * e * h * n_img * p * d + 4 * (n_img * -(-p // w) + 1),
        12 * e * h * n_img * p * d + 8 * (n_img * -(-p // w) + 1),
    ),
    "moe_experts": lambda e, t, h, n_exp, k, i: (
        e * (2 * t * h + t * k + 3 * n_exp * h * i) + 8 * t * k,
        e * (3 * t * h + 2 * t * k + 6 * n_exp * h * i) + 8 * t * k,
        e * (5 * t * h + 3 * t * k + 9 * n_exp * h * i) + 16 * t * k,
    ),
}

# FLOPs that bound a pass from the compute side; only the fused linear cross entropy and the MoE
# experts have any that matter (the others do a few FLOPs per byte, far below the H200's ridge point of ~180 FLOP/byte).
# logits = hidden·Wᵀ is 2·N·H·V; the backward needs dhidden = dlogits·W and dW = dlogitsᵀ·hidden,
# 2·N·H·V each. An implementation that keeps no logits recomputes them, but that is its
# choice, not a minimum: fwd 2NHV, bwd 4NHV, full 6NHV.
#
# MoE experts: each of the T·k routed rows goes through gate/up (2·H·2I) and down (2·I·H), 6·T·k·H·I
# forward; the backward has an input and a weight gradient for each, twice that.
#
# Vision attention: QKᵀ and PV within each segment, 4·H·D·Σ len² forward; the backward has four
# such products (dV, dP, dQ, dK), twice that (a flash-style backward also recomputes QKᵀ: its
# choice, not a minimum).
MINIMAL_FLOPS: dict[str, Callable[..., tuple[int, int, int]]] = {
    "vision_attention": lambda n_img, p, w, h, d: tuple(
        c * h * d * n_img * ((p // w) * w * w + (p % w) ** 2) for c in (4, 8, 12)
    ),
    "fused_linear_cross_entropy": lambda n, h, v: (2 * n * h * v, 4 * n * h * v, 6 * n * h * v),
    "moe_experts": lambda t, h, n_exp, k, i: (6 * t * k * h * i, 12 * t * k * h * i, 18 * t * k * h * i),
}


def minimal_bytes(kernel: str, shape: Shape, dtype: torch.dtype) -> dict[str, int]:
    e = torch.empty((), dtype=dtype).element_size()
    return dict(zip(PASSES, MINIMAL_BYTES[kernel](e, *shape), strict=True))


def minimal_flops(kernel: str, shape: Shape) -> dict[str, int]:
    if kernel not in MINIMAL_FLOPS:
        return dict.fromkeys(PASSES, 0)
    return dict(zip(PASSES, MINIMAL_FLOPS[kernel](*shape), strict=True))


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _randn(*shape, dtype, device, scale=1.0, requires_grad=True) -> torch.Tensor:
    t = (torch.randn(*shape, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def _weight(h: int, dtype, device, mean: float = 1.0) -> nn.Parameter:
    return nn.Parameter(mean + 0.1 * torch.randn(h, device=device).to(dtype))


def _targets(n: int, v: int, device) -> torch.Tensor:
    t = torch.randint(0, v, (n,), device=device)
    ignored = torch.rand(n, device=device) < IGNORED_FRACTION
    ignored[0] = False  # never an all-ignored batch (the mean would be 0/0)
    return t.masked_fill(ignored, IGNORE_INDEX)


def _rows_inputs(shape, dtype, device) -> Inputs:
    n, h = shape
    return Inputs(
        {"x": _randn(n, h, dtype=dtype, device=device), "weight": _weight(h, dtype, device)},
        (_randn(n, h, dtype=dtype, device=device, requires_grad=False),),
    )


def _add_rows_inputs(shape, dtype, device) -> Inputs:
    n, h = shape
    x, r = (_randn(n, h, dtype=dtype, device=device) for _ in range(2))
    grads = tuple(_randn(n, h, dtype=dtype, device=device, requires_grad=False) for _ in range(2))
    return Inputs({"x": x, "residual": r, "weight": _weight(h, dtype, device)}, grads)


def _layer_norm_inputs(shape, dtype, device) -> Inputs:
    n, h = shape
    return Inputs(
        {
            "x": _randn(n, h, dtype=dtype, device=device),
            "weight": _weight(h, dtype, device),
            "bias": _weight(h, dtype, device, mean=0.0),
        },
        (_randn(n, h, dtype=dtype, device=device, requires_grad=False),),
    )


def _rope_inputs(shape, dtype, device) -> Inputs:
    b, s, hq, hkv, d = shape
    # HF's rotary embedding: angle(p, i) = p·θ^(-2i/D) for i < D/2, repeated for the second half.
    inv_freq = ROPE_THETA ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), dim=-1).expand(b, s, d)
    # q and k are stored [B, S, H, D] as the projections produce them; providers see the
    # [B, H, S, D] transposed views a model passes (see _heads_first).
    return Inputs(
        {
            "q": _randn(b, s, hq, d, dtype=dtype, device=device),
            "k": _randn(b, s, hkv, d, dtype=dtype, device=device),
            "cos": emb.cos().to(dtype).contiguous(),
            "sin": emb.sin().to(dtype).contiguous(),
        },
        (
            _randn(b, hq, s, d, dtype=dtype, device=device, requires_grad=False),
            _randn(b, hkv, s, d, dtype=dtype, device=device, requires_grad=False),
        ),
    )


def _gated_inputs(shape, dtype, device) -> Inputs:
    n, i = shape
    return Inputs(
        {"gate": _randn(n, i, dtype=dtype, device=device), "up": _randn(n, i, dtype=dtype, device=device)},
        (_randn(n, i, dtype=dtype, device=device, requires_grad=False),),
    )


def _ce_inputs(shape, dtype, device) -> Inputs:
    n, v = shape
    return Inputs({"logits": _randn(n, v, dtype=dtype, device=device), "target": _targets(n, v, device)})


def _flce_inputs(shape, dtype, device) -> Inputs:
    n, h, v = shape
    # weight ~ N(0, 1/H) keeps the logits ~ N(0, 1), as in a trained model's head.
    weight = nn.Parameter((torch.randn(v, h, device=device) * h**-0.5).to(dtype))
    return Inputs(
        {
            "hidden": _randn(n, h, dtype=dtype, device=device),
            "weight": weight,
            "target": _targets(n, v, device),
        }
    )


def _moe_inputs(shape, dtype, device) -> Inputs:
    t, h, n_exp, k, i = shape
    # A uniform random top-k routing (the GEMMs' group sizes are what the routing changes),
    # softmax weights over the k, expert weights ~ N(0, 1/fan-in) as initialised.
    top, index = torch.randn(t, n_exp, device=device).topk(k, dim=-1)
    return Inputs(
        {
            "hidden": _randn(t, h, dtype=dtype, device=device),
            "top_k_index": index,
            "top_k_weights": top.softmax(-1).to(dtype).requires_grad_(),
            "gate_up_proj": nn.Parameter((torch.randn(n_exp, 2 * i, h, device=device) * h**-0.5).to(dtype)),
            "down_proj": nn.Parameter((torch.randn(n_exp, h, i, device=device) * i**-0.5).to(dtype)),
        },
        (_randn(t, h, dtype=dtype, device=device, requires_grad=False),),
    )


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------


def _vision_attention_inputs(shape, dtype, device) -> Inputs:
    n_img, p, w, h, d = shape
    segments = [min(w, p - start) for _ in range(n_img) for start in range(0, p, w)]
    cu = torch.tensor([0, *segments], device=device).cumsum(0).to(torch.int32)
    qkv = {name: _randn(h, n_img * p, d, dtype=dtype, device=device) for name in ("q", "k", "v")}
    return Inputs(
        {**qkv, "cu_seqlens": cu}, (_randn(h, n_img * p, d, dtype=dtype, device=device, requires_grad=False),)
    )


def _eager_vision_attention(inp: Inputs):
    """HF's Qwen-VL vision attention under SDPA: split at cu_seqlens (a host sync), one call each."""

    def attend(q, k, v, cu):
        lengths = (cu[1:] - cu[:-1]).tolist()
        parts = zip(*(t.split(lengths, dim=1) for t in (q, k, v)), strict=True)
        return torch.cat([F.scaled_dot_product_attention(*part) for part in parts], dim=1)

    return attend


def _ours_vision_attention(inp: Inputs):
    """One call under the segments' mask, built outside the timed call: the patched tower builds
    it once per forward for all its layers."""
    from ligertune.models.attention import segment_attention, segment_mask

    q, cu = inp.tensors["q"], inp.tensors["cu_seqlens"]
    mask = segment_mask(cu, q.shape[1])
    scale = q.shape[-1] ** -0.5
    return lambda q, k, v, cu: segment_attention(q, k, v, mask, scale, training=True)


def _liger_vision_attention(inp: Inputs):
    raise ProviderUnavailable("liger-kernel has no vision attention")


def _liger(name: str) -> Callable:
    """A function from Liger-Kernel's functional API, or ProviderUnavailable saying why not."""
    if not torch.cuda.is_available():
        raise ProviderUnavailable("liger-kernel needs a CUDA device")
    try:
        module = importlib.import_module("liger_kernel.transformers.functional")
    except ImportError as e:
        raise ProviderUnavailable(f"liger-kernel not importable ({e})") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ProviderUnavailable(f"this liger-kernel has no functional.{name}")
    return fn


def _ours(module: str, name: str) -> Callable:
    try:
        return getattr(importlib.import_module(f"ligertune.kernels.{module}"), name)
    except (ImportError, AttributeError) as e:
        raise ProviderUnavailable(f"ligertune.kernels.{module}.{name} not importable ({e})") from None


def _hf_rms_norm(weight: nn.Parameter) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = LlamaRMSNorm(weight.shape[0], eps=RMS_EPS)
    m.weight = weight  # the benchmark's own parameter, so gradients land on Inputs.tensors
    return m


def _eager_rms_norm(inp: Inputs):
    m = _hf_rms_norm(inp.tensors["weight"])
    return lambda x, w: m(x)


def _eager_add_rms_norm(inp: Inputs):
    m = _hf_rms_norm(inp.tensors["weight"])

    def fn(x, r, w):
        s = r + x  # the decoder layer's `hidden_states = residual + hidden_states`
        return m(s), s

    return fn


def _eager_layer_norm(inp: Inputs):
    w = inp.tensors["weight"]
    m = nn.LayerNorm(w.shape[0], eps=LN_EPS, device=w.device, dtype=w.dtype)
    m.weight, m.bias = w, inp.tensors["bias"]
    return lambda x, w, b: m(x)


def _heads_first(rope: Callable) -> Callable:
    """Call a q/k rotation the way attention does: on [B, H, S, D] views of [B, S, H, D] storage."""
    return lambda q, k, cos, sin: rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _eager_rope(inp: Inputs):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return _heads_first(apply_rotary_pos_emb)


def _eager_gated(activation: str) -> Builder:
    def build(inp: Inputs):
        from transformers.activations import ACT2FN

        act = ACT2FN[activation]
        return lambda g, u: act(g) * u

    return build


def _eager_ce(inp: Inputs):
    return lambda logits, target: F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX)


def _eager_flce(inp: Inputs):
    return lambda h, w, target: F.cross_entropy(F.linear(h, w).float(), target, ignore_index=IGNORE_INDEX)


def _eager_moe(inp: Inputs):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    n_exp, two_i, h = inp.tensors["gate_up_proj"].shape
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=n_exp)
    config._experts_implementation = "eager"
    with torch.device("meta"):  # its own weights are replaced by the benchmark's parameters
        m = Qwen3MoeExperts(config)
    m.gate_up_proj, m.down_proj = inp.tensors["gate_up_proj"], inp.tensors["down_proj"]
    return lambda x, index, weights, w1, w2: m(x, index, weights)


def _liger_moe(inp: Inputs):
    if not torch.cuda.is_available():
        raise ProviderUnavailable("liger-kernel needs a CUDA device")
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as e:
        raise ProviderUnavailable(f"this liger-kernel has no fused MoE op ({e})") from None
    # int32 indices, as its own tests pass them; the cast is outside the timed call.
    index = inp.tensors["top_k_index"].to(torch.int32)
    return lambda x, _, weights, w1, w2: LigerFusedMoEFunction.apply(x, w1, w2, index, weights)


def _liger_rms_norm(inp: Inputs):
    fn = _liger("liger_rms_norm")
    return lambda x, w: fn(x, w, RMS_EPS, 0.0, "llama", False)


def _liger_add_rms_norm(inp: Inputs):
    fn = _liger("liger_fused_add_rms_norm")
    return lambda x, r, w: fn(x, r, w, RMS_EPS, 0.0, "llama", False)


def _liger_layer_norm(inp: Inputs):
    fn = _liger("liger_layer_norm")
    return lambda x, w, b: fn(x, w, b, LN_EPS)


def _same_args(get: Callable[[], Callable]) -> Builder:
    """A builder for a provider whose function takes exactly Inputs.args."""
    return lambda inp: get()


def _ours_rms_norm(inp: Inputs):
    fn = _ours("rms_norm", "rms_norm")
    return lambda x, w: fn(x, w, eps=RMS_EPS)


def _ours_add_rms_norm(inp: Inputs):
    fn = _ours("rms_norm", "add_rms_norm")
    return lambda x, r, w: fn(x, r, w, eps=RMS_EPS)


def _ours_layer_norm(inp: Inputs):
    fn = _ours("layer_norm", "layer_norm")
    return lambda x, w, b: fn(x, w, b, eps=LN_EPS)


_ROWS = ("rows", "hidden")
_NORM_SHAPES = ((16384, 2048), (16384, 4096), (16384, 8192))

SPECS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec(
            "rms_norm", _ROWS, _NORM_SHAPES, ((16384, 4096),), ((16, 96),),
            _rows_inputs, _eager_rms_norm, _liger_rms_norm, _ours_rms_norm,
        ),
        KernelSpec(
            "add_rms_norm", _ROWS, _NORM_SHAPES, ((16384, 4096),), ((16, 96),),
            _add_rows_inputs, _eager_add_rms_norm, _liger_add_rms_norm, _ours_add_rms_norm,
        ),
        KernelSpec(
            "layer_norm", _ROWS, _NORM_SHAPES, ((16384, 4096),), ((16, 96),),
            _layer_norm_inputs, _eager_layer_norm, _liger_layer_norm, _ours_layer_norm,
        ),
        KernelSpec(
            "rope", ("batch", "seq", "q_heads", "kv_heads", "head_dim"),
            ((8, 2048, 32, 8, 128),), ((8, 2048, 32, 8, 128),), ((1, 6, 4, 2, 16),),
            _rope_inputs, _eager_rope,
            _same_args(lambda: _heads_first(_liger("liger_rope"))),
            _same_args(lambda: _heads_first(_ours("rope", "apply_rotary_pos_emb"))),
        ),
        KernelSpec(
            "swiglu", ("rows", "intermediate"), ((8192, 14336),), ((8192, 14336),), ((16, 160),),
            _gated_inputs, _eager_gated("silu"),
            _same_args(lambda: _liger("liger_swiglu")), _same_args(lambda: _ours("swiglu", "swiglu")),
        ),
        KernelSpec(
            "geglu", ("rows", "intermediate"), ((8192, 14336),), ((8192, 14336),), ((16, 160),),
            _gated_inputs, _eager_gated("gelu_pytorch_tanh"),
            _same_args(lambda: _liger("liger_geglu")), _same_args(lambda: _ours("swiglu", "geglu")),
        ),
        KernelSpec(
            "cross_entropy", ("rows", "vocab"), ((8192, 32000), (8192, 128256), (8192, 256000)),
            ((8192, 128256),), ((16, 512), (16, 1024)),
            _ce_inputs, _eager_ce,
            _same_args(lambda: _liger("liger_cross_entropy")),
            _same_args(lambda: _ours("cross_entropy", "cross_entropy")),
            loss=True,
        ),
        KernelSpec(
            "fused_linear_cross_entropy", ("rows", "hidden", "vocab"),
            ((8192, 4096, 32000), (8192, 4096, 128256), (8192, 4096, 256000), (32768, 4096, 128256)),
            ((8192, 4096, 128256),), ((16, 32, 512), (16, 32, 1024)),
            _flce_inputs, _eager_flce,
            _same_args(lambda: _liger("liger_fused_linear_cross_entropy")),
            _same_args(lambda: _ours("fused_linear_cross_entropy", "fused_linear_cross_entropy")),
            loss=True,
        ),
        KernelSpec(
            "moe_experts", ("tokens", "hidden", "experts", "top_k", "intermediate"),
            ((8192, 2048, 128, 8, 768), (8192, 4096, 8, 2, 14336)),  # Qwen3-30B-A3B, Mixtral-8x7B
            ((8192, 2048, 128, 8, 768),), ((8, 32, 3, 2, 16),),
            _moe_inputs, _eager_moe, _liger_moe, _same_args(lambda: _ours("moe", "moe_experts")),
        ),
        KernelSpec(
            "vision_attention", ("images", "patches", "window", "heads", "head_dim"),
            # Qwen2.5-VL-7B, eight 896×896 images: windowed layers (64 patches), full layers.
            ((8, 4096, 64, 16, 80), (8, 4096, 4096, 16, 80)),
            ((8, 4096, 64, 16, 80),), ((3, 40, 16, 2, 8),),
            _vision_attention_inputs, _eager_vision_attention, _liger_vision_attention, _ours_vision_attention,
        ),
    )
}  # fmt: skip
