"""Attention for packed rows: which backend, and a document mask built once per forward without a
host synchronisation.

Packed rows hold several samples one after another; the position ids restart at each sample
(`ligertune.data.packing`). A token may only attend to earlier tokens *of its own sample*, so the
mask is causal ∧ same-document: block-diagonal.

**Which backend** (``model.attn_implementation: auto``, `choose_attention`):

- ``flash_attention_2`` on CUDA when the flash-attn package is installed: transformers turns the
  restarting position ids into variable-length (``cu_seqlens``) calls, which skip the
  cross-sample blocks entirely.
- ``flex_attention`` on CUDA otherwise, when rows are packed: FlexAttention takes the mask as a
  `BlockMask` and skips the blocks that are fully masked. On the bundled Alpaca rows ~92% of the
  attention work at 2048 tokens is such cross-sample blocks. Measured on one H100 (Llama-3.2-1B
  shape, bs 8 × 2048, kernels on): packed rows through SDPA 0.282 s/step, the same rows through
  FlexAttention 0.238 s, plain causal rows through SDPA 0.240 s. The first step pays for
  compiling the flex kernel (tens of seconds), once per process.
- ``sdpa`` otherwise: on CUDA without packing (a padded batch has one sample per row, and SDPA's
  flash kernel handles causal rows best), and always on the CPU, where it is the reference. With
  packed rows SDPA gets a dense block-diagonal mask and runs its memory-efficient or math kernel.

Each of those is taken only if the model can use it (`unsupported_backends`): its causal-LM class
declares support in the installed transformers (``_supports_sdpa``, ``_supports_flex_attn``,
``_supports_flash_attn``; transformers 5.23 withdrew SDPA from Gemma 2, 5.17 still declared it),
and the model needs nothing the backend lacks: SDPA has no attention-logit softcapping, so
transformers 5.17 silently dropped Gemma 2's softcap under SDPA (another model than the one
trained). Passed over, ``auto`` goes on down its list, ending at ``eager``, which every model
supports; the start log names the backend passed over and why.

**The document mask** (`install_document_mask`). Left alone, transformers 5.17 finds packed rows
from the position ids in every forward (``find_packed_sequence_indices``) and asks the host
whether any row is packed at all, a device-to-host synchronisation in every step. We build the
mask ourselves instead, in a forward pre-hook on the base model inside the causal LM (the causal
LM's own forward never sees it: transformers' mixture-of-experts causal LMs hand their attention
mask to the router's balancing loss as a [batch, seq] padding mask, and a packed row has no
padding to leave out): the document index of every
token is ``cumsum(position_id_t != position_id_{t-1} + 1)`` along the row (device work, no
synchronisation), and transformers' own mask builders (``create_causal_mask`` and
``create_sliding_window_causal_mask``, with our same-document predicate as their
``and_mask_function``) turn it into whatever the backend takes: a `BlockMask` for flex, a
boolean 4-D mask for SDPA, an additive one for eager. The model receives it as an already
prepared 4-D mask (or, for families whose layers alternate sliding-window and full attention,
the per-layer-type mapping those models accept), so it is built once per forward and shared by
every layer. Sliding windows stay the model's own: the sliding-window builder applies the
window, we only add the document boundary.

Not covered (the hook is not installed, and transformers' own detection runs, with its
synchronisation): flash-attention (it needs no mask), a model with bidirectional attention,
and layer types other than full and sliding-window attention.

**Context parallelism** (`install_context_parallel`, ``parallel.context_parallel: N``): every
row of a micro-batch is cut into 2N equal chunks and rank r of a context-parallel group of N
holds chunks r and 2N−1−r (`zigzag_positions`): under a causal mask the early chunks attend to
few keys and the late ones to many, so each rank's pair costs the same work. The model computes
on its shard with the original position ids (RoPE is right), and every attention layer
all-gathers K and V over the group (`gather_sequence`: the backward of the all-gather is a
reduce-scatter of the gradient, so each rank's K and V get the gradients of every rank's
queries). The local queries then attend to all N·2 chunks under a mask in *original* positions:
key index ≤ query index, and the same document for packed rows (the document ids come from the
row's position ids, gathered once per forward). The gathered keys stay in the order the
all-gather gives (rank by rank): softmax does not care about the order of the keys, and the mask
is built in that order, which saves a reordering copy per layer. The mask is built once per
forward in a pre-hook on the base model, like the document mask, and reaches the layers as an
already prepared 4-D mask: a dense boolean ``[B, 1, S/N, S]`` for SDPA (the CPU reference; on a
GPU its memory is S²/N bytes per row), a `BlockMask` over ``(S/N, S)`` for FlexAttention (which
skips the tiles above the diagonal and between documents). The model's backend name becomes
`CONTEXT_PARALLEL_ATTENTION`, under which this attention is registered with transformers'
``AttentionInterface``.

**Segments without causality** (`segment_mask`, `segment_attention`): a vision tower's
patches are segments given by ``cu_seqlens`` (images, or Qwen2.5-VL's windows), each attending
to all of itself and nothing else. One FlexAttention call over all of them, with the same
`same_document` predicate on segment ids, replaces one attention call per segment
(docs/vision.md: ``ligertune.patching.vision``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers import AttentionInterface, masking_utils
from transformers.integrations.flex_attention import compile_friendly_flex_attention

from ligertune.catalog.families import FAMILIES
from ligertune.errors import RecipeError

# Backends a recipe may name; ``auto`` picks one with `choose_attention`.
ATTENTION_BACKENDS = ("sdpa", "eager", "flex_attention", "flash_attention_2")

# FlexAttention's sparse block: the BlockMask says, per 128 × 128 tile, skip / compute / compute
# with the mask predicate.
FLEX_BLOCK = 128

# The layer types whose masks transformers builds with the two builders we call.
_MASK_BUILDERS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}


def unsupported_backends(config) -> dict[str, str]:
    """The attention backends a model of `config` cannot use with the installed transformers,
    each with why (see the module docstring). A model transformers does not map to a causal-LM
    class (custom code) is left to transformers' own checks: {}."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return {}
    flags = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
    flags["flash_attention_2"] = "_supports_flash_attn"
    unsupported = {
        backend: f"transformers {transformers.__version__} does not support {backend} for {model_class.__name__}"
        for backend, flag in flags.items()
        if not getattr(model_class, flag, False)
    }
    if getattr(config, "attn_logit_softcapping", None) is not None:
        unsupported.setdefault("sdpa", "SDPA cannot apply the model's attention logit softcapping")
    return unsupported


