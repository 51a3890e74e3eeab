"""Activation offload (``training.activation_offload``) and selective activation checkpointing.

Offload: what autograd saves inside a decoder layer is copied to pinned CPU memory during the
forward and copied back when the backward needs it, through
``torch.autograd.graph.saved_tensors_hooks`` entered around each (non-checkpointed) decoder
layer's forward. Only the decoder layers: the loss head's saved tensors are the fused CE's
gradients, used right after, and parameters (leaves that require grad) are never copied.
Tensors under `MIN_OFFLOAD_BYTES` stay where they are (the copy would cost more than it saves).

The copies are issued on the compute stream with ``non_blocking=True`` into pinned memory:
asynchronous to the host (no synchronisation in forward or backward, as the loop requires) and
ordered with the kernels around them, so a freed GPU block is reused only after its copy has
read it. They are not overlapped with compute on a side stream (torch's own
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` does the same, for every saved tensor of
the model); the GPU waits for the PCIe copies, about 50 GB/s on an H100's PCIe 5 link. That is
the trade for sequences whose activations do not fit otherwise. On CPU there is nothing to
offload: the hooks leave CPU tensors alone, so the option is a no-op there (the start log says so).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1 << 20


def _pack(tensor: torch.Tensor):
    if (
        tensor.device.type != "cuda"
        or (tensor.is_leaf and tensor.requires_grad)
        or tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES
    ):
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def offloaded_forward(forward):
    """`forward` with what autograd saves inside it offloaded to pinned CPU memory."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return forward(*args, **kwargs)

    return wrapped


def install_offload(layers: list[nn.Module]) -> int:
    """Offload the saved activations of each layer not checkpointed; returns how many."""
    count = 0
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            continue  # a checkpointed layer saves its input only
        layer.forward = offloaded_forward(layer.forward)
        count += 1
    return count
