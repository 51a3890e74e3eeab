"""Patch function of ``vision_attention``: a Qwen-VL vision tower's attention in one FlexAttention
call per layer, instead of one attention call per image or window.

Qwen2.5-VL's and Qwen3-VL's vision attention (``VisionTower.attention``) attend within segments
given by ``cu_seqlens``: each image in Qwen3-VL and in Qwen2.5-VL's full-attention layers
(``fullatt_block_indexes``), each window of up to 112 × 112 pixels (64 patches; smaller at an
image's right and bottom edges) in Qwen2.5-VL's other layers. Under any backend but flash-attention, transformers 5.17 splits q, k and v at
``cu_seqlens`` (``lengths.tolist()``: a host synchronisation per layer) and calls the backend once
per segment. Qwen2.5-VL-7B at 2 rows × 4 images of 896×896 makes ~2,000 SDPA calls per forward;
measured on one H100, a training step took 6.3–10 s with the GPU busy 1.9–2.2 s of it, the same
for every provider: the step was bound by the host launching those calls.

Ours computes q, k, v and the 2-D rotary exactly as HF's forward (the family's own
``apply_rotary_pos_emb_vision``), then attends in one call with the non-causal block-diagonal
mask of the segments (`ligertune.models.attention.segment_attention`). On CUDA that is compiled
FlexAttention over the sequence padded to a multiple of its 128-row tile (the padding a segment
of its own that no real patch sees, cut off after): per tile the mask says skip (two tiles
without a common segment: almost all of them), compute fully (one segment covers both tiles) or
compute with the segment-id predicate (tiles at a segment edge), so the work is the segments'
squares rounded out to tiles, one launch per layer, no host synchronisation. On the CPU, where
FlexAttention has no backward, it is SDPA under the dense "same segment" mask: the same math,
for tests and tiny models.

The mask is built once per distinct ``cu_seqlens`` tensor, not per layer: the tower hands the
same tensor to every windowed layer and another one to every full layer, and the layers share a
small cache of the last masks keyed by that tensor's storage, shape and version (so gradient
checkpointing's recompute, which may see a detached view of the same storage, finds it too).

Flash-attention (``attn_implementation="flash_attention_2"``) already makes one variable-length
call per layer: left to HF's path. Gemma 3's SigLIP tower attends over whole fixed-size images
in one call and has no ``VisionTower.attention``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from ligertune.models.attention import segment_attention, segment_mask
from ligertune.patching.common import Patcher, partial_forward, patches


class SegmentMasks:
    """The block masks of the last few ``cu_seqlens`` tensors seen by one vision tower's layers.

    A key is the tensor's device, storage, offset, shape and version counter (and the sequence
    length);
    the entry holds the tensor itself, so its storage cannot be freed and reused while cached.
    A forward uses two tensors (windows and images); four entries also cover a recompute in
    backward interleaved with the next micro-batch's forward."""

    def __init__(self, size: int = 4):
        self.entries: deque[tuple[tuple, torch.Tensor, BlockMask | torch.Tensor]] = deque(maxlen=size)

    def get(self, cu_seqlens: torch.Tensor, length: int) -> BlockMask | torch.Tensor:
        key = (
            cu_seqlens.device,
            cu_seqlens.untyped_storage().data_ptr(),
            cu_seqlens.storage_offset(),
            tuple(cu_seqlens.shape),
            cu_seqlens._version,
            length,
        )
        for cached_key, _, mask in self.entries:
            if cached_key == key:
                return mask
        mask = segment_mask(cu_seqlens, length)
        self.entries.append((key, cu_seqlens, mask))
        return mask


def _vision_attention_forward(
    self,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    *,
    masks: SegmentMasks,
    rotate: Callable,
    **kwargs,
) -> torch.Tensor:
    length = hidden_states.shape[0]
    query, key, value = (
        self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    cos, sin = position_embeddings
    query, key = rotate(query, key, cos, sin)
    query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # [heads, length, head_dim]
    out = segment_attention(query, key, value, masks.get(cu_seqlens, length), self.scaling, self.training)
    out = out.transpose(0, 1).reshape(length, -1)
    return self.proj(out)


@patches("vision_attention")
def patch_vision_attention(patcher: Patcher) -> None:
    family = patcher.family
    vision = family.vision if family is not None else None
    if vision is None or vision.attention is None:
        patcher.skip(
            "vision_attention",
            "no vision attention of this family splits its images or windows (Qwen2.5-VL only)",
        )
        return
    found = patcher.family_instances(vision.attention)
    implementation = getattr(found[0][1].config, "_attn_implementation", None) if found else None
    if implementation is not None and implementation.startswith("flash_attention"):
        patcher.skip("vision_attention", f"{implementation} already makes one variable-length call per layer")
        return
    forward = partial_forward(
        _vision_attention_forward, masks=SegmentMasks(), rotate=family.resolve("apply_rotary_pos_emb_vision")
    )
    patcher.apply(
        "vision_attention",
        [(module, forward) for _, module in found],
        [],
        f"no {vision.attention} in the model",
    )
