"""Vision-language fine-tuning (issue #32) on tiny random-init Qwen2.5-VL, Qwen3-VL, Gemma 3 and
Llama 3.2 Vision (mllama) models, offline: kernels on the language model and the vision tower against HF's unpatched model,
the assistant-only mask, bad images, freezing, LoRA's targets, and the quickstarts and
`generate --image` through the CLI."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from ligertune.catalog.architectures import SHIPPED_CONFIGS
from ligertune.catalog.kernels import KERNEL_NAMES
from ligertune.config import load_recipe
from ligertune.data import load_tokenizer
from ligertune.data.vision import (
    TOKEN_TYPE_KEYS,
    VisionLoader,
    build_vision_datasets,
    collate,
    load_processor,
)
from ligertune.errors import DataError, RecipeError
from ligertune.models import attention as attention_module
from ligertune.models.attention import segment_attention, segment_block_mask, segment_mask
from ligertune.models.build import build_model, freeze, tokens_per_image, vision_tower
from ligertune.models.config import build_config
from ligertune.patching import attention as attention_patch
from ligertune.patching import patch_model
from ligertune.paths import ASSETS_DIR
from tests.helpers import ROOT, pythonpath_with_root, run_repo_script

QUICKSTART_VL = ROOT / "recipes" / "quickstart-vl.yaml"
QUICKSTART_VL_GEMMA3 = ROOT / "recipes" / "quickstart-vl-gemma3.yaml"
QUICKSTART_VL_MLLAMA = ROOT / "recipes" / "quickstart-vl-mllama.yaml"
IMAGE = ASSETS_DIR / "vl_images" / "00.png"


def _recipe(*overrides: str, path=QUICKSTART_VL):
    return load_recipe(path, list(overrides))


def _data(recipe, log=None):
    tokenizer = load_tokenizer(recipe)
    vision = vision_tower(recipe)
    processor = load_processor(recipe, vision, tokenizer, tokens_per_image(build_config(recipe), vision))
    return processor, build_vision_datasets(recipe, processor, log=log)


def _batch(recipe, rows: int = 2):
    _, prepared = _data(recipe)
    loader = VisionLoader(prepared.train, rows, seed=0, pad_token_id=0, packing=False, shuffle=False)
    return next(iter(loader.iter_epoch(0)))


def _rows_file(tmp_path, rows: list[dict]):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(image: dict, answer: str = "A red square.") -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", **image}, {"type": "text", "text": "What is it?"}],
            },
            {"role": "assistant", "content": answer},
        ]
    }


# -- the kernels against HF's own model ------------------------------------------------------


# Per tiny architecture: its quickstart recipe, what the kernels must patch and where, a
# vision-tower weight whose gradient shows the images reached the loss, and the weights HF
# initialises to zeros on the images' path (filled with noise for the test, as trained weights are).
PATCHED = {
    # rms_norm: 2 × 2 decoder + final; 2 × 2 vision blocks + the merger's ln_q. swiglu: 2 + 2 vision MLPs.
    "tiny-qwen2.5-vl": (
        QUICKSTART_VL,
        {"rms_norm": 10, "swiglu": 4, "rope": 2, "vision_attention": 2, "fused_linear_cross_entropy": 1},
        (
            "vision tower (model.visual, 2 blocks): rms_norm 5, vision_attention 2, swiglu 2",
            "(apply_rotary_pos_emb_vision) is not patched",
        ),
        "model.visual.blocks.0.attn.qkv.weight",
        (),
    ),
    # rms_norm: 2 × (2 + q_norm + k_norm) + final; the vision tower's norms are nn.LayerNorm (2 × 2
    # blocks, the merger's and the deepstack merger's), its MLPs ungated.
    "tiny-qwen3-vl": (
        QUICKSTART_VL,
        {
            "rms_norm": 9,
            "layer_norm": 6,
            "swiglu": 2,
            "rope": 2,
            "fused_linear_cross_entropy": 1,
        },
        (
            "vision tower (model.visual, 2 blocks): layer_norm 6;",
            "(apply_rotary_pos_emb_vision) is not patched",
        ),
        "model.visual.blocks.0.attn.qkv.weight",
        (),
    ),
    # Gemma 3: rms_norm: 2 × (4 + q_norm + k_norm) + final in the language model, the projector's
    # mm_soft_emb_norm; SigLIP's nn.LayerNorm: 2 × 2 blocks + post_layernorm; geglu: 2 tanh-GELU
    # MLPs (SigLIP's are ungated). One sliding-window layer (theta 1e4) and one global layer
    # (theta 1e6, linear scaling 8): the RoPE kernel rotates each layer type's own cos/sin.
    "tiny-gemma3-vl": (
        QUICKSTART_VL_GEMMA3,
        {"rms_norm": 14, "layer_norm": 5, "geglu": 2, "rope": 2, "fused_linear_cross_entropy": 1},
        (
            "vision tower (model.vision_tower, 2 blocks): layer_norm 5; projector (model.multi_modal_projector): "
            "rms_norm 1; language model (model.language_model): fused_linear_cross_entropy 1, rope 2, "
            "rms_norm 13, geglu 2; rope: the language model's kernel rotates the local and global layers' "
            "cos/sin as given",
        ),
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight",
        # Gemma3PreTrainedModel._init_weights zeros the projection: no gradient would reach the tower.
        ("model.multi_modal_projector.mm_input_projection_weight",),
    ),
    # Llama 3.2 Vision: rms_norm: 2 self-attention layers × 2, the cross-attention layer's 2 and
    # its q_norm/k_norm, the final norm; nn.LayerNorm: 3 encoder layers × 2, layernorm_pre and
    # _post; swiglu: every layer's MLP; rope: the self-attention layers only.
    "tiny-mllama": (
        QUICKSTART_VL_MLLAMA,
        {"rms_norm": 9, "layer_norm": 8, "swiglu": 3, "rope": 2, "fused_linear_cross_entropy": 1},
        (
            "vision tower (model.vision_model, 3 blocks): layer_norm 8; projector (model.multi_modal_projector): "
            "nothing patched; language model (model.language_model): fused_linear_cross_entropy 1, rope 2, "
            "swiglu 3, rms_norm 9; rope: the self-attention layers' kernel rotates Llama's cos/sin; the "
            "cross-attention layers and the vision tower have no RoPE",
        ),
        "model.vision_model.transformer.layers.0.self_attn.q_proj.weight",
        # MllamaPreTrainedModel._init_weights zeros the cross-attention layer's tanh gates: its
        # output, and so the images, would not reach the loss.
        (
            "model.language_model.layers.1.cross_attn_attn_gate",
            "model.language_model.layers.1.cross_attn_mlp_gate",
        ),
    ),
}


@pytest.mark.parametrize("architecture", sorted(PATCHED))
def test_patched_matches_unpatched_with_images_loss_and_grads(architecture):
    """fp32, two rows with images, rope on: the language model's RoPE kernel rotates the cos/sin
    HF's rotary module built (Qwen-VL's 3-D sections, Gemma 3's local and global frequencies), so
    it must match exactly as well. Gemma 3's rows carry token_type_ids: both models attend both
    ways within an image's tokens. Llama 3.2 Vision's carry their tiles and cross_attention_mask
    (more images and tiles: `test_mllama_samples_...`)."""
    path, counts, where, vision_weight, zeros = PATCHED[architecture]
    recipe = _recipe("training.precision=fp32", f"model.config={architecture}", path=path)
    batch = _batch(recipe)
    reference, patched, report = _reference_and_patched(recipe, zeros)
    assert {k: report.patched[k] for k in counts} == counts
    assert all(fragment in str(report) for fragment in where)
    _assert_same_loss_and_grads(reference, patched, batch, vision_weight)


def _reference_and_patched(recipe, zeros: tuple[str, ...]):
    """The recipe's model (HF's, `zeros` filled with noise) and a copy with every kernel on."""
    reference = build_model(recipe, torch.device("cpu"))
    with torch.no_grad():
        for name in zeros:
            reference.get_parameter(name).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    patched = copy.deepcopy(reference)
    return reference, patched, patch_model(patched, "all")


def _assert_same_loss_and_grads(reference, patched, batch, vision_weight: str):
    """Loss and every gradient alike (fp32), the images' gradient reaching `vision_weight`, and the
    loss HF's ``sum / num_items_in_batch`` of the unpatched logits."""
    n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()) + 3)  # an accumulation window's count
    losses, grads = [], []
    for model in (reference, patched):
        model.train()
        model.zero_grad()
        loss = model(**batch, num_items_in_batch=n).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert grads[0][vision_weight].abs().sum() > 0  # the images reached the loss

    # The normalisation the loop relies on (HF's class says accepts_loss_kwargs=False): sum / N,
    # from the unpatched logits.
    with torch.no_grad():
        logits = reference(**batch).logits
    target = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
    torch.testing.assert_close(losses[0], summed / n, rtol=1e-5, atol=1e-6)