def choose_attention(requested: str, on_cuda: bool, packing: bool, config=None) -> tuple[str, str]:
    """The backend to build the model with, and why (for the start log). With the model's
    `config`, ``auto`` passes over the backends the model cannot use (`unsupported_backends`)."""
    if requested != "auto":
        return requested, "as the recipe says"
    unsupported = unsupported_backends(config) if config is not None else {}
    passed_over = []
    for backend, why in _auto_order(on_cuda, packing):
        if backend not in unsupported:
            skipped = "".join(f"; passed over {b}: {unsupported[b]}" for b in passed_over)
            return backend, f"{why}{skipped}"
        passed_over.append(backend)
    raise AssertionError("eager is always supported")  # the last of every order


def _auto_order(on_cuda: bool, packing: bool) -> list[tuple[str, str]]:
    """``auto``'s preferences on this machine, best first, each with why; eager closes every list."""
    order = []
    if on_cuda and importlib.util.find_spec("flash_attn") is not None:
        order.append(
            (
                "flash_attention_2",
                "auto: CUDA with flash-attn installed (variable-length calls for packed rows)",
            )
        )
    if on_cuda and packing:
        order.append(
            ("flex_attention", "auto: CUDA with packed rows (FlexAttention skips the cross-sample blocks)")
        )
    if on_cuda:
        order.append(("sdpa", "auto: CUDA with padded rows (SDPA's flash kernel on causal rows)"))
        if not packing:
            order.append(
                ("flex_attention", "auto: CUDA with padded rows (FlexAttention: SDPA cannot serve it)")
            )
        order.append(("eager", "auto: CUDA"))
    else:
        order += [("sdpa", "auto: CPU"), ("eager", "auto: CPU")]
    return order


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] index of the sample each token belongs to, counted from 0 in every row: a new sample
    starts wherever the position id does not continue the previous one. Device work only."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(-1) - 1


