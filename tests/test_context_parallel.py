"""Context parallelism (``parallel.context_parallel``): every row split over the ranks of a
group, K and V all-gathered in every attention layer.

The launches are real ``torchrun --nproc-per-node 2`` jobs with gloo (the worker of
tests/test_distributed.py), context_parallel 2 × data-parallel 1, fp32, two steps each, against
one process on the same rows: the losses, the gradient norms and the weights after the steps
(the export) agree to fp32 reduction order. Rows of odd length are padded to a multiple of 2N
(unpacked rows of varied lengths; packed rows of 63 tokens, with the document mask), under ddp
and fsdp (with activation checkpointing and the fused linear cross entropy through the
interpreter: the shard's pre-shifted targets), for Llama and Qwen3.
"""

from __future__ import annotations

import json

import pytest
import torch

from ligertune.config import RecipeError, load_recipe
from ligertune.data.formats import IGNORE_INDEX
from ligertune.distributed.context import context_split, shard_rows
from ligertune.distributed.launch import LaunchError, LaunchOptions, check_options
from ligertune.models.attention import (
    CONTEXT_PARALLEL_ATTENTION,
    ContextSplit,
    document_ids,
    gathered_order,
    shard_mask,
    zigzag_positions,
)
from ligertune.objectives.causal_lm import count_label_tokens
from ligertune.training import train
from ligertune.training.step import count_input_tokens
from tests.helpers import QUICKSTART
from tests.test_distributed import TINY, assert_losses_close, launch_worker, losses

TWO_STEPS = [
    "training.max_steps=2",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
    "data.validation_fraction=0.0",
    "checkpoint.export_hf=true",
    "training.eval_every=null",
]
QWEN3 = [
    "model.config={model_type: qwen3, vocab_size: 2048, hidden_size: 64, intermediate_size: 128, "
    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
    "tie_word_embeddings: false}",
    "model.config_overrides={}",
]
# name → overrides of both arms: unpacked rows of varied length (each micro-batch padded to
# its longest, then to a multiple of 4), packed rows of 63 tokens (padded by one).
CASES = {
    "ddp-unpacked-lora-eval": [
        "data.packing=false",
        "data.max_seq_len=150",
        "data.validation_fraction=0.05",
        "training.eval_every=2",
        "lora.r=4",
    ],
    "fsdp-packed-flce": [
        "data.max_seq_len=63",
        "kernels.fused_linear_cross_entropy=true",
        "training.activation_checkpointing=true",
    ],
    "fsdp-qwen3-packed": ["data.max_seq_len=63", *QWEN3],
}
STRATEGY = {"ddp-unpacked-lora-eval": "ddp", "fsdp-packed-flce": "fsdp", "fsdp-qwen3-packed": "fsdp"}
FP32_RTOL = 1e-5


@pytest.mark.slow
def test_context_parallel_matches_one_process(tmp_path):
    runs = []
    for name, overrides in CASES.items():
        common = TINY + TWO_STEPS + overrides
        train(load_recipe(QUICKSTART, common + [f"output_dir={tmp_path / 'one' / name}"]))
        split = [f"parallel.strategy={STRATEGY[name]}", "parallel.context_parallel=2"]
        runs.append(common + split + [f"output_dir={tmp_path / 'cp' / name}"])
    output = launch_worker(runs, tmp_path)
    assert output.count("context parallel: every row split over 2 ranks") == len(CASES)
    for name in CASES:
        one, cp = tmp_path / "one" / name, tmp_path / "cp" / name
        assert_losses_close(losses(cp), losses(one), FP32_RTOL, name)
        assert_losses_close(losses(cp, key="grad_norm"), losses(one, key="grad_norm"), FP32_RTOL, name)
        ours, theirs = _exported(cp), _exported(one)
        assert ours and ours.keys() == theirs.keys()
        for key, value in theirs.items():
            torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=5e-6, msg=f"{name}: {key}")
        for saved in (cp / "final").glob("*.json"):  # the backend's name stays in the process
            assert CONTEXT_PARALLEL_ATTENTION not in saved.read_text(), saved
    evaluated = tmp_path / "one" / "ddp-unpacked-lora-eval", tmp_path / "cp" / "ddp-unpacked-lora-eval"
    assert losses(evaluated[0], "eval")
    assert_losses_close(losses(evaluated[1], "eval"), losses(evaluated[0], "eval"), FP32_RTOL)
    # The fused loss ran on each shard: 2 ranks' calls, each with the whole lm_head weight.
    calls = json.loads((tmp_path / "cp" / "fsdp-packed-flce" / "flce-rank0.json").read_text())
    assert calls and all(shape == [2048, 64] for shape in calls)


