"""The preference and distillation objectives under DDP, FSDP2 and DeepSpeed ZeRO-3: real
2-process torchrun launches (gloo, CPU, fp32) of the quickstart recipes shrunk to the tiny model
of tests/helpers.py, with the fused lm_head kernels on (Triton interpreter), against one process
at the same global batch; and the frozen reference or teacher placed as the strategy places the
policy: a plain replica under DDP, DTensor shards under FSDP2, ZeRO-3 partitions (gathered only
around each module's forward) under DeepSpeed.

Shapes: one process trains 2 items (pairs, examples, packed rows) × 2 micro-batches per step,
two ranks 2 each, so every micro-batch holds the same rows in both (slice i·world + rank of the
loader). KTO needs that: its reference point z₀ is a micro-batch mean. Two steps (warm-up lr)
of short rows: with the kernels in the interpreter, the whole file takes well under a minute
on two cores. Evaluation runs the same objective code under no_grad; tests/test_distributed.py
covers it across ranks.

The file is also the worker: ``python tests/test_objectives_distributed.py SPEC.json`` under
torchrun (`tests.test_distributed.launch_worker`), which trains each case and reports what it
found about the frozen model and which weights the fused kernels got.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ligertune.config import load_recipe
from tests.helpers import PLAIN_RUN, ROOT, TINY_MODEL
from tests.test_distributed import FP32_RTOL, assert_losses_close, launch_worker, losses

pytestmark = pytest.mark.slow  # multi-process (kept in CI: the whole file takes ~40 s on 2 cores)

OBJECTIVES = ("dpo", "kto", "distill")
STRATEGIES = ("ddp", "fsdp", "deepspeed")
COMMON = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "kernels.fused_linear_cross_entropy=true",
    "training.device=cpu",
    "training.max_steps=2",
    "training.warmup_steps=1",
    "training.adam_eps=1e-6",  # as in tests/test_distributed.py: reduction order stays out of the weights
    "training.micro_batch_size=2",
    "data.validation_fraction=0.0",
    "checkpoint.save_final=false",
]
ONE_PROCESS = [*COMMON, "training.gradient_accumulation_steps=2"]
TWO_RANKS = [*COMMON, "training.gradient_accumulation_steps=1"]
LORA = "lora={r: 4, alpha: 8}"
# The fused log-prob kernel runs in the interpreter, at a cost per row: pairs of 32-token rows.
# (The distill data stays at 64: its alpaca prompts alone are longer than 32 tokens.)
SHORT_ROWS = {"dpo": ["data.max_seq_len=32"], "kto": ["data.max_seq_len=32"]}


def _case(objective: str, overrides: list[str], where: Path) -> dict:
    return {
        "recipe": str(ROOT / "recipes" / f"quickstart-{objective}.yaml"),
        "overrides": [*overrides, *SHORT_ROWS.get(objective, []), f"output_dir={where}"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The one-process runs (each objective, and dpo with LoRA) here; then one torchrun launch
    of every objective under every strategy (sharded init, the default), dpo under ZeRO-3 built
    whole, and the LoRA dpo under ddp and fsdp."""
    from ligertune.training import train

    root = tmp_path_factory.mktemp("objectives")
    single = {f"{name}-one": (name, ONE_PROCESS) for name in OBJECTIVES}
    single["dpo-lora-one"] = ("dpo", [*ONE_PROCESS, LORA])
    for case, (name, overrides) in single.items():
        spec = _case(name, overrides, root / case)
        train(load_recipe(spec["recipe"], spec["overrides"]))
    launched = {
        f"{name}-{strategy}": (name, [*TWO_RANKS, f"parallel.strategy={strategy}"])
        for name in OBJECTIVES
        for strategy in STRATEGIES
    }
    # ZeRO-3 built whole (no zero.Init): deepspeed.initialize partitions the frozen model itself.
    launched["dpo-deepspeed-whole"] = (
        "dpo",
        [*TWO_RANKS, "parallel.strategy=deepspeed", "parallel.sharded_init=false"],
    )
    for strategy in ("ddp", "fsdp"):
        launched[f"dpo-lora-{strategy}"] = ("dpo", [*TWO_RANKS, LORA, f"parallel.strategy={strategy}"])
    spec = [_case(name, overrides, root / case) for case, (name, overrides) in launched.items()]
    launch_worker(spec, root, worker=__file__)
    return {case: root / case for case in [*single, *launched]}


