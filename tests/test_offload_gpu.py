"""Activation offload on the GPU (``training.activation_offload``; the design is in
ligertune/training/memory/offload.py): the same losses and gradients as without it, with our
kernels and with sub-module checkpointing too, over several steps and with two forwards
before one backward; less memory at the loss and at the peak; and no host synchronisation in
forward or backward. On CPU the option is a no-op (tests/test_checkpointing.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ligertune.patching.apply import patch_model
from ligertune.training.transforms.checkpointing import checkpoint_submodules
from ligertune.training.transforms.offload import MIN_OFFLOAD_BYTES, install_offload

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device


def llama(layers: int, hidden: int, intermediate: int, attn: str, vocab: int = 8192) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=vocab,
        use_cache=False,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).cuda()


def offloaded(model: nn.Module, modules: list[str] | None = None) -> nn.Module:
    copied = copy.deepcopy(model)
    layers = list(copied.model.layers)
    if modules:
        checkpoint_submodules(layers, modules, 1)
    assert install_offload(layers) == len(layers)
    return copied


def step(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One optimizer-free step: the forwards of `batches` summed into one backward (two
    forwards before a backward, as a preference objective does); the losses and gradients."""
    model.zero_grad(set_to_none=True)
    losses = [model(input_ids=ids, labels=ids).loss for ids in batches]
    sum(losses).backward()
    torch.cuda.synchronize()
    return [loss.item() for loss in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


# Eager attention is deterministic in fp32 (the fused attention backwards may use atomics), so
# the offloaded run must reproduce the plain one to rounding: the copies move bytes, nothing else.
@pytest.mark.parametrize(
    "kernels, modules",
    [("none", None), ("all", None), ("all", ["attention"]), ("none", ["mlp"])],
    ids=["eager", "kernels", "kernels-recompute-attention", "eager-recompute-mlp"],
)
def test_offload_keeps_losses_and_gradients(kernels, modules):
    """fp32, 4 layers, rows large enough that every activation passes `MIN_OFFLOAD_BYTES`.
    With kernels on, the fused SwiGLU backward writes into the gate/up tensors it saved: the
    last layer's, still referenced when backward starts, must have finished their copies
    first. Three steps: later steps reuse the pinned buffers and release the earlier step's
    last group; the second step runs two forwards before its backward."""
    plain = llama(layers=4, hidden=256, intermediate=1024, attn="eager")
    if kernels == "all":
        patch_model(plain, "all")
    model = offloaded(plain, modules)
    if modules:
        checkpoint_submodules(list(plain.model.layers), modules, 1)
    generator = torch.Generator(device="cuda").manual_seed(0)
    ids = [torch.randint(0, 8192, (2, 1024), device="cuda", generator=generator) for _ in range(4)]
    assert 2 * 1024 * 256 * 4 >= MIN_OFFLOAD_BYTES  # the smallest activation, [rows, seq, hidden] fp32
    for batches in ([ids[0]], [ids[1], ids[2]], [ids[3]]):
        expected_losses, expected = step(plain, batches)
        losses, got = step(model, batches)
        assert losses == pytest.approx(expected_losses, rel=1e-6)
        for name, g in expected.items():
            torch.testing.assert_close(got[name], g, msg=name)


def test_offload_lowers_memory_at_the_loss_and_the_peak():
    """8 layers of a 1024-wide Llama at 4 × 2048 tokens: at the end of the forward about one
    layer's activations stay on the GPU instead of eight, and the step's peak (about two layers
    in backward: the one running and the one prefetched) falls well below the plain one's."""
    plain = llama(layers=8, hidden=1024, intermediate=4096, attn="sdpa")
    model = offloaded(plain)
    ids = torch.randint(0, 8192, (4, 2048), device="cuda")
    at_loss, peaks = [], []
    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = m(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        at_loss.append(torch.cuda.memory_allocated() - before)
        loss.backward()
        del loss
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    assert at_loss[1] < 0.5 * at_loss[0], at_loss
    assert peaks[1] < 0.6 * peaks[0], peaks


class Block(nn.Module):
    """A residual MLP block: something to offload, and nothing that synchronises by itself."""

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_offload_never_synchronises_the_host():
    """Forward and backward through offloaded blocks with CUDA's sync debug mode on error: any
    call that makes the host wait for the GPU (a blocking copy, an event or stream
    synchronize, .item()) raises. Gradients as without offload."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block(512) for _ in range(4))).cuda()
    offloaded_blocks = copy.deepcopy(blocks)
    install_offload(list(offloaded_blocks))
    x = torch.randn(8, 1024, 512, device="cuda")
    grads = []
    for model in (blocks, offloaded_blocks):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a)
