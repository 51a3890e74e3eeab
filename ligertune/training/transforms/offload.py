"""Activation offload (``training.activation_offload``): what autograd saves inside a decoder
layer goes to pinned CPU memory during the forward, on a side CUDA stream that overlaps the
copies with the next layer's compute, and comes back ahead of the layer's backward.

What is offloaded
-----------------
Each decoder layer not checkpointed whole runs its forward inside
``torch.autograd.graph.saved_tensors_hooks``, so every tensor autograd saves there passes
through `ActivationOffload.pack`. Left where they are: CPU tensors (on CPU the option is a
no-op, and the start log says so), parameters (a frozen LoRA base weight or an FSDP2-gathered
one is not an activation), autocast's bf16 copies of the weights (`autocast_weight_copy`), and
tensors under `MIN_OFFLOAD_BYTES` (the copy would cost more than it saves). Only the decoder
layers: the loss head's saved tensors are the fused CE's gradients, used right after. A tensor
saved twice in a layer (the normed input of q, k and v) is copied once. A layer whose sub-module is checkpointed (`checkpointing`) is offloaded too:
the checkpoint's inputs are saved through the same hooks.

The streams (no host synchronisation in forward or backward)
-------------------------------------------------------------
*Forward.* `pack` makes the side stream wait for the compute stream (so the copy reads the
finished tensor) and issues the device→host copy into a pinned buffer there. The GPU tensor
must outlive the copy: the caching allocator would otherwise hand its block to the next
kernel on the compute stream while the side stream still reads it. ``record_stream`` would
make the allocator wait, but it checks the copy's event on the host at allocation time, and
the host runs ahead of the GPU, so blocks would stay unreusable and memory would grow instead
of shrinking. Instead each layer's tensors are held by reference as a group; when the next
layer's forward ends, the compute stream waits on the earlier group's copy-done event and the
references are dropped. Every later use of those blocks is then ordered after the copies on
the compute stream itself. At most two layers' saved tensors are on the GPU in the forward:
the one being computed and the one being copied.

*Backward.* The first time backward unpacks a tensor of layer i, all of layer i's tensors are
copied back on the side stream if they are not there yet, and so are layer i-1's (the next
backward: the prefetch). The destination is allocated on the compute stream, which the side
stream waits for before writing (the block's previous users are done), and the compute stream
waits on the copy's event before the first use. The copies back are freed when autograd
releases the saved tensors, on the compute stream (a layer whose backward autograd prunes is
never unpacked: when its group is freed, the compute stream waits on its copies instead). At
most two layers are back on the GPU: the one in backward and the one prefetched. The last layer's tensors are still referenced when
backward starts and are used in place (after its copies finish, since a backward may write
into what it saved: the fused SwiGLU backward does).

The trade-off
-------------
Memory: about two layers' saved activations on the GPU instead of every layer's, and the rest
in pinned host memory, per GPU (the caching host allocator keeps it from step to step; the
host needs that much RAM). Time: each layer's saved bytes cross PCIe twice, about 50 GB/s per
direction on an H100's PCIe 5 link. The side stream overlaps the copies with compute, so a
layer costs the longer of the two instead of their sum (the copies on the compute stream, the
previous design, cost the sum). Compute is usually the shorter: a Llama 3 8B layer in bf16
saves about 140 kB per token, 2.8 µs over PCIe, against under 1 µs of forward (2 µs of
backward) on an H100, so the compute stream waits at each layer boundary and the step runs at
PCIe speed, slower still where several GPUs share one host link. Offload is for sequences
whose activations do not fit otherwise; sub-module or whole-layer checkpointing costs less
time where it is enough.
Under ``training.compile`` the hooks' ``with`` block is left to the eager frame around the
compiled layer (dynamo does not trace ``saved_tensors_hooks``), and the compiled graph's
saved tensors go through the hooks as any others.

Several forwards before one backward (a preference objective's two passes) work: groups are
linked in forward order, so the prefetch may bring back a layer of the other pass early,
costing memory until its backward, never correctness.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1 << 20


class _Group:
    """What one decoder layer's forward saved, copied and fetched back together."""

    def __init__(self, previous: _Group | None):
        self.previous = weakref.ref(previous) if previous is not None else None
        self.saved: list[weakref.ref[_Offloaded]] = []
        self.by_key: dict[tuple, weakref.ref[_Offloaded]] = {}
        self.device: torch.device | None = None
        self.copied: torch.cuda.Event | None = None  # device→host copies done (side stream)
        self.fetched: torch.cuda.Event | None = None  # host→device copies done (side stream)
        self.waited = False  # the compute stream waits on `fetched`

    def live(self) -> list[_Offloaded]:
        return [s for s in (ref() for ref in self.saved) if s is not None]

    def __del__(self):
        # Copies back that no backward waited for (a layer whose backward autograd pruned): the
        # compute stream, which gets their blocks back, must not reuse them before the copies end.
        if self.fetched is not None and not self.waited:
            torch.cuda.current_stream(self.device).wait_event(self.fetched)