def _exported(run_dir) -> dict[str, torch.Tensor]:
    """The final export's tensors: the whole model, or the LoRA adapter."""
    from safetensors.torch import load_file

    return {
        key: value
        for path in (run_dir / "final").glob("*.safetensors")
        for key, value in load_file(path).items()
    }


def test_shards_reassemble_the_row_and_count_each_token_once():
    """The shards of a micro-batch in zig-zag order are the row padded to a multiple of 2N with
    the targets shifted before the split: every label and every input token is on exactly one
    rank, at its original position."""
    torch.manual_seed(0)
    shards, length = 3, 13  # padded to 18: chunks of 3
    ids = torch.randint(1, 100, (2, length))
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    labels[1, 10:] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    batch = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.arange(length).repeat(2, 1),
        "attention_mask": mask,
    }
    parts = [shard_rows(batch, ContextSplit(None, shards, rank)) for rank in range(shards)]
    order = torch.cat([zigzag_positions(18, shards, rank) for rank in range(shards)])
    assert sorted(order.tolist()) == list(range(18))
    assert order[:6].tolist() == [0, 1, 2, 15, 16, 17]
    whole = {key: torch.empty((2, 18), dtype=torch.int64) for key in parts[0]}
    for key in whole:
        whole[key][:, order] = torch.cat([part[key] for part in parts], dim=1)
    assert torch.equal(whole["input_ids"][:, :length], ids)
    assert torch.equal(whole["position_ids"], torch.arange(18).repeat(2, 1))
    assert torch.equal(whole["shift_labels"][:, : length - 1], labels[:, 1:])
    assert (whole["shift_labels"][:, length - 1 :] == IGNORE_INDEX).all()
    assert torch.equal(whole["labels"], whole["shift_labels"])
    assert sum(count_label_tokens(part) for part in parts) == count_label_tokens(batch)
    assert sum(count_input_tokens(part) for part in parts) == count_input_tokens(batch)


def _packed_rows() -> torch.Tensor:
    """Position ids of two packed rows of 16: documents of 5, 7, 4 and of 16 tokens."""
    first = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])
    return torch.stack([first, torch.arange(16)])


