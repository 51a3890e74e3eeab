"""grpo on a GPU (bf16, our kernels): the bench recipe's model shape cut to 4 layers trains a few
steps with generation in the loop, and the memory plan's generation phase is checked against the
peak allocated while a generation batch is made (the real-size loss kernel is checked in
tests/kernels/test_fused_linear_policy_loss.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from ligertune.config import load_recipe
from tests.helpers import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

RECIPE = ROOT / "recipes" / "qwen2.5-1.5b-grpo-bench.yaml"
# The plan does not model the allocator's rounding nor the KV cache's growth by concatenation
# (each step's cat briefly holds two copies of one layer's cache): a quarter either way.
PLAN_TOLERANCE = 0.25


def test_grpo_trains_and_the_plan_counts_its_generation(tmp_path):
    from ligertune.models.shape import frozen_shape, recipe_shape
    from ligertune.plan.estimate import estimate
    from ligertune.plan.recipe import base_setting
    from ligertune.training.trainer import Trainer

    recipe = load_recipe(
        RECIPE,
        [
            "model.config_overrides={num_hidden_layers: 4}",
            "training.max_steps=3",
            "objective.max_new_tokens=128",
            "data.max_seq_len=192",
            f"output_dir={tmp_path}",
        ],
    )
    records, peaks = [], []
    trainer, finished = Trainer(recipe, on_step_end=records.append), False
    try:
        trainer.setup()
        objective = trainer.parts.objective
        prepare = objective.prepare

        def measured(*args, **kwargs):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = prepare(*args, **kwargs)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            return out

        objective.prepare = measured
        trainer.train()
        finished = True
    finally:
        trainer.cleanup(finished)
    assert len(records) == 3 and all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) for r in records)
    assert all("reward_mean" in r.metrics and r.label_tokens > 0 for r in records)
    assert objective.fused
    # From the second generation on, the optimizer's moments exist, as the plan counts them.
    planned = estimate(recipe_shape(recipe), base_setting(recipe, 1, frozen_shape(recipe)))
    moment = planned.moments["generation (before the step)"]
    assert abs(peaks[-1] - moment) <= PLAN_TOLERANCE * moment, (peaks[-1] / 2**30, moment / 2**30)


def _policy(tmp_path, *overrides):
    """The bench recipe's policy (our kernels patched in), built by the trainer, and its tokenizer."""
    from ligertune.training.trainer import Trainer

    recipe = load_recipe(RECIPE, [f"output_dir={tmp_path}", *overrides])
    trainer = Trainer(recipe)
    trainer.setup()
    return trainer, trainer.parts.objective


def _timed_generations(objective, rows, lengths, sampling, caches):
    """Each cache's completions of the same left-padded prompts and generators, and its seconds
    (the second of two runs: the first warms the allocator and the kernels' compilation)."""
    from ligertune.objectives.rollout import RowNoise, generate

    torch.manual_seed(0)
    vocab, width = objective.policy.config.vocab_size, max(lengths)
    ids = torch.randint(3, min(vocab, 2000), (rows, width), device="cuda")
    mask = torch.zeros(rows, width, dtype=torch.int64, device="cuda")
    for row in range(rows):
        mask[row, width - lengths[row % len(lengths)] :] = 1
    ids = torch.where(mask == 1, ids, objective.tokenizer.pad_token_id)
    policy, results = objective.policy.eval(), {}
    for cache in caches:
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            done = generate(
                policy, ids, mask, sampling, RowNoise([1, 2], [rows // 2, rows - rows // 2], "cuda"),
                eos_token_id=None, pad_token_id=objective.tokenizer.pad_token_id, cache=cache,
            )  # fmt: skip
            torch.cuda.synchronize()
            results[cache] = (done, time.perf_counter() - start)
    return results


@pytest.mark.parametrize("lora", [False, True])
def test_static_cache_under_cuda_graphs_generates_what_the_dynamic_cache_does(tmp_path, lora):
    """fp32 (TF32 off), the bench model's shape cut to 4 layers, with and without LoRA adapters
    (peft's layers inside the captured graph), 16 rows of prompts of four lengths, 64 tokens,
    top-p: the graphed static decode draws the same tokens as the dynamic one (the logits differ
    in their last bits at most: a draw would have to fall within that of a CDF edge to change)."""
    from ligertune.objectives.rollout import Sampling

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    adapters = ["lora={r: 8, alpha: 16, target_modules: all-linear}"] if lora else []
    trainer, objective = _policy(
        tmp_path, "model.config_overrides={num_hidden_layers: 4}", "training.precision=fp32", *adapters
    )
    try:
        runs = _timed_generations(
            objective, 16, [3, 17, 30, 9], Sampling(64, top_p=0.9), ["dynamic", "static"]
        )
    finally:
        trainer.cleanup(True)
    (dynamic, _), (static, _) = runs["dynamic"], runs["static"]
    assert torch.equal(static.ids, dynamic.ids) and torch.equal(static.mask, dynamic.mask)


def test_static_cache_under_cuda_graphs_times(tmp_path):
    """The whole 28-layer bench shape in bf16, 64 rows × 256 tokens: each decode's time printed
    (no assertion: a GPU's timing is not a test), and how many of the tokens agree (bf16 logits
    move with the key length the attention reduces over, and a moved draw changes the rest of
    its row)."""
    from ligertune.objectives.rollout import Sampling

    trainer, objective = _policy(tmp_path)
    try:
        runs = _timed_generations(objective, 64, [30, 25, 34, 28], Sampling(256), ["dynamic", "static"])
    finally:
        trainer.cleanup(True)
    (dynamic, slow), (static, fast) = runs["dynamic"], runs["static"]
    agree = (static.ids == dynamic.ids).float().mean().item()
    print(
        f"\nbench shape, 64 rows x 256 tokens, bf16: dynamic {slow:.2f} s ({slow / 256 * 1e3:.1f} ms/token), "
        f"static + CUDA graphs {fast:.2f} s ({fast / 256 * 1e3:.1f} ms/token), {slow / fast:.2f}x; "
        f"tokens equal {agree:.1%}"
    )
