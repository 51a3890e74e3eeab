"""The preference and distillation objectives: each loss against its formula written out here
from the papers / TRL (independent of our code), the fused and materialised paths against each
other on a tiny model, the one-pass fused path of the pair objectives against the two-step one,
accumulation invariance, LoRA's adapters-off reference, and training runs whose metrics reach
metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ligertune.catalog.objectives.dpo import DPOOptions
from ligertune.config import RecipeError, load_recipe
from ligertune.kernels import fused_linear_logprobs as flp_kernel
from ligertune.objectives import build_objective
from ligertune.objectives.dpo import dpo_losses
from ligertune.objectives.kto import kto_losses
from ligertune.objectives.logps import sequence_logps
from ligertune.objectives.orpo import orpo_losses
from ligertune.objectives.simpo import simpo_losses
from ligertune.training import train
from tests.helpers import PLAIN_RUN, ROOT, TINY_MODEL, assert_same_outcomes, window_outcomes

G = torch.Generator().manual_seed(0)
PC, PR, RC, RR = (-torch.rand(6, generator=G, dtype=torch.float64) * 20 for _ in range(4))


def _logsig(x):
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_against_trl_formula(loss_type):
    beta, eps = 0.3, 0.1 if loss_type == "sigmoid" else 0.0
    loss, rc, rr = dpo_losses(PC, PR, RC, RR, beta, loss_type, eps)
    for i in range(6):
        logits = (PC[i] - PR[i]).item() - (RC[i] - RR[i]).item()  # TRL: pi_logratios - ref_logratios
        want = {
            "sigmoid": -_logsig(beta * logits) * (1 - eps) - _logsig(-beta * logits) * eps,
            "ipo": (logits - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - beta * logits),
        }[loss_type]
        assert loss[i].item() == pytest.approx(want, rel=1e-10)
        assert rc[i].item() == pytest.approx(beta * (PC[i] - RC[i]).item())


def test_orpo_against_paper_formula():
    mc, mr = PC / 30, PR / 30  # mean token log-probs
    loss, nll, log_odds = orpo_losses(mc, mr, 0.2)
    for i in range(6):
        pw, pl = math.exp(mc[i].item()), math.exp(mr[i].item())
        lor = math.log(pw / (1 - pw)) - math.log(pl / (1 - pl))
        assert log_odds[i].item() == pytest.approx(lor, rel=1e-9)
        assert loss[i].item() == pytest.approx(-mc[i].item() - 0.2 * _logsig(lor), rel=1e-9)


def test_simpo_against_paper_formula():
    mc, mr = PC / 30, PR / 30
    loss, _, _ = simpo_losses(mc, mr, beta=2.5, gamma_beta_ratio=0.4)
    for i in range(6):
        margin = 2.5 * mc[i].item() - 2.5 * mr[i].item() - 0.4 * 2.5
        assert loss[i].item() == pytest.approx(-_logsig(margin), rel=1e-9)


def test_kto_against_trl_formula():
    desirable = torch.tensor([True, False, True, False, True, True])
    kl_p, kl_r = PC.flip(0), RC.flip(0)
    loss, rewards, z0 = kto_losses(PC, RC, kl_p, kl_r, desirable, 0.1, 1.0, 1.5)
    kl = max(0.0, sum((kl_p - kl_r).tolist()) / 6)
    for i in range(6):
        r = (PC[i] - RC[i]).item()
        s = 1 / (1 + math.exp(-0.1 * (r - kl))) if desirable[i] else 1 / (1 + math.exp(-0.1 * (kl - r)))
        want = (1.0 if desirable[i] else 1.5) * (1 - s)
        assert loss[i].item() == pytest.approx(want, rel=1e-9)
    assert z0[0].item() == pytest.approx(kl)


# -- on a tiny model ----------------------------------------------------------------------------


def _recipe(name: str, *extra: str):
    overrides = [*TINY_MODEL, *PLAIN_RUN, "training.device=cpu", "data.validation_fraction=0.0", *extra]
    return load_recipe(ROOT / "recipes" / f"quickstart-{name}.yaml", overrides)


def _setup(recipe):
    from ligertune.training.trainer import Trainer

    trainer = Trainer(recipe)
    trainer.setup()
    return trainer


@pytest.mark.parametrize("name", ["dpo", "orpo", "simpo", "kto", "distill"])
def test_fused_and_materialised_paths_agree(name, tmp_path):
    """kernels on (per-token log-probs inside the lm_head, no logits; distill: the divergence
    inside the student's and then the teacher's lm_head call) and off (HF logits, log_softmax,
    gather: TRL's path) give the same loss, metrics and gradients on the same batch."""
    results, paths = [], []
    for kernels in ("kernels.fused_linear_cross_entropy=true", "kernels=none"):
        trainer = _setup(_recipe(name, kernels, f"output_dir={tmp_path / kernels[:9]}"))
        try:
            batch = next(trainer.parts.data.loader.iter_epoch(0))
            n = torch.tensor(trainer.parts.objective.count(batch))
            out = trainer.parts.objective(trainer.parts.model, batch, n)
            out.loss.backward()
            grads = [p.grad.clone() for p in trainer.parts.model.parameters() if p.grad is not None]
            results.append((out.loss.detach(), {k: v.item() for k, v in out.metrics.items()}, grads))
            paths.append(trainer.parts.objective.fused)
        finally:
            trainer.cleanup()
    (l1, m1, g1), (l2, m2, g2) = results
    assert paths == [True, False]
    if name != "distill":
        assert trainer.parts.objective.count(batch) == batch["input_ids"].shape[0] // 2
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    assert m1 == pytest.approx(m2, rel=1e-4, abs=1e-5)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "extra"),
    [("dpo", []), ("dpo", ["objective.loss_type=ipo"]), ("orpo", []), ("simpo", [])],
    ids=["dpo", "ipo", "orpo", "simpo"],
)
def test_one_pass_equals_the_two_step_path(name, extra, tmp_path, monkeypatch):
    """With the fused head, dpo/orpo/simpo evaluate their ``losses`` inside the policy's lm_head
    call, per chunk of pairs (here a tiny budget: one pair per chunk, so every chunk reads its
    own slice of the token counts and reference), and get the gradient in the forward. That is
    the two-step path's loss, metrics and gradients: per-token log-probs through the same fused
    head, the reference, then ``losses`` on all pairs at once. The policy is moved away from its
    frozen reference first, so that rewards and margins are not all 0."""
    monkeypatch.setattr(flp_kernel, "DEFAULT_MEMORY_BUDGET_BYTES", 1)
    fused, short = "kernels.fused_linear_cross_entropy=true", "data.max_seq_len=32"
    trainer = _setup(_recipe(name, fused, short, *extra, f"output_dir={tmp_path}"))
    try:
        objective, model = trainer.parts.objective, trainer.parts.model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        batch = next(trainer.parts.data.loader.iter_epoch(0))
        n = torch.tensor(objective.count(batch))
        losses, pairs_per_call = objective.losses, []

        def recording(logps, *args):
            pairs_per_call.append(logps.shape[0] // 2)
            return losses(logps, *args)

        monkeypatch.setattr(objective, "losses", recording)
        one_pass = objective(model, batch, n)
        one_pass.loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)

        ref = objective.reference.logps(model, batch)
        logps, tokens = sequence_logps(model, batch, fused=True)
        item_losses, metrics = losses(logps, tokens, ref, batch)
        two_step = item_losses.sum() / n
        two_step.backward()
        two_step_grads = [p.grad for p in model.parameters() if p.grad is not None]
    finally:
        trainer.cleanup()
    assert objective.fused and pairs_per_call == [1] * n.item()
    torch.testing.assert_close(one_pass.loss, two_step.detach(), rtol=1e-6, atol=1e-7)
    assert abs(one_pass.loss.item() - math.log(2)) > 1e-3 and one_pass.metrics["rewards_margin"] != 0
    assert one_pass.metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(
            one_pass.metrics[key], value.detach().float().sum() / n, rtol=1e-6, atol=1e-6
        )
    assert len(grads) == len(two_step_grads) > 0
    for a, b in zip(grads, two_step_grads, strict=True):  # fp32 rounding apart (~2e-7 normwise)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_accumulation_invariance_dpo(tmp_path):
    """One micro-batch of 4 pairs = four micro-batches of 1 pair, with the loop's N."""
    trainer = _setup(_recipe("dpo", f"output_dir={tmp_path}"))
    try:
        batch = next(trainer.parts.data.loader.iter_epoch(0))
        b = batch["input_ids"].shape[0] // 2
        singles = []
        for i in range(b):
            rows = [i, b + i]
            single = {k: v[rows] if v.shape[0] == 2 * b else v[[i]] for k, v in batch.items()}
            singles.append(single)
        one, four = window_outcomes(trainer, [[batch], singles])
    finally:
        trainer.cleanup()
    assert_same_outcomes(one, four)