@pytest.mark.parametrize("shards", [2, 4])
def test_shard_masks_are_the_rows_causal_document_mask(shards):
    """Each shard's rows of the mask, with its keys in gathered order, are the rows of the whole
    sequence's causal same-document mask at the shard's original positions."""
    positions = _packed_rows()
    documents = document_ids(positions)
    index = torch.arange(16)
    whole = (index[:, None] >= index[None, :]) & (documents[:, :, None] == documents[:, None, :])
    keys = gathered_order(16, shards)
    for rank in range(shards):
        queries = zigzag_positions(16, shards, rank)
        mask = shard_mask(positions, shards, rank, flex=False)
        assert mask.shape == (2, 1, 16 // shards, 16)
        assert torch.equal(mask[:, 0], whole[:, queries][:, :, keys])


def test_flex_block_mask_attends_as_the_dense_mask():
    """FlexAttention under the shard's BlockMask (eager, on the CPU) computes what SDPA computes
    under the dense mask, grouped-query heads included."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    positions = _packed_rows()
    query = torch.randn(2, 4, 8, 16)
    key, value = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16)
    for rank in range(2):
        dense = shard_mask(positions, 2, rank, flex=False)
        blocks = shard_mask(positions, 2, rank, flex=True)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=dense, enable_gqa=True
        )
        got = flex_attention(query, key, value, block_mask=blocks, enable_gqa=True)
        torch.testing.assert_close(got, expected)


def _tiles(counts: torch.Tensor, indices: torch.Tensor, key_tiles: int) -> torch.Tensor:
    """A BlockMask's ``[B, H, query tiles, key tiles]`` booleans from its counts and indices."""
    listed = (torch.arange(indices.shape[-1]) < counts[..., None]).to(torch.int8)
    dense = torch.zeros(*indices.shape[:-1], key_tiles, dtype=torch.int8)
    return dense.scatter_reduce(-1, indices.long(), listed, "amax").bool()


@pytest.mark.parametrize(("shards", "length"), [(2, 512), (4, 1536)])
def test_tile_built_block_mask_covers_the_predicate(shards, length):
    """The BlockMask built from tile bounds (S/N a multiple of 128): every tile holding an
    attended pair is computed, a tile computed without the predicate holds only attended pairs,
    and FlexAttention under it (eager, CPU) computes what SDPA computes under the dense mask. At
    1536 over 4 shards the chunks (192 tokens) are not whole tiles, so tiles straddle two chunks.
    Row 0 packs documents of uneven lengths, row 1 is one document; for one document and tiles
    within a chunk the tiles are exactly create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    generator = torch.Generator().manual_seed(shards)
    cuts = torch.sort(torch.randperm(length - 1, generator=generator)[:7] + 1).values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
    packed = torch.cat([torch.arange(n) for n in lengths])
    positions = torch.stack([packed, torch.arange(length)])
    query = torch.randn(2, 4, length // shards, 16, generator=generator)
    key, value = (torch.randn(2, 2, length, 16, generator=generator) for _ in range(2))
    tile_count = length // 128
    for rank in range(shards):
        dense = shard_mask(positions, shards, rank, flex=False)
        blocks = shard_mask(positions, shards, rank, flex=True)
        partial = _tiles(blocks.kv_num_blocks, blocks.kv_indices, tile_count)
        full = _tiles(blocks.full_kv_num_blocks, blocks.full_kv_indices, tile_count)
        tiled = dense.unflatten(2, (-1, 128)).unflatten(4, (-1, 128))  # [B, 1, qt, 128, kt, 128]
        assert not (tiled.any(dim=(3, 5)) & ~(partial | full)).any(), "an attended tile is skipped"
        assert not (full & ~tiled.all(dim=(3, 5))).any(), "a tile computed without the mask has masked pairs"
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=dense, enable_gqa=True
        )
        got = flex_attention(query, key, value, block_mask=blocks, enable_gqa=True)
        torch.testing.assert_close(got, expected)
        if shards == 2:
            queries, keys = zigzag_positions(length, shards, rank), gathered_order(length, shards)
            exact = create_block_mask(
                lambda b, h, q, kv, queries=queries, keys=keys: queries[q] >= keys[kv],
                1,
                None,
                len(queries),
                length,
                device="cpu",
            )
            assert torch.equal(partial[1], _tiles(exact.kv_num_blocks, exact.kv_indices, tile_count)[0])
            assert torch.equal(
                full[1], _tiles(exact.full_kv_num_blocks, exact.full_kv_indices, tile_count)[0]
            )


def test_world_size_must_be_a_multiple():
    recipe = load_recipe(QUICKSTART, ["parallel.strategy=ddp", "parallel.context_parallel=2"])
    with pytest.raises(LaunchError, match="parallel.context_parallel: 2 does not divide the 3 processes"):
        check_options(LaunchOptions(nproc_per_node=3), recipe)
    with pytest.raises(
        RecipeError, match="parallel.context_parallel: 4 does not divide the job's 6 processes"
    ):
        context_split(4, 6, 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=none"], "not supported with parallel.strategy none"),
        (["parallel.strategy=deepspeed"], "not supported with parallel.strategy deepspeed"),
        (["parallel.strategy=fsdp", "model.attn_implementation=eager"], "model.attn_implementation: eager"),
        (["parallel.strategy=fsdp", "training.compile=true"], "training.compile: not tried"),
    ],
)
def test_refused_combinations_name_the_key(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(QUICKSTART, ["parallel.context_parallel=2", *overrides])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "length, offload", [(999, False), (1024, False), (1024, True)], ids=["999", "1024", "1024-offload"]
)
def test_flex_attention_and_nccl_on_two_gpus_match_one(tmp_path, length, offload):
    """The GPU path: FlexAttention under the shard's BlockMask (999 tokens: 500 a shard, built by
    the compiled create_block_mask; 1024: 512 a shard, built from its tiles), the reduce-scatter
    backward of the K/V all-gather over NCCL, and every Triton kernel, on packed rows; fp32 (TF32
    off, torch's default), context_parallel 2 × fsdp against one GPU. With activation offload
    the split run's saved tensors, the gathered K and V among them, go to host memory and come
    back for the backward: a copy, so the losses and gradients stay the same."""
    common = TINY + TWO_STEPS
    common += [
        "training.device=cuda",
        "model.attn_implementation=flex_attention",
        f"data.max_seq_len={length}",
    ]
    common += ["kernels=all"]
    train(load_recipe(QUICKSTART, common + [f"output_dir={tmp_path / 'one'}"]))
    split = ["parallel.strategy=fsdp", "parallel.context_parallel=2"]
    if offload:
        split.append("training.activation_offload=true")
    launch_worker([common + split + [f"output_dir={tmp_path / 'cp'}"]], tmp_path)
    one, cp = tmp_path / "one", tmp_path / "cp"
    assert_losses_close(losses(cp), losses(one), 1e-4)
    assert_losses_close(losses(cp, key="grad_norm"), losses(one, key="grad_norm"), 1e-4)