def same_document(documents: torch.Tensor) -> Callable:
    """The mask predicate (FlexAttention's ``mask_mod`` signature) that keeps a query and a key of
    the same sample."""

    def predicate(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return documents[batch, q] == documents[batch, kv]

    return predicate


def document_mask_problem(model: nn.Module) -> str | None:
    """Why `install_document_mask` cannot serve this model, or None."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager", "flex_attention"):
        return f"attention {implementation} needs no mask for packed rows"
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        return "the model attends bidirectionally"
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(_MASK_BUILDERS))
    if unknown:
        return f"layer types {', '.join(unknown)} have masks of their own"
    return None


def packed_masks(model: nn.Module, position_ids: torch.Tensor, dtype: torch.dtype):
    """The attention mask(s) of packed rows, in the form the model's forward takes as prepared:
    a 4-D mask, or {layer type: 4-D mask} for models with per-layer-type masks."""
    config = model.config
    batch, length = position_ids.shape
    # The builders read only the shape, dtype and device of the embeddings.
    shape_of_embeddings = torch.empty((batch, length, 0), dtype=dtype, device=position_ids.device)
    common = dict(
        config=config,
        inputs_embeds=shape_of_embeddings,
        attention_mask=None,
        past_key_values=None,
        position_ids=None,  # transformers' packed detection (and its host sync) stays off
        and_mask_function=same_document(document_ids(position_ids)),
    )
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {kind: getattr(masking_utils, _MASK_BUILDERS[kind])(**common) for kind in set(layer_types)}
    kind = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    return getattr(masking_utils, _MASK_BUILDERS[kind])(**common)


def install_document_mask(model: nn.Module) -> str:
    """Have every training or evaluation forward of `model` (packed rows: position ids, no attention
    mask, no cache) take a document mask built by `packed_masks`. Returns what it did, for the run
    log. Generation (a cache) and padded batches (an attention mask) go through untouched."""
    problem = document_mask_problem(model)
    if problem is not None:
        return f"packed rows: transformers' own mask ({problem})"
    dtype = model.get_input_embeddings().weight.dtype
    base = model.base_model  # the causal LM's inner model (module docstring: why not the causal LM)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        position_ids = kwargs.get("position_ids")
        if (
            position_ids is None
            or kwargs.get("attention_mask") is not None
            or kwargs.get("past_key_values") is not None
            or kwargs.get("use_cache")
        ):
            return args, kwargs
        kwargs["attention_mask"] = packed_masks(module, position_ids, dtype)
        return args, kwargs

    base.register_forward_pre_hook(hook, with_kwargs=True)
    implementation = model.config._attn_implementation
    return f"packed rows: {implementation} with a document mask built once per forward (no host sync)"


def segment_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[length] segment of each position: the number of segment ends at or before it
    (``searchsorted(cu_seqlens[1:], t, right=True)``), so positions from ``cu_seqlens[-1]`` on
    (padding) get the next id, a segment of their own. Device work, no host synchronisation."""
    positions = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def segment_block_mask(cu_seqlens: torch.Tensor, padded: int) -> BlockMask:
    """FlexAttention's non-causal block-diagonal mask of the segments
    ``[cu_seqlens[i], cu_seqlens[i+1])`` over ``padded`` positions (a multiple of `FLEX_BLOCK`):
    query ``q`` may attend key ``k`` iff ``id[q] == id[k]`` (`segment_ids`, `same_document`). The
    padding after ``cu_seqlens[-1]`` is a segment of its own that no real position sees.

    The mask is built from its tiles rather than by ``create_block_mask``, which evaluates the
    predicate at every (q, k) pair: 32k vision patches (a Qwen2.5-VL-7B batch of eight 896×896
    images) are 10⁹ pairs, gigabytes of temporaries per call. Ids never decrease, so a tile's
    rows hold the ids ``[first, last]`` of its first and last position; two tiles share a segment
    iff their id ranges overlap (the tile is computed, with the predicate), and every pair in the
    tile matches iff both ranges are one and the same id (a full tile: no predicate). That is
    (padded / 128)² comparisons, on the device, without a host synchronisation."""
    if padded % FLEX_BLOCK:
        raise ValueError(f"segment_block_mask: padded length {padded} is not a multiple of {FLEX_BLOCK}")
    ids = segment_ids(cu_seqlens, padded)
    tiles = ids.view(-1, FLEX_BLOCK)
    first, last = tiles[:, 0], tiles[:, -1]
    touching = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    single = first == last
    full = single[:, None] & single[None, :] & (first[:, None] == first[None, :])
    partial = touching & ~full
    return _tile_block_mask(partial[None], full[None], same_document(ids[None]), (padded, padded))


def _tile_block_mask(
    partial: torch.Tensor, full: torch.Tensor, mask_mod: Callable, seq_lengths: tuple[int, int]
) -> BlockMask:
    """A `BlockMask` from ``[B, query tiles, key tiles]`` booleans: the tiles computed with
    `mask_mod` (`partial`) and those computed without it (`full`). BlockMask's layout: per query
    tile, how many key tiles, and their indices first."""

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count[:, None], indices[:, None]

    kv_num_blocks, kv_indices = ordered(partial)
    full_kv_num_blocks, full_kv_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=seq_lengths,
    )