# -- the vision attention: one FlexAttention call per layer -------------------------------------

# Patch grids (t, h, w) of three images of different sizes: 384 patches, not a multiple of flex's
# 128-row tile once more than one image is counted in (160 + ... see below), with Qwen2.5-VL's
# 2 × 2-merged-token windows cut short at the bottom and right edges (5 and 7 merged rows/columns).
GRIDS = [[1, 10, 6], [1, 6, 14], [1, 4, 4]]  # 60 + 84 + 16 = 160 patches: padded to 256


def _tower_model(architecture: str, depth: int = 4):
    """The tiny model with a deeper vision tower: Qwen2.5-VL's blocks 1 and 3 attend over whole
    images, 0 and 2 within windows."""
    config = copy.deepcopy(SHIPPED_CONFIGS[architecture])
    config["vision_config"]["depth"] = depth
    config["vision_config"]["fullatt_block_indexes"] = [1, 3]
    recipe = _recipe("training.precision=fp32", f"model.config={json.dumps(config)}")
    return build_model(recipe, torch.device("cpu"))


def _vision_only(on: bool) -> dict[str, bool]:
    return {name: name == "vision_attention" and on for name in KERNEL_NAMES}


def _tower_forward_backward(model, pixels, grid):
    tower = model.model.visual
    pixels = pixels.clone().requires_grad_()
    out = tower(pixels, grid_thw=grid)
    features = out.pooler_output
    weights = torch.linspace(-1, 1, features.numel()).view_as(features)  # a loss that sees every output
    (features * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in tower.named_parameters() if p.grad is not None}
    return out.last_hidden_state.detach(), features.detach(), pixels.grad, grads


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_vision_attention_matches_hfs_per_segment_attention_fp32(checkpointing, monkeypatch):
    """Three images of different sizes, ragged windows, windowed and full layers: the tower's
    outputs, the pixels' gradient and every tower weight's gradient equal HF's per-segment SDPA
    path; one mask per distinct cu_seqlens per forward (windows and images), not one per layer,
    and gradient checkpointing's recompute reuses them."""
    reference = _tower_model("tiny-qwen2.5-vl")
    if checkpointing:
        reference.gradient_checkpointing_enable()
    patched = copy.deepcopy(reference)
    report = patch_model(patched, _vision_only(True))
    assert report.patched["vision_attention"] == 4
    assert "vision tower (model.visual, 4 blocks): vision_attention 4" in str(report)

    built = []
    monkeypatch.setattr(attention_patch, "segment_mask", lambda *a: built.append(a) or segment_mask(*a))
    grid = torch.tensor(GRIDS)
    config = reference.config.vision_config
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(0))
    for model in (reference, patched):
        model.train()
    expected = _tower_forward_backward(reference, pixels, grid)
    got = _tower_forward_backward(patched, pixels, grid)
    assert len(built) == 2
    for name, a, b in zip(("hidden", "features", "pixels.grad"), got[:3], expected[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert got[3].keys() == expected[3].keys()
    for name, grad in expected[3].items():
        torch.testing.assert_close(got[3][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_segment_block_mask_is_block_diagonal_with_padding_alone():
    """The mask, densified, is exactly "same segment" over the real patches; the padding is a
    segment of its own; a tile inside one segment is full, a tile at an edge partial."""
    cu = torch.tensor([0, 64, 100, 128, 300], dtype=torch.int32)  # ragged, across a tile edge
    mask = segment_block_mask(cu, 384)
    dense = mask.to_dense()[0, 0]  # [3, 3] tiles that are computed at all
    ids = torch.searchsorted(cu[1:], torch.arange(384, dtype=torch.int32), right=True)
    same = ids[:, None] == ids[None, :]
    tile_any = same.view(3, 128, 3, 128).any(-1).any(1)
    assert torch.equal(dense.bool(), tile_any)
    assert ids[299] == 3 and ids[300] == 4 and not same[:300, 300:].any()
    q, kv = torch.meshgrid(torch.arange(384), torch.arange(384), indexing="ij")
    assert torch.equal(mask.mask_mod(0, 0, q, kv), same)
    assert mask.full_kv_num_blocks[0, 0].tolist() == [0, 1, 0]  # tile 1 (128–255) lies inside 128–300
    with pytest.raises(ValueError, match="multiple of 128"):
        segment_block_mask(cu, 300)


def _per_segment_sdpa(q, k, v, cu):
    """HF's path: one SDPA call per segment."""
    bounds = cu.tolist()
    return torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ],
        dim=1,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_path_pads_to_whole_tiles_and_matches_per_segment_attention(dtype, monkeypatch):
    """The CUDA branch of `segment_attention` (block mask, zero padding to 384, cut back) on the
    CPU, with FlexAttention unfused (forward only: flex has no CPU backward; the GPU test checks
    the gradients): equal to one SDPA call per ragged segment."""
    monkeypatch.setattr(
        attention_module,
        "compile_friendly_flex_attention",
        lambda q, k, v, training, **kwargs: flex_attention(q, k, v, **kwargs),
    )
    cu = torch.tensor([0, 16, 80, 141, 200, 300], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 300, 32, generator=generator).to(dtype) for _ in range(3))
    mask = segment_block_mask(cu, 384)
    with torch.no_grad():
        got = segment_attention(q, k, v, mask, 32**-0.5, training=False)
        dense = segment_attention(q, k, v, segment_mask(cu, 300), 32**-0.5, training=False)
    expected = _per_segment_sdpa(q.double(), k.double(), v.double(), cu)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.shape == (3, 300, 32) and got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **tol)
    torch.testing.assert_close(dense.double(), expected, **tol)


def test_vision_attention_off_keeps_hfs_forward_and_the_recipe_can_turn_it_off():
    model = _tower_model("tiny-qwen2.5-vl", depth=2)
    report = patch_model(model, _vision_only(False))
    assert report.patched["vision_attention"] == 0
    assert report.skipped["vision_attention"] == "off in the recipe"
    assert all("forward" not in block.attn.__dict__ for block in model.model.visual.blocks)

    recipe = _recipe("kernels.vision_attention=false")
    assert "vision_attention" not in recipe.kernels.enabled()
    assert "vision_attention" in _recipe().kernels.enabled()


def test_vision_attention_leaves_flash_attention_and_siglip_alone():
    model = _tower_model("tiny-qwen2.5-vl", depth=2)
    model.config.vision_config._attn_implementation = "flash_attention_2"
    report = patch_model(model, _vision_only(True))
    assert report.patched["vision_attention"] == 0
    assert "one variable-length call per layer" in report.skipped["vision_attention"]
    gemma = build_model(
        _recipe("model.config=tiny-gemma3-vl", path=QUICKSTART_VL_GEMMA3), torch.device("cpu")
    )
    report = patch_model(gemma, _vision_only(True))
    assert report.patched["vision_attention"] == 0
    assert "Qwen2.5-VL only" in report.skipped["vision_attention"]


# -- data ----------------------------------------------------------------------------------------


def test_only_assistant_text_is_trained_and_each_image_gets_its_tokens():
    recipe = _recipe("data.shuffle=false")
    processor, prepared = _data(recipe)
    first = json.loads((ASSETS_DIR / "vl_sample.jsonl").read_text().splitlines()[0])
    sample = prepared.train[0]
    tokenizer = processor.tokenizer
    trained = sample["labels"][sample["labels"] != -100]
    assert tokenizer.decode(trained) == first["messages"][1]["content"] + "<|im_end|>\n"
    ids = sample["input_ids"]
    image_tokens = int((ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    grid = sample["image_grid_thw"][0]
    assert image_tokens == int(grid.prod()) // 4 == 4  # 56×56: 4×4 patches, merged 2×2
    assert torch.equal(
        sample["mm_token_type_ids"].bool(), ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    )
    assert sample["pixel_values"].shape[0] == int(grid.prod())


def test_two_turns_with_images_of_two_sizes_train_both_answers_and_expand_in_order(tmp_path):
    from PIL import Image

    from ligertune.data.vision import encode_row

    Image.open(IMAGE).resize((112, 56)).save(tmp_path / "wide.png")
    row = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [{"type": "image", "path": str(IMAGE)}, {"type": "text", "text": "And this?"}],
            },
            {"role": "assistant", "content": "A yellow circle."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Now:"}, {"type": "image", "path": "wide.png"}],
            },
            {"role": "assistant", "content": "Wider."},
        ]
    }
    recipe = _recipe("data.image_max_pixels=6272")  # 112×56 stays as it is: 8 image tokens, 56×56: 4
    processor, _ = _data(recipe)
    sample = encode_row(processor, row, "messages", "row", tmp_path, recipe)
    tokenizer = processor.tokenizer
    trained = sample["labels"] != -100
    # Each answer with its end of turn, nothing else: split where the trained runs are.
    runs, current = [], []
    for token, keep in zip(sample["input_ids"].tolist(), trained.tolist(), strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    assert runs + ([tokenizer.decode(current)] if current else []) == [
        "A yellow circle.<|im_end|>\n",
        "Wider.<|im_end|>\n",
    ]
    # The image blocks in text order: 4 tokens for the first image, 8 for the second.
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    blocks = [len(b) for b in "".join("x" if t == pad else " " for t in sample["input_ids"].tolist()).split()]
    assert blocks == [4, 8]
    assert sample["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    assert sample["pixel_values"].shape[0] == 16 + 32


def test_a_missing_or_broken_image_is_one_line_naming_the_row_or_skipped_and_counted(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    inline = "data:image/png;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    rows = [
        _row({"path": str(IMAGE)}),
        _row({"path": "missing.png"}),
        _row({"url": inline}),
        _row({"path": "broken.png"}),
        _row({"url": "https://example.com/cat.png"}),
    ]
    path = _rows_file(tmp_path, rows)
    with pytest.raises(
        DataError, match=r"rows.jsonl, row 1: image missing.png: file not found; .*skip_bad_images"
    ):
        _data(_recipe(f"data.path={path}", "data.shuffle=false"))
    lines = []
    _, prepared = _data(_recipe(f"data.path={path}", "data.skip_bad_images=true"), lines.append)
    assert len(prepared.train) == 2  # the file path and the data: URI
    assert any("skipped 3 row(s) with a bad image" in line for line in lines)
    with pytest.raises(DataError, match="URLs are not fetched"):
        _data(_recipe(f"data.path={_rows_file(tmp_path, rows[4:])}"))


def test_a_hub_rows_images_column_fills_the_image_parts_in_order():
    """llava-instruct-mix-vsft's shape: parts without a path, the decoded images (or datasets'
    undecoded {bytes}) in an images column; the sample must be the one the file path gives."""
    from PIL import Image

    from ligertune.data.vision import encode_row

    recipe = _recipe()
    processor, _ = _data(recipe)
    hub_parts = [
        {"type": "image", "text": None, "index": 0},
        {"type": "text", "text": "What is it?", "index": None},
    ]
    hub_row = {"messages": [{"role": "user", "content": hub_parts}, _row({})["messages"][1]]}
    expected = encode_row(processor, _row({"path": str(IMAGE)}), "messages", "file", None, recipe)
    for images in ([Image.open(IMAGE)], [{"bytes": IMAGE.read_bytes(), "path": None}]):
        got = encode_row(processor, {**hub_row, "images": images}, "messages", "hub", None, recipe)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), key


def _gemma3_processor_of_hf(processor):
    """transformers' own Gemma3Processor over our tokenizer and image processor (built directly,
    the PIL image processor needs no torchvision). The bundled tokenizer lacks the named image
    token attributes a Gemma 3 checkpoint's tokenizer carries; they are set on it here."""
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tokenizer = copy.copy(processor.tokenizer)
    for name, token in (
        ("boi", "<start_of_image>"),
        ("eoi", "<end_of_image>"),
        ("image", "<image_soft_token>"),
    ):
        setattr(tokenizer, f"{name}_token", token)
        setattr(tokenizer, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    return Gemma3Processor(processor.image_processor, tokenizer, image_seq_length=processor.tokens_per_image)


def test_gemma3_samples_are_what_its_processor_makes_and_only_the_answers_train(tmp_path):
    """A system message, two images in two turns: input_ids, token_type_ids and pixel_values as
    HF's Gemma3Processor makes them from the rendered conversation (each <start_of_image> → the
    image between blank lines: boi, 4 soft tokens, eoi); labels on the answers only."""
    from ligertune.data.vision import encode_row

    row = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [{"type": "image", "path": str(IMAGE)}, {"type": "text", "text": "And?"}],
            },
            {"role": "assistant", "content": "A yellow circle."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Now:"}, {"type": "image", "path": "01.png"}],
            },
            {"role": "assistant", "content": "Blue."},
        ]
    }
    recipe = _recipe(path=QUICKSTART_VL_GEMMA3)
    processor, _ = _data(recipe)
    sample = encode_row(processor, row, "messages", "row", IMAGE.parent, recipe)
    tokenizer = processor.tokenizer
    text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    from PIL import Image

    images = [Image.open(IMAGE.parent / name).convert("RGB") for name in ("00.png", "01.png")]
    expected = _gemma3_processor_of_hf(processor)(
        images=[images], text=[text], add_special_tokens=False, return_tensors="pt"
    )
    assert torch.equal(sample["input_ids"], expected["input_ids"][0])
    assert torch.equal(sample["token_type_ids"], expected["token_type_ids"][0])
    assert torch.equal(sample["pixel_values"], expected["pixel_values"])
    assert sample.keys() == {"input_ids", "labels", "token_type_ids", "pixel_values"}
    trained = sample["labels"] != -100
    assert (
        tokenizer.decode(sample["input_ids"][trained])
        == "A yellow circle.<end_of_turn>\nBlue.<end_of_turn>\n"
    )
    assert int(sample["token_type_ids"].sum()) == 8  # 2 images × mm_tokens_per_image


