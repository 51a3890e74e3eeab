"""Vision-language patching at a mid size on the GPU: fp32 parity of loss and every gradient,
kernels on vs HF's own model, on the bundled images scaled to 224×224 (64 image tokens each).

Qwen2.5-VL and Qwen3-VL shapes with a language model of hidden 1024, 4 layers, 16 heads (4 KV
heads, head_dim 64) and a 4-block vision tower of hidden 256; batch of 4 rows. TF32 is off
(PyTorch's default for matmuls), so both models compute in true fp32: the tolerance is
``ligertune.tools.check.FP32_TOL`` on the loss, and 1e-4 relative on each gradient (the CPU test's).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ligertune.config import load_recipe
from ligertune.models.build import build_model
from ligertune.patching import patch_model
from ligertune.tools.check import FP32_TOL
from tests.test_vision import QUICKSTART_VL, _batch

pytestmark = pytest.mark.gpu

TEXT = dict(
    vocab_size=2052,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
VISION = dict(
    depth=4,
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    out_hidden_size=1024,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
TOKENS = dict(vision_start_token_id=2048, vision_end_token_id=2049, image_token_id=2050, video_token_id=2051)
CONFIGS = {
    "qwen2_5_vl": dict(
        text_config=dict(TEXT, rope_parameters=ROPE),
        vision_config=dict(VISION, window_size=112, fullatt_block_indexes=[3]),
    ),
    "qwen3_vl": dict(
        text_config=dict(TEXT, rope_parameters=dict(ROPE, mrope_interleaved=True)),
        vision_config=dict(VISION, num_position_embeddings=256, deepstack_visual_indexes=[1]),
    ),
}


def mid_recipe(model_type: str):
    config = dict(model_type=model_type, **CONFIGS[model_type], **TOKENS, tie_word_embeddings=False)
    overrides = ["training.precision=fp32", "data.image_min_pixels=50176", "data.image_max_pixels=50176"]
    return load_recipe(QUICKSTART_VL, [f"model.config={json.dumps(config)}", *overrides])


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_mid_size_parity_with_images_fp32(model_type):
    recipe = mid_recipe(model_type)
    batch = {k: v.cuda() for k, v in _batch(recipe, rows=4).items()}
    reference = build_model(recipe, torch.device("cuda"))
    patched = copy.deepcopy(reference)
    report = patch_model(patched, "all")
    assert report.patched["rope"] == 4 and report.patched["fused_linear_cross_entropy"] == 1
    n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()), device="cuda")
    losses, grads = [], []
    for model in (reference, patched):
        model.train()
        loss = model(**batch, num_items_in_batch=n).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad for k, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=FP32_TOL, atol=0.0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
