"""grpo on a GPU (bf16, our kernels): the bench recipe's model shape cut to 4 layers trains a few
steps with generation in the loop, and the memory plan's generation phase is checked against the
peak allocated while a generation batch is made (the real-size loss kernel is checked in
tests/kernels/test_fused_linear_policy_loss.py)."""

from __future__ import annotations

import math

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