def _report(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"frozen-rank{rank}.json").read_text())


# The objectives' metrics, per step. Rewards are β times a difference of two log-probs of ~−50
# that nearly cancel, so they agree to the log-probs' fp32 precision: an absolute tolerance.
METRICS = {
    "dpo": ("rewards_chosen", "rewards_rejected", "rewards_margin", "logps_chosen", "logps_rejected"),
    "kto": ("kl", "rewards", "logps"),
    "distill": ("ce", "kl"),
}
METRIC_ATOL = 1e-6
# The gradients agree to ≤ 4e-7 per parameter and their float64 norms to 1e-8 (measured, dpo),
# but the logged norm is an fp32 sum of squares over ~350k entries, which each strategy adds up
# in another order (per shard): that alone moves it by up to ~1.3e-5 here, and the one-process
# fp32 norm is itself 1.4e-5 from the float64 one.
GRAD_NORM_RTOL = 5e-5


def _assert_matches(got: Path, expected: Path, objective: str, label: str) -> None:
    assert_losses_close(losses(got), losses(expected), FP32_RTOL, f"{label} loss")
    assert_losses_close(
        losses(got, key="grad_norm"), losses(expected, key="grad_norm"), GRAD_NORM_RTOL, f"{label} grad_norm"
    )
    for key in METRICS[objective]:
        assert_losses_close(
            losses(got, key=key), losses(expected, key=key), FP32_RTOL, f"{label} {key}", METRIC_ATOL
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_matches_one_process(objective, strategy, runs):
    """Loss, gradient norm and the objective's metrics of the 2-rank run equal the one-process
    run's at every step; the fused kernels ran for the policy and for the frozen model, each on
    its whole [vocab, hidden] lm_head weight (gathered under FSDP2 and ZeRO-3)."""
    got = runs[f"{objective}-{strategy}"]
    _assert_matches(got, runs[f"{objective}-one"], objective, f"{objective} {strategy}")
    # Per rank and step, one micro-batch: the policy's call and the frozen model's (distill: one
    # call with both weights, the teacher is 128 wide).
    expected = [[[2048, 64], [2048, 128]]] * 2 if objective == "distill" else [[2048, 64]] * 4
    for rank in (0, 1):
        assert _report(got, rank)["kernel_weights"] == expected, (objective, strategy, rank)


def test_zero3_partitions_a_frozen_model_built_whole(runs):
    """Without sharded init the reference is built whole on every rank and the inference engine
    partitions it: the same placement and the same run."""
    got = runs["dpo-deepspeed-whole"]
    _assert_matches(got, runs["dpo-one"], "dpo", "dpo deepspeed, built whole")
    for rank in (0, 1):
        report = _report(got, rank)
        assert report["zero3_partitioned"] and report["local_fraction"] == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_frozen_model_is_placed_like_the_policy(objective, runs):
    """DDP: a plain replica (no wrapper, whole weights). FSDP2: every parameter a DTensor of
    which each rank holds half, resharded after the frozen forwards too. ZeRO-3: every parameter
    partitioned in halves and, after training, the partitioned ones released again (the
    embedding and the lm_head; smaller ones stay whole below DeepSpeed's persistence
    threshold). Always: no gradients, no optimizer slot, eval mode."""
    for strategy in STRATEGIES:
        for rank in (0, 1):
            report = _report(runs[f"{objective}-{strategy}"], rank)
            where = (objective, strategy, rank)
            assert report["requires_grad"] is False and report["in_optimizer"] is False, where
            assert report["training"] is False, where
            if strategy == "ddp":
                assert report["wrapper"] == "LlamaForCausalLM" and report["local_fraction"] == 1.0, where
                continue
            assert report["local_fraction"] == pytest.approx(0.5, abs=0.02), where
            if strategy == "fsdp":
                assert report["all_dtensor"] and report["after"]["all_dtensor"], where
            else:
                assert report["wrapper"] == "DeepSpeedEngine" and report["zero3_partitioned"], where
                assert report["engine_optimizer"] == "DeepSpeedZeRoOffload", where
                assert report["after"]["released"] == ["lm_head.weight", "model.embed_tokens.weight"], where


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_reference_is_the_policy_with_adapters_off_on_two_ranks(strategy, runs):
    """With LoRA no frozen copy is built under any strategy: the wrapped policy runs with its
    adapters off, the run equals one process's, and the first step's rewards are exactly 0."""
    got = runs[f"dpo-lora-{strategy}"]
    _assert_matches(got, runs["dpo-lora-one"], "dpo", f"lora {strategy}")
    assert losses(got, key="rewards_margin")[1] == 0.0
    assert _report(got, 0)["wrapper"] is None


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------


def _frozen_model(trainer):
    """The objective's teacher or frozen reference as the strategy placed it; None without one."""
    reference = getattr(trainer.parts.objective, "reference", None)
    return getattr(trainer.parts.objective, "teacher", None) or getattr(reference, "model", None)


def _placement(module) -> dict:
    """How the frozen model's parameters are held on this rank."""
    from torch.distributed.tensor import DTensor

    params = dict(module.named_parameters())
    partitioned = all(hasattr(p, "ds_tensor") for p in params.values())
    if partitioned:  # ZeRO-3: this rank's partition, and the whole parameter only while gathered
        local = sum(p.ds_tensor.numel() for p in params.values())
        total = sum(p.ds_numel for p in params.values())
    else:
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params.values())
        total = sum(p.numel() for p in params.values())
    return {
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "zero3_partitioned": partitioned,
        "local_fraction": local / total,
        "released": sorted(name for name, p in params.items() if p.numel() == 0),
    }


