"""Vision-language patching on the GPU: at a mid size, fp32 parity of loss and every gradient,
kernels on vs HF's own model, on the bundled images scaled to 224×224 (64 image tokens each);
and the vision attention (``vision_attention``: compiled FlexAttention) in a 7B-sized vision
tower on four large images, bf16, against HF's per-window SDPA.

Qwen2.5-VL and Qwen3-VL shapes with a language model of hidden 1024, 4 layers, 16 heads (4 KV
heads, head_dim 64) and a 4-block vision tower of hidden 256; batch of 4 rows. TF32 is off
(PyTorch's default for matmuls), so both models compute in true fp32: the tolerance is
``ligertune.tools.check.FP32_TOL`` on the loss, and 1e-4 relative on each gradient (the CPU test's).
"""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from ligertune.catalog.kernels import KERNEL_NAMES
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


# The released Qwen2.5-VL-7B vision tower (windows of 112 px, full attention every 8th block),
# projected to the mid text model. Qwen3-VL's tower (one SDPA call per image) is left to HF: the
# kernel was slower there (ligertune/catalog/families.py).
TOWERS_7B = {
    "qwen2_5_vl": dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=1024,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
}


def _tower_step(model, pixels, grid, weights):
    """One forward and backward of the vision tower alone; its features and every gradient."""
    model.zero_grad(set_to_none=True)
    out = model.model.visual(pixels, grid_thw=grid).pooler_output
    (out.float() * weights).sum().backward()
    # Copies: `model.to(dtype)` later converts the gradients it holds in place.
    grads = {
        k: p.grad.to(torch.float32, copy=True)
        for k, p in model.model.visual.named_parameters()
        if p.grad is not None
    }
    return out.detach().float(), grads


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("model_type", sorted(TOWERS_7B))
def test_vision_attention_at_7b_size_bf16_is_as_close_to_fp32_as_hfs(model_type):
    """Three 896×896 images and one 644×476 (Qwen2.5-VL: ragged windows at its edges; 13,000+
    patches, not a multiple of 128). The fp32 reference is HF's own path; in bf16, ours (one
    compiled flex call per layer) must be about as close to it as HF's bf16 path (one SDPA call
    per window or image) is, for the features and every tower weight's gradient. The time per
    forward + backward of each is printed (speed is the benchmarks' business, not a test's)."""
    vision = TOWERS_7B[model_type]
    config = dict(model_type=model_type, **CONFIGS[model_type], **TOKENS, tie_word_embeddings=False)
    config["vision_config"] = vision
    recipe = load_recipe(QUICKSTART_VL, [f"model.config={json.dumps(config)}", "training.precision=fp32"])
    reference = build_model(recipe, torch.device("cuda"))
    patch = vision["patch_size"]
    side = 896 // patch
    grid = torch.tensor([[1, side, side]] * 3 + [[1, 644 // patch, 476 // patch]], device="cuda")
    grid[:, 1:] -= grid[:, 1:] % 2  # whole merged 2×2 patches, as the processor resizes to
    width = 3 * vision["temporal_patch_size"] * patch**2
    generator = torch.Generator(device="cuda").manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, device="cuda", generator=generator)
    assert pixels.shape[0] % 128 != 0
    merged = pixels.shape[0] // 4
    weights = torch.randn(merged, 1024, device="cuda", generator=generator)

    reference.train()
    expected, expected_grads = _tower_step(reference, pixels, grid, weights)
    hf = reference.to(torch.bfloat16)
    ours = copy.deepcopy(hf)
    report = patch_model(ours, {name: name == "vision_attention" for name in KERNEL_NAMES})
    assert report.patched["vision_attention"] == vision["depth"]

    pixels = pixels.bfloat16()
    times, errors = {}, {}
    for name, model in (("hf", hf), ("ours", ours)):
        _tower_step(model, pixels, grid, weights)  # warm-up: compiles flex for ours
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            got, grads = _tower_step(model, pixels, grid, weights)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 3
        errors[name] = {"features": _relative_error(got, expected)}
        errors[name].update({k: _relative_error(g, expected_grads[k]) for k, g in grads.items()})
    print(
        f"{model_type}: {pixels.shape[0]} patches, s per tower fwd+bwd: HF {times['hf']:.3f}, ours {times['ours']:.3f}"
    )
    hf_errors, our_errors = errors["hf"], errors["ours"]
    assert our_errors.keys() == hf_errors.keys()
    worst = max(our_errors, key=lambda k: our_errors[k] / (hf_errors[k] + 1e-3))
    print(f"worst: {worst} ours {our_errors[worst]:.2e} HF {hf_errors[worst]:.2e}; features ours "
          f"{our_errors['features']:.2e} HF {hf_errors['features']:.2e}")  # fmt: skip
    for name, error in our_errors.items():
        assert error <= 1.5 * hf_errors[name] + 1e-3, (name, error, hf_errors[name])
