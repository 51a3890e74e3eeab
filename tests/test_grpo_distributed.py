"""grpo under DDP and FSDP2, with and without LoRA: real 2-process torchrun launches (gloo, CPU,
fp32) of the quickstart shrunk to the tiny model, the fused lm_head loss on (Triton interpreter),
two updates per generation batch and a KL term (so the old policy's and the reference's log-probs
take part: a frozen copy placed like the policy, or with LoRA the adapters-off policy), against
one process at the same global batch.

Every rank completes its own prompts with a generator seeded by the micro-batch's place in the
data order, so two ranks draw the completions one process draws: losses, gradient norms, rewards
and KL agree step by step. Under FSDP2 the generation gathers the weights once per generation
batch (`Runtime.gathered`): the worker counts the all-gathers while `_generate` runs, one per
FSDP unit, against one per unit and token without it.

The file is also the worker (``python tests/test_grpo_distributed.py SPEC.json`` under torchrun).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ligertune.config import load_recipe
from tests.helpers import PLAIN_RUN, ROOT, TINY_MODEL
from tests.test_distributed import FP32_RTOL, assert_losses_close, launch_worker, losses
from tests.test_objectives_distributed import GRAD_NORM_RTOL

pytestmark = pytest.mark.slow  # multi-process: ~1 min on two cores

COMMON = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "kernels.fused_linear_cross_entropy=true",
    "training.device=cpu",
    "training.max_steps=4",
    "training.warmup_steps=1",
    "training.adam_eps=1e-6",
    "training.micro_batch_size=1",
    "objective.num_generations=4",
    "objective.num_iterations=2",
    "objective.beta=0.04",
    "objective.epsilon=0.01",  # the second update moves ratios past it: clipping takes part
    # A reward the random-init model meets about half the time: groups with variance, gradients.
    "objective.rewards=[{builtin: regex, pattern: '^\\s*[a-m]', name: format}]",
    "checkpoint.save_final=false",
]
ONE_PROCESS = [*COMMON, "training.gradient_accumulation_steps=2"]
TWO_RANKS = [*COMMON, "training.gradient_accumulation_steps=1"]
LORA = "lora={r: 4, alpha: 8}"
KEYS = ("loss", "grad_norm", "kl", "clip_fraction")
GENERATION_KEYS = ("reward_mean", "reward_format_mean", "advantage_std", "completion_length")


def _case(overrides: list[str], where: Path) -> dict:
    return {
        "recipe": str(ROOT / "recipes" / "quickstart-grpo.yaml"),
        "overrides": [*overrides, f"output_dir={where}"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from ligertune.training import train

    root = tmp_path_factory.mktemp("grpo")
    single = {"one": ONE_PROCESS, "lora-one": [*ONE_PROCESS, LORA]}
    for case, overrides in single.items():
        spec = _case(overrides, root / case)
        train(load_recipe(spec["recipe"], spec["overrides"]))
    launched = {
        f"{lora}{strategy}": [*TWO_RANKS, f"parallel.strategy={strategy}", *([LORA] if lora else [])]
        for strategy in ("ddp", "fsdp")
        for lora in ("", "lora-")
    }
    launch_worker([_case(o, root / case) for case, o in launched.items()], root, worker=__file__, timeout=600)
    return {case: root / case for case in [*single, *launched]}


def _report(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"generation-rank{rank}.json").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_match_one_process(strategy, lora, runs):
    got = runs[f"{'lora-' if lora else ''}{strategy}"]
    expected = runs["lora-one" if lora else "one"]
    for key in (*KEYS, *GENERATION_KEYS):
        read = losses if key in KEYS else _generated
        rtol = GRAD_NORM_RTOL if key == "grad_norm" else FP32_RTOL
        assert_losses_close(
            read(got, key=key), read(expected, key=key), rtol, f"{strategy} lora={lora} {key}", 1e-6
        )
    assert losses(expected, key="clip_fraction")[2] > 0  # the second update is off-policy: clipping happens


def _generated(run_dir: Path, key: str = "") -> dict[int, float]:
    """`key` of the steps that generated (1 and 3: two updates per generation batch)."""
    from tests.test_distributed import read_metrics

    return {r["step"]: r[key] for r in read_metrics(run_dir) if r["event"] == "train" and key in r}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp_gathers_the_weights_once_per_generation_batch(lora, runs):
    """Under FSDP2, while `_generate` runs: one all-gather per FSDP unit (2 layers and the root),
    for a generation of several tokens; under DDP none at all."""
    for rank in (0, 1):
        fsdp = _report(runs[f"{'lora-' if lora else ''}fsdp"], rank)
        assert fsdp["units"] == 3 and fsdp["gathers"] == [3, 3], fsdp
        assert min(fsdp["tokens"]) > 1  # more than one forward per generation: not one gather per token
        assert _report(runs[f"{'lora-' if lora else ''}ddp"], rank)["gathers"] == [0, 0]


# --------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------


def _work(spec: Path) -> None:
    """Train each case in one process group; write ``generation-rank<R>.json`` into its run
    directory: the FSDP units of the policy, and per generation batch the all-gathers issued and
    the tokens generated while `_generate` ran."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ligertune.distributed.runtime import leave_process_groups
    from ligertune.training.trainer import Trainer

    dist.init_process_group("gloo")
    gathers = [0]
    all_gather = dist.all_gather_single

    def counting(*args, **kwargs):
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    dist.all_gather_single = counting
    for case in json.loads(spec.read_text()):
        recipe = load_recipe(case["recipe"], case["overrides"])
        trainer, finished = Trainer(recipe), False
        report = {"gathers": [], "tokens": []}
        try:
            trainer.setup()
            objective = trainer.parts.objective
            generate = objective._generate

            def measured(window, generation, generate=generate, report=report):
                before = gathers[0]
                done = generate(window, generation)
                report["gathers"].append(gathers[0] - before)
                report["tokens"].append(max(completed.ids.shape[1] for *_, completed in done))
                return done

            objective._generate = measured
            report["units"] = sum(isinstance(m, FSDPModule) for m in trainer.parts.hf_model.modules())
            trainer.train()
            finished = True
        finally:
            trainer.cleanup(finished)
        (recipe.run_dir / f"generation-rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_groups(synchronised=True)


if __name__ == "__main__":
    _work(Path(sys.argv[1]))