def test_frozen_reference_starts_as_the_policy(tmp_path):
    """The frozen copy is built from the policy's section and seed and patched with the same
    kernels, so at the start its log-probs are the policy's bit for bit: every reward is 0 and
    the loss log 2, through the fused lm_head of both models."""
    trainer = _setup(_recipe("dpo", f"output_dir={tmp_path}", "kernels.fused_linear_cross_entropy=true"))
    try:
        reference = trainer.parts.objective.reference
        assert reference.kind == "frozen" and reference.fused and trainer.parts.objective.fused
        assert not any(p.requires_grad for p in reference.model.parameters()) and not reference.model.training
        batch = next(trainer.parts.data.loader.iter_epoch(0))
        out = trainer.parts.objective(
            trainer.parts.model, batch, torch.tensor(trainer.parts.objective.count(batch))
        )
        assert out.metrics["rewards_chosen"].item() == 0.0 and out.metrics["rewards_rejected"].item() == 0.0
        assert out.loss.item() == pytest.approx(math.log(2), rel=1e-6)
    finally:
        trainer.cleanup()


def test_lora_reference_is_the_policy_with_adapters_off(tmp_path):
    """No second model: the reference is the peft policy under disable_adapter(), and at the
    start (B = 0) the policy equals it, so every reward is exactly 0 and the loss is log 2."""
    recipe = _recipe("dpo", f"output_dir={tmp_path}", "lora={r: 4, alpha: 8}")
    trainer = _setup(recipe)
    try:
        reference = trainer.parts.objective.reference
        assert reference.kind == "adapters_off" and reference.model is None
        batch = next(trainer.parts.data.loader.iter_epoch(0))
        out = trainer.parts.objective(
            trainer.parts.model, batch, torch.tensor(trainer.parts.objective.count(batch))
        )
        assert out.metrics["rewards_chosen"].item() == 0.0
        assert out.loss.item() == pytest.approx(math.log(2), rel=1e-6)
        # Move an adapter: the policy changes, the reference does not.
        for name, p in trainer.parts.hf_model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.1)
        ref_before = reference.logps(trainer.parts.model, batch)
        out = trainer.parts.objective(trainer.parts.model, batch, torch.tensor(4))
        assert out.metrics["rewards_chosen"].item() != 0.0
        torch.testing.assert_close(reference.logps(trainer.parts.model, batch), ref_before)
    finally:
        trainer.cleanup()