def test_gemma3_token_type_ids_reach_the_model_and_make_image_attention_bidirectional():
    """The training batch carries token_type_ids, the objective passes them to the model, and HF's
    model then lets an image's tokens attend to later ones in the same image: the outputs at the
    image's first token differ from a causal forward's."""
    from ligertune.objectives.causal_lm import MODEL_INPUTS

    recipe = _recipe("training.precision=fp32", path=QUICKSTART_VL_GEMMA3)
    batch = _batch(recipe)
    assert "token_type_ids" in MODEL_INPUTS and "token_type_ids" in batch
    model = build_model(recipe, torch.device("cpu")).eval()
    with torch.no_grad():
        model.get_parameter("model.multi_modal_projector.mm_input_projection_weight").normal_(0.0, 0.02)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        both_ways = model(**inputs).logits
        causal = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits
    first_image_token = int(batch["token_type_ids"][0].nonzero()[0])
    assert not torch.allclose(both_ways[0, first_image_token], causal[0, first_image_token])
    text_before = first_image_token - 3  # before "\n\n<start_of_image>": untouched either way
    torch.testing.assert_close(both_ways[0, :text_before], causal[0, :text_before])


def _wide_image(tmp_path):
    """Two bundled images side by side, 112×56: two 56×56 tiles (aspect ratio 1×2)."""
    from PIL import Image

    wide = Image.new("RGB", (112, 56))
    wide.paste(Image.open(IMAGE).convert("RGB"), (0, 0))
    wide.paste(Image.open(IMAGE.parent / "01.png").convert("RGB"), (56, 0))
    path = tmp_path / "wide.png"
    wide.save(path)
    return path


