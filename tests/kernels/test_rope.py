"""RoPE kernel vs float64 references: transformers' own apply_rotary_pos_emb (DeepSeek-V3's
interleaved-pairs variant too) and rope_reference.

Forward and backward on fresh random inputs; GQA, partial rotary, broadcast cos/sin, strided
q/k (HF's transposed view, slices of a fused qkv), both layouts, odd sizes, fp32 and bf16.
Every tensor the op allocates starts as NaN (`poisoned_allocations`), so a missed element shows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb_interleave as deepseek_interleave,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

from ligertune.kernels import rope as rope_module
from ligertune.kernels.rope import apply_rotary_pos_emb, rope_reference
from ligertune.patching.rope import apply_rotary_pos_emb_interleave
from tests.kernels.helpers import (
    assert_close,
    fresh_randn,
    poisoned_allocations_fixture,  # noqa: F401 (fixture)
)


def make_qk(batch, seq, n_q, n_k, head_dim, layout, dtype, device):
    """q, k leaves requiring grad, laid out as a model produces them.

    "hf": ``view(B, S, H, D).transpose(1, 2)`` (strided, heads at dim 1); "contiguous":
    ``[B, H, S, D]``; "bshd": ``[B, S, H, D]`` (unsqueeze_dim=2); "fused": slices of one
    ``[B, S, (Hq + 2·Hkv)·D]`` projection, as Phi3's qkv_proj, then transposed.
    """
    if layout == "fused":
        qkv = fresh_randn(batch, seq, (n_q + 2 * n_k) * head_dim, dtype=dtype, device=device)
        q = qkv[..., : n_q * head_dim].view(batch, seq, n_q, head_dim).transpose(1, 2)
        k = qkv[..., n_q * head_dim : (n_q + n_k) * head_dim].view(batch, seq, n_k, head_dim).transpose(1, 2)
        return q.detach().requires_grad_(), k.detach().requires_grad_()
    q = fresh_randn(batch, seq, n_q, head_dim, dtype=dtype, device=device)
    k = fresh_randn(batch, seq, n_k, head_dim, dtype=dtype, device=device)
    if layout == "hf":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    elif layout == "contiguous":
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return q.requires_grad_(), k.requires_grad_()


def check_against(
    reference, q, k, cos, sin, unsqueeze_dim=1, grad_layout="like_output", in_place=False, ours=None
):
    """Forward and backward of ours (`apply_rotary_pos_emb`, or `ours`) vs `reference` run in
    float64 on the same (rounded) inputs.

    ``grad_layout``: the incoming gradients' memory order, "like_output" (as the outputs) or
    "heads_major" (contiguous ``[B, H, S, D]``, as attention kernels and the benchmark hand
    them over). Returns the incoming gradients and ours (for in-place checks).
    """
    if ours is None:
        q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, in_place=in_place)
    else:
        q_out, k_out = ours(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    q_ref, k_ref = reference(q64, k64, cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    assert_close(q_out, q_ref, q.dtype, "q_embed")
    assert_close(k_out, k_ref, k.dtype, "k_embed")

    def incoming(out):
        if grad_layout == "like_output":
            return torch.empty_like(out).copy_(fresh_randn(*out.shape, dtype=out.dtype, device=out.device))
        heads_dim = 1 if unsqueeze_dim == 1 else 2
        g = fresh_randn(*out.transpose(1, heads_dim).shape, dtype=out.dtype, device=out.device)
        return g.transpose(1, heads_dim)  # heads outermost after batch in memory

    dq_out, dk_out = incoming(q_out), incoming(k_out)
    dq_in, dk_in = dq_out.double(), dk_out.double()  # in_place may overwrite dq_out / dk_out
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    dq_ref, dk_ref = torch.autograd.grad((q_ref, k_ref), (q64, k64), (dq_in, dk_in))
    assert_close(dq, dq_ref, q.dtype, "dq")
    assert_close(dk, dk_ref, k.dtype, "dk")
    return (dq_out, dk_out), (dq, dk)


# (batch, seq, q heads, kv heads, head_dim, rotary_dim): GQA, MHA, MQA, odd sizes,
# non-power-of-two halves (12), partial rotary with a non-power-of-two tail (40 - 16 = 24).
SHAPES = [
    (2, 7, 6, 2, 16, 16),
    (1, 9, 3, 3, 24, 24),
    (3, 5, 5, 1, 40, 16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["hf", "contiguous", "bshd", "fused"])
@pytest.mark.parametrize("cos_batch", ["full", "broadcast"])
@pytest.mark.parametrize("grad_layout", ["like_output", "heads_major"])
def test_matches_phi3_reference(shape, dtype, layout, cos_batch, grad_layout, device, poisoned_allocations):
    """General cos/sin (unrelated halves) against HF's partial-rotary function in float64."""
    batch, seq, n_q, n_k, head_dim, rot = shape
    q, k = make_qk(batch, seq, n_q, n_k, head_dim, layout, dtype, device)
    cos_b = batch if cos_batch == "full" else 1
    cos = fresh_randn(cos_b, seq, rot, dtype=dtype, device=device)
    sin = fresh_randn(cos_b, seq, rot, dtype=dtype, device=device)
    check_against(phi3_rope, q, k, cos, sin, 2 if layout == "bshd" else 1, grad_layout)