def segment_mask(cu_seqlens: torch.Tensor, length: int) -> BlockMask | torch.Tensor:
    """The mask `segment_attention` takes for ``length`` positions in the segments of
    ``cu_seqlens``: on CUDA a `segment_block_mask` over ``length`` rounded up to `FLEX_BLOCK`;
    elsewhere the dense ``[length, length]`` boolean "same segment" (see `segment_attention`)."""
    if cu_seqlens.device.type == "cuda":
        return segment_block_mask(cu_seqlens, -(-length // FLEX_BLOCK) * FLEX_BLOCK)
    ids = segment_ids(cu_seqlens, length)
    return ids[:, None] == ids[None, :]


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: BlockMask | torch.Tensor,
    scale: float,
    training: bool,
) -> torch.Tensor:
    """Non-causal attention of ``[heads, length, head_dim]`` q, k, v within segments, in one call.

    With a `BlockMask` (CUDA): q, k and v are padded with zero rows to the mask's length (a
    multiple of 128, the padding its own segment), run through transformers' compiled
    FlexAttention (the one the language model's ``flex_attention`` backend uses: compiled once
    per process, fused, skipping the tiles without a common segment) and cut back. With a dense
    boolean mask (the CPU, where FlexAttention has no backward and runs unfused anyway): SDPA
    under that mask, the same math materialising ``[heads, length, length]`` scores, which only
    tests and tiny models meet."""
    length = query.shape[1]
    if isinstance(mask, BlockMask):
        padded = mask.seq_lengths[0]
        query, key, value = (F.pad(t, (0, 0, 0, padded - length)).unsqueeze(0) for t in (query, key, value))
        out = compile_friendly_flex_attention(
            query, key, value, training=training, block_mask=mask, scale=scale
        )
        return out[0, :, :length]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


# --------------------------------------------------------------------------------------------
# Context parallelism (module docstring)
# --------------------------------------------------------------------------------------------

# The attention implementation a context-parallel model's config names (registered with
# transformers' AttentionInterface by `install_context_parallel`).
CONTEXT_PARALLEL_ATTENTION = "ligertune_context_parallel"


def zigzag_positions(length: int, shards: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The indices of a row of `length` tokens (a multiple of 2·`shards`) that shard `rank` holds,
    in the order it holds them: chunk ``rank`` then chunk ``2·shards − 1 − rank`` of the row cut
    into 2·shards chunks. Under a causal mask chunk c attends to c + 1 chunks of keys, so every
    rank's pair attends to 2·shards + 1 chunks: the same work on every rank."""
    chunk = length // (2 * shards)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * shards - 1 - rank) * chunk, (2 * shards - rank) * chunk, device=device)
    return torch.cat([head, tail])


def gathered_order(length: int, shards: int, device: torch.device | None = None) -> torch.Tensor:
    """[length] original index of each position of a `gather_sequence` result (rank by rank)."""
    return torch.cat([zigzag_positions(length, shards, rank, device) for rank in range(shards)])


@dataclass(frozen=True)
class ContextSplit:
    """This rank's place in its context-parallel group: the group, its size and this rank's
    index in it."""

    group: dist.ProcessGroup
    shards: int
    rank: int


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dimension, differentiable. The gathered tensor feeds every rank's
    loss, so the gradient of a rank's shard is the *sum* over ranks of the gathered gradient's
    slice for that shard: a reduce-scatter (NCCL), or on gloo, which has none, an all-reduce of
    which each rank keeps its slice. (``torch.distributed.nn.functional.all_gather`` does the
    same, but is deprecated in torch 2.13, and on gloo its backward hands the collectives the
    non-contiguous slices of a gradient gathered along an inner dimension, which gave wrong
    K/V gradients here.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            pieces = [piece.contiguous() for piece in grad.chunk(size, dim=ctx.dim)]
            mine = torch.empty_like(pieces[rank])
            dist.reduce_scatter(mine, pieces, group=ctx.group)
            return mine, None, None
        total = grad.contiguous()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(split: ContextSplit, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The group's shards of `tensor` concatenated along `dim`, rank by rank; its backward sums
    every rank's gradient of the whole and hands each rank its slice (`_GatherSequence`)."""
    return _GatherSequence.apply(tensor, split.group, dim)


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why the context-parallel attention cannot run `model`, or None. The mask is one for every
    layer (full causal attention), the loss and every other per-token term must be sums that
    the shards add up (a mixture-of-experts router's balancing loss is a mean over the forward's
    tokens, so each shard would weigh its own), and images are spliced into the sequence before
    the first layer."""
    config = model.config
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None and family.experts is not None:
        why = (
            "its router loss is a mean over each forward"
            if family.balancing_loss
            else "not tried with context parallelism"
        )
        return f"{config.model_type} is a mixture-of-experts model ({why})"
    if getattr(config, "vision_config", None) is not None:
        return f"{config.model_type} is a vision-language model"
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        return "the model attends bidirectionally"
    layer_types = set(getattr(config, "layer_types", None) or ("full_attention",))
    if layer_types != {"full_attention"} or (
        getattr(config, "layer_types", None) is None and getattr(config, "sliding_window", None) is not None
    ):
        return "the model has sliding-window layers (only full causal attention is split)"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "the model caps its attention logits (softcapping)"
    if getattr(config, "attention_dropout", 0.0):
        return "the model has attention dropout"
    return None


def context_parallel_mask(
    split: ContextSplit, position_ids: torch.Tensor, flex: bool
) -> torch.Tensor | BlockMask:
    """The mask of this shard's queries against the gathered keys (`shard_mask`), from the
    shard's position ids: the group's are gathered (no gradient, a few kB) and put back in the
    row's order, so the documents are cut from the whole row as in one process."""
    length = position_ids.shape[1] * split.shards
    pieces = [torch.empty_like(position_ids) for _ in range(split.shards)]
    dist.all_gather(pieces, position_ids.contiguous(), group=split.group)
    row = torch.empty((position_ids.shape[0], length), dtype=position_ids.dtype, device=position_ids.device)
    row[:, gathered_order(length, split.shards, position_ids.device)] = torch.cat(pieces, dim=1)
    return shard_mask(row, split.shards, split.rank, flex)


def shard_mask(row_positions: torch.Tensor, shards: int, rank: int, flex: bool) -> torch.Tensor | BlockMask:
    """The mask of shard `rank`'s queries ``[B, S/N]`` against the keys of all shards as
    `gather_sequence` orders them ``[B, S]`` (module docstring), from the whole rows' position
    ids ``[B, S]``: key index ≤ query index, same document (`document_ids`). A dense boolean
    ``[B, 1, S/N, S]`` for SDPA, or with `flex` a `BlockMask` of the same predicate: built from
    its 128 × 128 tiles' bounds when S/N is a multiple of 128 ((S/N/128) · (S/128) comparisons,
    no compilation: at a million tokens evaluating every pair would be 10¹¹ predicate calls),
    else by ``create_block_mask`` (compiled on CUDA)."""
    batch, length = row_positions.shape
    device = row_positions.device
    documents = document_ids(row_positions)
    query_index = zigzag_positions(length, shards, rank, device)
    key_index = gathered_order(length, shards, device)
    query_documents, key_documents = documents[:, query_index], documents[:, key_index]
    if not flex:
        causal = query_index[:, None] >= key_index[None, :]
        return (causal[None] & (query_documents[:, :, None] == key_documents[:, None, :]))[:, None]

    def mask_mod(b, head, q, kv):
        return (query_index[q] >= key_index[kv]) & (query_documents[b, q] == key_documents[b, kv])

    if len(query_index) % FLEX_BLOCK:
        return create_block_mask(
            mask_mod, batch, None, len(query_index), length, device=device, _compile=device.type == "cuda"
        )

    # Tile by tile, without evaluating the S²/N (query, key) pairs: a tile's positions are those
    # of one or two chunks, so their smallest and largest position and document bound it. No
    # pair of a tile is causal when its smallest key comes after its largest query, every pair
    # is when its largest key comes at or before its smallest query; no pair shares a document
    # when the document ranges do not overlap (documents never decrease along the row), every
    # pair does when both tiles hold one and the same document. A tile that is neither empty
    # nor full is computed with the predicate.
    def bounds(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = values.unflatten(-1, (-1, FLEX_BLOCK))
        return tiles.amin(-1), tiles.amax(-1)

    (q_first, q_last), (k_first, k_last) = bounds(query_index), bounds(key_index)
    (qd_first, qd_last), (kd_first, kd_last) = bounds(query_documents), bounds(key_documents)
    causal_some = k_first[None, :] <= q_last[:, None]
    causal_all = k_last[None, :] <= q_first[:, None]
    same_some = (kd_first[:, None, :] <= qd_last[:, :, None]) & (qd_first[:, :, None] <= kd_last[:, None, :])
    one_document = (qd_first == qd_last)[:, :, None] & (kd_first == kd_last)[:, None, :]
    same_all = one_document & (qd_first[:, :, None] == kd_first[:, None, :])
    full = causal_all[None] & same_all
    partial = causal_some[None] & same_some & ~full
    return _tile_block_mask(partial, full, mask_mod, (len(query_index), length))


def context_parallel_attention(
    split: ContextSplit,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q ``[B, Hq, S/N, D]`` of this shard, k and v
    ``[B, Hkv, S/N, D]``, gathered here to ``[B, Hkv, S, D]``; `attention_mask` is
    `context_parallel_mask`'s. Returns ``[B, S/N, Hq, D]``. Grouped-query heads are not repeated:
    SDPA and FlexAttention take ``enable_gqa``. The gathered K and V are the memory price of this
    layer: 2·S·Hkv·D elements, kept for backward. `dropout` is always 0 here
    (`context_parallel_problem` refuses models with attention dropout), and the other keywords
    transformers passes (sliding window, softcap) belong to the layer types it refuses too."""
    key, value = gather_sequence(split, key, 2), gather_sequence(split, value, 2)
    if isinstance(attention_mask, BlockMask):
        out = compile_friendly_flex_attention(
            query,
            key,
            value,
            training=module.training,
            block_mask=attention_mask,
            scale=scaling,
            enable_gqa=True,
        )
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


def install_context_parallel(model: nn.Module, split: ContextSplit) -> str:
    """Route every attention layer of `model` through `context_parallel_attention` over `split`,
    with the mask built once per forward from the shard's position ids (a forward pre-hook on
    the base model, as `install_document_mask`). Returns the run log's line. RecipeError when
    the model cannot be split (`context_parallel_problem`) or its backend has no form here."""
    problem = context_parallel_problem(model)
    backend = model.config._attn_implementation
    if problem is None and backend not in ("sdpa", "flex_attention"):
        problem = f"attention {backend} has no context-parallel form (sdpa, flex_attention)"
    if problem is not None:
        raise RecipeError(
            [f"parallel.context_parallel: {split.shards}: {problem}; use parallel.context_parallel=1"]
        )
    flex = backend == "flex_attention"

    def attention(*args, **kwargs):
        return context_parallel_attention(split, *args, **kwargs)

    AttentionInterface.register(CONTEXT_PARALLEL_ATTENTION, attention)
    model.config._attn_implementation = CONTEXT_PARALLEL_ATTENTION

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs["attention_mask"] = context_parallel_mask(split, kwargs["position_ids"], flex)
        return args, kwargs

    # The Hugging Face model's inner base model, also under peft's wrapper (LoRA).
    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    hf_model.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    return (
        f"context parallel: every row split over {split.shards} ranks (head-and-tail chunks), "
        f"K and V all-gathered in every layer, {backend} against the whole row"
    )