def test_mllama_samples_are_what_its_processor_makes_and_its_kernels_match_hf_on_them(tmp_path):
    """Llama 3.2 Vision, two rows: a system message and two images in two turns (one of two tiles),
    and a quickstart row of one image. Each row's input_ids (one <|image|> per image, nothing
    expanded), and the batch's tiles, aspect_ratio_ids/mask and cross_attention_mask, as HF's
    MllamaProcessor makes them from the rendered conversations (the mask compared on the real
    tokens: the batch pads each row's mask with zeros, where HF's processor, tokenising the
    padded batch, extends a last image's span over the padding, which attends nowhere); labels on
    the answers only. Then the kernels against HF's model on that batch: loss and every gradient."""
    from PIL import Image
    from transformers.models.mllama.processing_mllama import MllamaProcessor

    from ligertune.data.vision import collate, encode_row

    wide = _wide_image(tmp_path)
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {
                    "role": "user",
                    "content": [{"type": "image", "path": str(wide)}, {"type": "text", "text": "And?"}],
                },
                {"role": "assistant", "content": "Two shapes."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Now:"}, {"type": "image", "path": "01.png"}],
                },
                {"role": "assistant", "content": "Blue."},
            ]
        },
        _row({"path": str(IMAGE)}),
    ]
    recipe = _recipe("training.precision=fp32", path=QUICKSTART_VL_MLLAMA)
    processor, _ = _data(recipe)
    samples = [encode_row(processor, row, "messages", "row", IMAGE.parent, recipe) for row in rows]
    tokenizer = processor.tokenizer
    trained = samples[0]["labels"] != -100
    assert tokenizer.decode(samples[0]["input_ids"][trained]) == "Two shapes.<|eot_id|>Blue.<|eot_id|>"
    assert samples[0].keys() == {
        "input_ids",
        "labels",
        "pixel_values",
        "aspect_ratio_ids",
        "aspect_ratio_mask",
        "cross_attention_spans",
    }
    batch = collate(samples, tokenizer.pad_token_id)

    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    images = [
        [Image.open(wide).convert("RGB"), Image.open(IMAGE.parent / "01.png").convert("RGB")],
        [Image.open(IMAGE).convert("RGB")],
    ]
    expected = MllamaProcessor(processor.image_processor, tokenizer)(
        images=images, text=texts, add_special_tokens=False, padding=True, return_tensors="pt"
    )
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert torch.equal(batch["attention_mask"], expected["attention_mask"])
    for key in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
        assert torch.equal(batch[key], expected[key]), key
    # Row 0: the wide image's 2 tiles, then one; row 1: one, then the padded image's first tile.
    assert batch["aspect_ratio_mask"].tolist() == [[[1, 1], [1, 0]], [[1, 0], [1, 0]]]
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["cross_attention_mask"][real], expected["cross_attention_mask"][real])
    # Each image seen from its <|image|> up to the next image's (the last: to the row's end), all its tiles.
    first, second = (samples[0]["input_ids"] == processor.image_token_id).nonzero()[:, 0].tolist()
    end = len(samples[0]["input_ids"])
    assert batch["cross_attention_mask"][0].sum(0).tolist() == [[second - first] * 2, [end - second, 0]]

    _, _, _, vision_weight, zeros = PATCHED["tiny-mllama"]
    reference, patched, _ = _reference_and_patched(recipe, zeros)
    _assert_same_loss_and_grads(reference, patched, batch, vision_weight)