def test_default_config_follows_memory_layout():
    """Position-major (HF's q): 16 positions × 4 heads, the H200 sweep's winner; head-major:
    many positions of a few heads (one contiguous run per head)."""
    q = torch.empty(8, 2048, 32, 128, device="meta")
    assert rope_module._default_config(q.transpose(1, 2), 1, 64) == rope_module._RopeConfig(16, 4)
    assert rope_module._default_config(q, 2, 64) == rope_module._RopeConfig(16, 4)  # [B, S, H, D]
    heads_major = torch.empty(8, 32, 2048, 128, device="meta")
    assert rope_module._default_config(heads_major, 1, 64) == rope_module._RopeConfig(16, 2)
    # Few heads or short sequences: capped at the tensor's own extent.
    assert rope_module._default_config(q[:, :4, :2].transpose(1, 2), 1, 64) == rope_module._RopeConfig(4, 2)
    assert rope_module._default_config(heads_major[:, :, :8], 1, 64) == rope_module._RopeConfig(8, 4)


# (positions, heads) per tile: one head, one position, tiles that do not divide 5 positions or
# 3 heads, tiles larger than the tensor.
@pytest.mark.parametrize("block_s,block_h", [(2, 1), (1, 4), (4, 2), (16, 8)])
@pytest.mark.parametrize("layout", ["hf", "contiguous"])
def test_tile_configs(block_s, block_h, layout, monkeypatch, device, poisoned_allocations):
    config = rope_module._RopeConfig(block_s, block_h, num_warps=2)
    monkeypatch.setattr(rope_module, "_default_config", lambda *a: config)
    q, k = make_qk(1, 5, 3, 2, 40, layout, torch.bfloat16, device)
    cos, sin = fresh_randn(1, 5, 24, device=device), fresh_randn(1, 5, 24, device=device)
    check_against(phi3_rope, q, k, cos.bfloat16(), sin.bfloat16(), grad_layout="heads_major")