class _Offloaded:
    """One saved tensor: its host copy, the GPU original until its copy is done, and the copy
    back once fetched. Autograd holds it; the group holds it weakly."""

    __slots__ = ("group", "source", "host", "device", "__weakref__")

    def __init__(self, group: _Group, source: torch.Tensor, host: torch.Tensor):
        self.group, self.source, self.host = group, source, host
        self.device: torch.Tensor | None = None


def autocast_weight_copy(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is (a view of) autocast's low-precision copy of a trainable parameter.
    autocast caches those copies for its whole region, so moving one to the host frees nothing
    and costs a weight-sized copy each way."""
    base = tensor if tensor._base is None else tensor._base
    cast = base.grad_fn
    if cast is None or cast.name() != "ToCopyBackward0":
        return False
    return isinstance(getattr(cast.next_functions[0][0], "variable", None), nn.Parameter)


def _offloadable(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cuda"
        and not isinstance(tensor, nn.Parameter)
        and not (tensor.is_leaf and tensor.requires_grad)
        and tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES
        and not autocast_weight_copy(tensor)
    )


class ActivationOffload:
    """The side streams and the groups in flight of one model's decoder layers."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._current: _Group | None = None  # the layer whose forward runs
        self._pending: list[_Group] = []  # forward copies not yet waited for
        self._last: weakref.ref[_Group] | None = None

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # ---------------------------------------------------------------------------------------
    # Forward
    # ---------------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor):
        if not _offloadable(tensor):
            return tensor
        group = self._current
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        known = group.by_key.get(key)
        if known is not None and known() is not None:
            return known()
        group.device = tensor.device
        side = self._side(tensor.device)
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
        saved = _Offloaded(group, tensor, host)
        group.saved.append(weakref.ref(saved))
        group.by_key[key] = group.saved[-1]
        return saved

    def layer_forward(self, forward):
        """`forward` with its saved tensors offloaded, as one group."""

        @functools.wraps(forward)
        def wrapped(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            previous = self._last() if self._last is not None else None
            group = self._current = _Group(previous)
            try:
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    out = forward(*args, **kwargs)
            finally:
                self._current = None
            self._close(group)
            return out

        return wrapped

    def _close(self, group: _Group) -> None:
        """Mark the end of `group`'s copies, and let the compute stream take back the blocks of
        the groups before it once their copies are done."""
        self._last = weakref.ref(group)
        if group.device is None:
            return
        group.copied = self._side(group.device).record_event()
        for earlier in self._pending:
            torch.cuda.current_stream(earlier.device).wait_event(earlier.copied)
            for saved in earlier.live():
                saved.source = None
        self._pending = [group]

    # ---------------------------------------------------------------------------------------
    # Backward
    # ---------------------------------------------------------------------------------------

    def _fetch(self, group: _Group) -> None:
        """Copy back, on the side stream, those of `group`'s tensors that are neither on the GPU
        nor copied back yet (all of them, but for the last layer's while it is referenced)."""
        targets = [s for s in group.live() if s.source is None and s.device is None]
        if not targets:
            return
        compute = torch.cuda.current_stream(group.device)
        # Allocated on the compute stream, which frees them there after their backward.
        for saved in targets:
            saved.device = torch.empty_like(saved.host, device=group.device)
        side = self._side(group.device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            for saved in targets:
                saved.device.copy_(saved.host, non_blocking=True)
        group.fetched = side.record_event()
        group.waited = False

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        group = packed.group
        compute = torch.cuda.current_stream(group.device)
        if packed.source is None and packed.device is None:
            self._fetch(group)
        previous = group.previous() if group.previous is not None else None
        if previous is not None and previous.device is not None:
            self._fetch(previous)  # the next layer's backward: prefetch
        if packed.source is not None:  # still referenced: its copy may run, and backward may write to it
            compute.wait_event(group.copied)
            return packed.source
        if not group.waited:
            compute.wait_event(group.fetched)
            group.waited = True
        return packed.device


def install_offload(layers: list[nn.Module]) -> int:
    """Offload the saved activations of each layer not checkpointed whole; returns how many."""
    offload = ActivationOffload()
    count = 0
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            continue  # a checkpointed layer saves its input only
        layer.forward = offload.layer_forward(layer.forward)
        count += 1
    return count