def test_mllama_decoder_layers_include_its_cross_attention_layers_and_their_attention_checkpoints():
    """The units of checkpointing, compile and FSDP2 are both layer kinds; selective checkpointing
    of the attention finds a cross-attention layer's ``cross_attn``, and leaves the loss alone."""
    from ligertune.models.build import decoder_layers
    from ligertune.training.transforms.checkpointing import checkpoint_submodules

    recipe = _recipe("training.precision=fp32", path=QUICKSTART_VL_MLLAMA)
    batch = _batch(recipe)
    model = build_model(recipe, torch.device("cpu")).train()
    with torch.no_grad():
        for name in PATCHED["tiny-mllama"][4]:
            model.get_parameter(name).fill_(0.5)
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == [
        "MllamaSelfAttentionDecoderLayer",
        "MllamaCrossAttentionDecoderLayer",
        "MllamaSelfAttentionDecoderLayer",
    ]
    plain = model(**batch).loss
    assert checkpoint_submodules(layers, ["attention", "mlp"], 1) == 3
    torch.testing.assert_close(model(**batch).loss, plain)


def test_gemma3_refuses_pixel_bounds_and_pan_and_scan(tmp_path):
    import shutil

    with pytest.raises(RecipeError, match="fixed size .4 image tokens each.; remove them"):
        _data(_recipe("data.image_max_pixels=3136", path=QUICKSTART_VL_GEMMA3))
    with pytest.raises(RecipeError, match="tiles every image at its image processor's tile size"):
        _data(_recipe("data.image_min_pixels=3136", path=QUICKSTART_VL_MLLAMA))
    folder = tmp_path / "processor"
    shutil.copytree(ASSETS_DIR / "vl_processor_gemma3", folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**config, "do_pan_and_scan": True}))
    with pytest.raises(DataError, match="do_pan_and_scan on: pan-and-scan crops are not supported yet"):
        _data(_recipe(f"tokenizer.name_or_path={folder}", path=QUICKSTART_VL_GEMMA3))