def _report_frozen(trainer) -> dict:
    frozen = _frozen_model(trainer)
    if frozen is None:
        return {"wrapper": None}
    module = getattr(frozen, "module", frozen)  # DeepSpeed's engine holds the model
    trained = {id(p) for group in trainer.parts.optimizer.param_groups for p in group["params"]}
    return {
        "wrapper": type(frozen).__name__,
        # ZeRO-3 without an optimizer: its parameter offload manager stands in for one.
        "engine_optimizer": type(getattr(frozen, "optimizer", None)).__name__,
        "training": module.training,
        "requires_grad": any(p.requires_grad for p in module.parameters()),
        "in_optimizer": any(id(p) in trained for p in module.parameters()),
        **_placement(module),
    }


def _work(spec: Path) -> None:
    """Train each case of the spec in one process group and write ``frozen-rank<R>.json`` into
    its run directory: `_report_frozen` after setup, `_placement` again after training (under
    ``after``), and the lm_head weight shapes every fused kernel call got (policy and frozen
    model alike; distill: [student, teacher])."""
    import torch.distributed as dist

    from ligertune.distributed.runtime import leave_process_groups
    from ligertune.objectives import distill, logps
    from ligertune.training.trainer import Trainer

    dist.init_process_group("gloo")
    calls = []
    logprobs, distillation = logps.fused_linear_logprobs, distill.fused_linear_distillation

    def recording_logprobs(hidden, weight, *args, **kwargs):
        calls.append(list(weight.shape))
        return logprobs(hidden, weight, *args, **kwargs)

    def recording_distillation(hidden, weight, teacher_hidden, teacher_weight, *args, **kwargs):
        calls.append([list(weight.shape), list(teacher_weight.shape)])
        return distillation(hidden, weight, teacher_hidden, teacher_weight, *args, **kwargs)

    logps.fused_linear_logprobs = recording_logprobs
    distill.fused_linear_distillation = recording_distillation
    for case in json.loads(spec.read_text()):
        calls.clear()
        recipe = load_recipe(case["recipe"], case["overrides"])
        trainer, finished = Trainer(recipe), False
        try:
            trainer.setup()
            report = _report_frozen(trainer)
            trainer.train()
            finished = True
        finally:
            trainer.cleanup(finished)
        frozen = _frozen_model(trainer)
        if frozen is not None:
            report["after"] = _placement(getattr(frozen, "module", frozen))
        report["kernel_weights"] = list(calls)
        (recipe.run_dir / f"frozen-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_groups(synchronised=True)


if __name__ == "__main__":
    _work(Path(sys.argv[1]))