@pytest.mark.parametrize("name", ["dpo", "kto", "distill"])
def test_training_writes_objective_metrics(name, tmp_path):
    extra = ["data.max_seq_len=64"] if name == "distill" else []
    recipe = load_recipe(
        ROOT / "recipes" / f"quickstart-{name}.yaml",
        [
            *TINY_MODEL,
            *PLAIN_RUN,
            *extra,
            "training.device=cpu",
            "training.max_steps=3",
            f"output_dir={tmp_path}",
        ],
    )
    result = train(recipe)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "train"]
    key = {"dpo": "rewards_margin", "kto": "kl", "distill": "kl"}[name]
    assert len(steps) == 3 and all(math.isfinite(r[key]) for r in steps)
    assert math.isfinite(result.final_loss)


def test_build_objective_defaults_to_sft_and_needs_the_recipe_for_a_frozen_model():
    assert build_objective().name == "sft"
    with pytest.raises(RecipeError, match="needs the recipe and the runtime"):
        build_objective(DPOOptions())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # the dpo recipe's own keys of dpo: null meant "the default" under the previous layout
        (
            ["objective.name=sft", "objective.beta=null", "objective.reference=null"],
            "needs a preference objective",
        ),
        (["data.packing=true"], "data.packing"),
        (["objective.reference=precomputed", "objective.name=orpo"], "orpo has no option reference"),
    ],
)
def test_recipe_rules_refuse(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(ROOT / "recipes" / "quickstart-dpo.yaml", overrides)