def test_what_does_not_cover_vision_language_models_says_so(capsys):
    from typer.testing import CliRunner

    from ligertune.cli import app

    result = CliRunner().invoke(app, ["validate", str(QUICKSTART_VL), "--check"])
    assert result.exit_code == 2 and "--check does not cover vision-language models yet" in result.output


def test_the_bundled_images_and_processor_are_what_their_script_writes():
    done = run_repo_script("scripts/make_vl_sample.py", "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_packing_is_refused_with_its_reason():
    with pytest.raises(RecipeError, match="data.packing: rows with images are padded, not packed"):
        _data(_recipe("data.packing=true"))


def test_validate_opens_the_first_rows_images(tmp_path):
    from ligertune.data.peek import data_problems

    path = _rows_file(tmp_path, [_row({"path": "missing.png"})])
    problems, _ = data_problems(_recipe(f"data.path={path}"))
    assert len(problems) == 1 and "row 0: image missing.png: file not found" in problems[0]
    assert data_problems(_recipe())[0] == []


# -- freezing and LoRA ---------------------------------------------------------------------------


def test_freeze_names_its_parts_and_leaves_the_projector_inside_the_tower_trainable():
    recipe = _recipe("model.freeze=[vision]")
    model = build_model(recipe, torch.device("cpu"))
    freeze(model, recipe.model.freeze)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any(
        n.startswith("model.visual.blocks.") or n.startswith("model.visual.patch_embed") for n in trains
    )
    assert any(n.startswith("model.visual.merger.") for n in trains)
    assert any(n.startswith("model.language_model.") for n in trains) and "lm_head.weight" in trains
    with pytest.raises(RecipeError, match="allowed: 'vision', 'projector' or 'language_model'"):
        _recipe("model.freeze=[eyes]")


def test_freeze_on_gemma3_names_its_projector_outside_the_tower_and_its_tied_lm_head_goes_with_the_embeddings():
    recipe = _recipe("model.freeze=[vision]", path=QUICKSTART_VL_GEMMA3)
    model = build_model(recipe, torch.device("cpu"))
    freeze(model, recipe.model.freeze)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith("model.vision_tower.") for n in trains)
    assert {n for n in trains if n.startswith("model.multi_modal_projector.")} == {
        "model.multi_modal_projector.mm_input_projection_weight",
        "model.multi_modal_projector.mm_soft_emb_norm.weight",
    }
    freeze(model, ["projector", "language_model"])
    # Gemma 3 ties the lm_head to the embeddings (one parameter): it is frozen with the language model.
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert not any(p.requires_grad for p in model.parameters())


