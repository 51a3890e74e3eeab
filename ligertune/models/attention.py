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

**Segments without causality** (`segment_mask`, `segment_attention`): a vision tower's
patches are segments given by ``cu_seqlens`` (images, or Qwen2.5-VL's windows), each attending
to all of itself and nothing else. One FlexAttention call over all of them, with the same
`same_document` predicate on segment ids, replaces one attention call per segment
(docs/vision.md: ``ligertune.patching.vision``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import masking_utils
from transformers.integrations.flex_attention import compile_friendly_flex_attention

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

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Per query tile: how many key tiles, and their indices first (BlockMask's layout).
        count = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count[None, None], indices[None, None]

    kv_num_blocks, kv_indices = ordered(partial)
    full_kv_num_blocks, full_kv_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_document(ids[None]),
        seq_lengths=(padded, padded),
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