@pytest.mark.parametrize("grad_layout", ["like_output", "heads_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_backward_writes_over_incoming_grads(grad_layout, dtype, device, poisoned_allocations):
    """Partial rotary too: the tail of dq is dq_embed's tail, already in place."""
    q, k = make_qk(2, 5, 4, 2, 40, "hf", dtype, device)
    cos, sin = (
        fresh_randn(1, 5, 16, dtype=dtype, device=device),
        fresh_randn(1, 5, 16, dtype=dtype, device=device),
    )
    (dq_out, dk_out), (dq, dk) = check_against(phi3_rope, q, k, cos, sin, 1, grad_layout, in_place=True)
    assert dq.data_ptr() == dq_out.data_ptr() and dk.data_ptr() == dk_out.data_ptr()


def test_in_place_backward_falls_back_on_aliased_grads(device):
    """A broadcast (zero-stride) incoming gradient is read, never written over."""
    q, k = make_qk(1, 4, 2, 1, 8, "hf", torch.float32, device)
    cos, sin = fresh_randn(1, 4, 8, device=device), fresh_randn(1, 4, 8, device=device)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin, in_place=True)
    dq_out = fresh_randn(1, 1, 1, 8, device=device).expand(q_out.shape)
    dk_out = fresh_randn(*k_out.shape, device=device)
    saved = dq_out.clone()
    dq, _ = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert torch.equal(dq_out, saved) and dq.data_ptr() != dq_out.data_ptr()
    q64 = q.detach().double().requires_grad_()
    (dq64,) = torch.autograd.grad(
        phi3_rope(q64, k.double(), cos.double(), sin.double())[0], q64, saved.double()
    )
    assert_close(dq, dq64, torch.float32, "dq")


def test_overwritable():
    buf = torch.empty(4, 10)
    assert rope_module._overwritable(buf[:2], buf[2:].t())  # disjoint ranges
    # Interleaved ranges count as overlapping (conservative: results then go to fresh buffers).
    assert not rope_module._overwritable(buf[:, :5], buf[:, 5:])
    assert not rope_module._overwritable(buf[:2], buf[1:])  # shared rows
    assert not rope_module._overwritable(torch.empty(3, 1).expand(3, 4))  # aliased elements
    assert not rope_module._overwritable(buf.as_strided((3, 3), (2, 1)))  # overlapping rows
    assert rope_module._overwritable(buf.t(), torch.empty(5)[::2])


def test_outputs_keep_input_layout(device):
    """HF's transposed q comes back in the same memory order (no hidden copy downstream)."""
    q, k = make_qk(2, 5, 4, 2, 16, "hf", torch.float32, device)
    cos, sin = fresh_randn(1, 5, 16, device=device), fresh_randn(1, 5, 16, device=device)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_rotary_embedding(dtype, device, poisoned_allocations):
    """cos/sin from a real LlamaRotaryEmbedding, vs Llama's apply_rotary_pos_emb."""
    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    batch, seq = 2, 11
    q, k = make_qk(batch, seq, 6, 2, 16, "hf", dtype, device)
    position_ids = torch.randint(0, 4096, (batch, seq), device=device)
    cos, sin = LlamaRotaryEmbedding(config).to(device)(q, position_ids)
    check_against(llama_rope, q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_phi3_partial_rotary_embedding(dtype, device, poisoned_allocations):
    """Phi3 with partial_rotary_factor 0.5: half of each head rotates, cos/sin batch of 1."""
    config = Phi3Config(
        hidden_size=160, num_attention_heads=5, num_key_value_heads=5, partial_rotary_factor=0.5
    )
    seq = 7
    q, k = make_qk(2, seq, 5, 5, 32, "fused", dtype, device)
    cos, sin = Phi3RotaryEmbedding(config).to(device)(q, torch.arange(seq, device=device)[None])
    assert cos.shape == (1, seq, 16)
    check_against(phi3_rope, q, k, cos, sin)


@pytest.mark.parametrize(
    "batch, seq, heads, nope, rope", [(2, 7, 3, 8, 6), (1, 5, 5, 0, 2), (3, 9, 2, 4, 10)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deepseek_interleaved_pairs(batch, seq, heads, nope, rope, dtype, device, poisoned_allocations):
    """DeepSeek-V3's interleaved-pairs RoPE (the permutation, then our kernel) against its own
    ``apply_rotary_pos_emb_interleave`` in float64, forward and backward, on the shapes its
    attention hands over: q's rotary part a strided slice of ``[B, H, S, nope + rope]`` heads, k's
    one head for all; odd halves (3, 5) included. cos/sin halves unrelated, so reading HF's second
    half (which it never reads) would show."""
    q_heads = fresh_randn(batch, seq, heads, nope + rope, dtype=dtype, device=device).transpose(1, 2)
    q = q_heads[..., nope:].detach().requires_grad_()
    k = fresh_randn(batch, 1, seq, rope, dtype=dtype, device=device).requires_grad_()
    cos, sin = (fresh_randn(batch, seq, rope, dtype=dtype, device=device) for _ in range(2))
    check_against(deepseek_interleave, q, k, cos, sin, ours=apply_rotary_pos_emb_interleave)


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_reference_matches_hf(unsqueeze_dim):
    """The pure-PyTorch reference (the CPU fallback) against HF's function."""
    layout = "hf" if unsqueeze_dim == 1 else "bshd"
    q, k = make_qk(2, 6, 4, 2, 24, layout, torch.float64, "cpu")
    cos, sin = fresh_randn(2, 6, 16, dtype=torch.float64), fresh_randn(2, 6, 16, dtype=torch.float64)
    ours = rope_reference(q, k, cos, sin, unsqueeze_dim)
    ref = phi3_rope(q, k, cos, sin, unsqueeze_dim)
    for out, expected, name in zip(ours, ref, ("q", "k"), strict=True):
        assert_close(out, expected, torch.float32, name)


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Off the Triton path (plain CPU tensors, no interpreter) the reference runs, autograd included."""
    monkeypatch.setattr(rope_module, "use_triton", lambda *ts: False)
    q, k = make_qk(2, 5, 4, 2, 24, "hf", torch.float32, "cpu")
    check_against(phi3_rope, q, k, fresh_randn(1, 5, 16), fresh_randn(1, 5, 16))


def test_int64_offset_path(monkeypatch, device, poisoned_allocations):
    """The int64 index path (taken for tensors past 2**31 elements) computes the same values."""
    monkeypatch.setattr(rope_module, "offsets_need_int64", lambda *ts: True)
    q, k = make_qk(2, 5, 4, 2, 24, "fused", torch.float32, device)
    cos, sin = fresh_randn(2, 5, 16, device=device), fresh_randn(2, 5, 16, device=device)
    check_against(phi3_rope, q, k, cos, sin)


def test_only_q_used_in_loss(device):
    """A loss that ignores k still gives q its gradient (k's upstream gradient is zeros)."""
    q, k = make_qk(1, 4, 2, 1, 8, "hf", torch.float32, device)
    cos, sin = fresh_randn(1, 4, 8, device=device), fresh_randn(1, 4, 8, device=device)
    q_out, _ = apply_rotary_pos_emb(q, k, cos, sin)
    dq_out = fresh_randn(*q_out.shape, device=device)
    q_out.backward(dq_out)
    q64 = q.detach().double().requires_grad_()
    phi3_rope(q64, k.detach().double(), cos.double(), sin.double())[0].backward(dq_out.double())
    assert_close(q.grad, q64.grad, torch.float32, "dq")
    assert k.grad is None or torch.count_nonzero(k.grad) == 0


def test_empty_sequence(device):
    q = fresh_randn(2, 4, 0, 8, device=device, requires_grad=True)
    k = fresh_randn(2, 2, 0, 8, device=device, requires_grad=True)
    cos, sin = fresh_randn(2, 0, 8, device=device), fresh_randn(2, 0, 8, device=device)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    assert q_out.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize(
    "q_shape, k_shape, cos_shape, unsqueeze_dim, match",
    [
        ((2, 4, 5, 16), (2, 2, 5, 16), (2, 5, 16), 3, "unsqueeze_dim must be 1"),
        ((2, 4, 5), (2, 2, 5, 16), (2, 5, 16), 1, "q must be a 4-D"),
        ((2, 4, 5, 16), (2, 2, 6, 16), (2, 5, 16), 1, "must agree on batch, sequence"),
        ((2, 4, 5, 16), (2, 2, 5, 8), (2, 5, 16), 1, "must agree on batch, sequence"),
        ((2, 4, 5, 16), (2, 2, 5, 16), (3, 5, 16), 1, "does not match q"),
        ((2, 4, 5, 16), (2, 2, 5, 16), (2, 4, 16), 1, "does not match q"),
        ((2, 4, 5, 16), (2, 2, 5, 16), (2, 5, 15), 1, "must be even"),
        ((2, 4, 5, 16), (2, 2, 5, 16), (2, 5, 18), 1, "<= head_dim"),
        ((2, 4, 5, 16), (2, 2, 5, 16), (5, 16), 1, "cos must be a 3-D"),
    ],
)
def test_bad_inputs_raise(q_shape, k_shape, cos_shape, unsqueeze_dim, match, device):
    q, k = fresh_randn(*q_shape, device=device), fresh_randn(*k_shape, device=device)
    cos, sin = fresh_randn(*cos_shape, device=device), fresh_randn(*cos_shape, device=device)
    with pytest.raises(ValueError, match=match):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def test_cos_requiring_grad_raises(device):
    q, k = fresh_randn(1, 2, 3, 8, device=device), fresh_randn(1, 1, 3, 8, device=device)
    cos = fresh_randn(1, 3, 8, device=device, requires_grad=True)
    sin = fresh_randn(1, 3, 8, device=device)
    with pytest.raises(ValueError, match="cos/sin require grad"):
        apply_rotary_pos_emb(q, k, cos, sin)
    with torch.no_grad():
        apply_rotary_pos_emb(q, k, cos, sin)


# ---------------------------------------------------------------- GPU, benchmark shapes (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_layout", ["like_output", "heads_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_benchmark_shape_vs_llama(dtype, grad_layout):
    """B 8, S 2048, 32 q heads, 8 kv heads, D 128, cos/sin from LlamaRotaryEmbedding."""
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
    batch, seq = 8, 2048
    q, k = make_qk(batch, seq, 32, 8, 128, "hf", dtype, "cuda")
    position_ids = torch.arange(seq, device="cuda").expand(batch, seq)
    cos, sin = LlamaRotaryEmbedding(config).cuda()(q, position_ids)
    check_against(llama_rope, q, k, cos, sin, grad_layout=grad_layout, in_place=grad_layout == "heads_major")


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """q spanning more than 2**31 elements: checked on the last batch, where offsets overflow int32."""
    batch, seq, n_q, n_k, head_dim = 65, 8192, 32, 8, 128  # q: 2**31 + 2**25 elements
    q = fresh_randn(batch, seq, n_q, head_dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = fresh_randn(batch, seq, n_k, head_dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    cos = fresh_randn(1, seq, head_dim, dtype=torch.bfloat16, device="cuda")
    sin = fresh_randn(1, seq, head_dim, dtype=torch.bfloat16, device="cuda")
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    q_ref, k_ref = llama_rope(q[-1:].double(), k[-1:].double(), cos.double(), sin.double())
    assert_close(q_out[-1:], q_ref, torch.bfloat16, "q_embed, last batch")
    assert_close(k_out[-1:], k_ref, torch.bfloat16, "k_embed, last batch")