def test_freeze_on_mllama_names_its_tower_projector_and_language_model():
    recipe = _recipe("model.freeze=[vision]", path=QUICKSTART_VL_MLLAMA)
    model = build_model(recipe, torch.device("cpu"))
    freeze(model, recipe.model.freeze)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith("model.vision_model.") for n in trains)
    assert {n for n in trains if n.startswith("model.multi_modal_projector.")} == {
        "model.multi_modal_projector.weight",
        "model.multi_modal_projector.bias",
    }
    freeze(model, ["projector", "language_model"])
    assert {name for name, p in model.named_parameters() if p.requires_grad} == {"lm_head.weight"}


@pytest.mark.parametrize(
    "path", [QUICKSTART_VL, QUICKSTART_VL_GEMMA3, QUICKSTART_VL_MLLAMA], ids=lambda p: p.stem
)
def test_lora_adapts_the_language_model_only(path):
    pytest.importorskip("peft")
    from ligertune.lora import apply_lora

    recipe = _recipe("lora={r: 4}", path=path)
    model = build_model(recipe, torch.device("cpu"))
    adapted, _ = apply_lora(model, recipe)
    adapted_names = [n for n, _ in adapted.named_modules() if n.endswith(".lora_A")]
    assert adapted_names and all(".language_model." in n for n in adapted_names)


# -- through the CLI -----------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    # Kernels run their PyTorch references here (TRITON_INTERPRET off): the parity test above runs Triton.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "ligertune", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": pythonpath_with_root()},
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", [QUICKSTART_VL, QUICKSTART_VL_GEMMA3, QUICKSTART_VL_MLLAMA], ids=lambda p: p.stem
)
def test_quickstart_vl_trains_through_the_cli_and_generate_answers_about_an_image(tmp_path, path):
    done = _cli("train", path.stem, "training.max_steps=4", "logging.log_every=1", f"output_dir={tmp_path}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if '"event": "train"' in line
    ]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "note: vision tower (model.vis" in done.stdout + done.stderr

    assert (
        tmp_path / "final" / "preprocessor_config.json"
    ).is_file()  # the export carries its image processor
    done = _cli("generate", str(tmp_path), "--image", str(IMAGE), "--prompt", "What is it?", "-n", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    # The one greedy token, against the exported model's own forward on the prompt the training
    # pipeline builds for the same conversation (its tokens before the answer).
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "final").eval()
    processor, prepared = _data(
        _recipe(
            "data.shuffle=false", f"data.path={_rows_file(tmp_path, [_row({'path': str(IMAGE)})])}", path=path
        )
    )
    sample = prepared.train[0]
    answer_start = int((sample["labels"] != -100).nonzero()[0])
    per_token = ("input_ids", "labels", *TOKEN_TYPE_KEYS)
    prompt = {k: v[:answer_start] if k in per_token else v for k, v in sample.items()}
    inputs = collate([prompt], processor.tokenizer.pad_token_id)
    del inputs["labels"]
    with torch.no_grad():
        logits = model(**inputs).logits
    expected = processor.tokenizer.decode(logits[0, -1].argmax(), skip_special_tokens=True)
    assert done.stdout.rstrip("\n") == expected
    if path != QUICKSTART_VL:
        return  # the missing image's error does not depend on the family: one CLI start less
    missing = _cli("generate", str(tmp_path), "--image", str(tmp_path / "nope.png"), "--prompt", "Hi")
    assert missing.returncode == 2 and "nope.png: file not found" in missing.stderr


@pytest.mark.slow
def test_fsdp_shards_each_vision_block_and_two_ranks_train_as_one_process(tmp_path):
    """FSDP2 over two gloo ranks, the tower training: every vision block and every decoder layer
    is a unit of its own (checked in the worker's log of units), and the losses and gradient norms
    are one process's at the same global batch (fp32; only the reduction order differs)."""
    from ligertune.training import train
    from tests.test_distributed import FP32_RTOL, assert_losses_close, launch_worker, losses

    common = [
        "training.max_steps=3",
        "training.device=cpu",
        "training.warmup_steps=1",
        "training.adam_eps=1e-6",  # as tests/test_distributed.py's TINY: smooth tiny updates
        "data.validation_fraction=0.0",
        "logging.log_every=1",
        "logging.progress=plain",
        "checkpoint.every_steps=null",
        "checkpoint.export_hf=false",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    train(load_recipe(QUICKSTART_VL, [*common, "training.micro_batch_size=4", f"output_dir={one}"]))
    run = [*common, "training.micro_batch_size=2", "parallel.strategy=fsdp", f"output_dir={two}"]
    launch_worker([{"recipe": str(QUICKSTART_VL), "overrides": run}], tmp_path)
    assert_losses_close(losses(two), losses(one), FP32_RTOL)
    assert_losses_close(losses(two, key="grad_norm"), losses(one, key="grad_norm"), FP32_RTOL)


def test_fsdp_makes_each_vision_block_a_unit_of_its_own():
    """In one gloo process (FSDP2 at world size 1): the vision blocks, the decoder layers and the
    root are FSDP units; the vision tower's other modules belong to the root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ligertune.distributed.fsdp import FSDPRuntime
    from ligertune.distributed.runtime import leave_process_groups
    from ligertune.models.build import decoder_layers, vision_blocks

    recipe = load_recipe(QUICKSTART_VL, ["parallel.strategy=fsdp", "training.device=cpu"])
    model = build_model(recipe, torch.device("cpu"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    blocks, layers = vision_blocks(model), decoder_layers(model)
    assert len(blocks) == 2 and len(layers) == 2
    try:
        runtime = FSDPRuntime(recipe)
        model = runtime._shard(model, recipe, runtime._shard_options(), trains=True)
        assert all(isinstance(m, FSDPModule) for m in (*blocks, *layers, model))
        assert not isinstance(model.model.visual.merger, FSDPModule)
    finally:
        leave_process_groups(synchronised=False)
