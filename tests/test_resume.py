"""Resuming with a changed recipe (what a resume applies, what it refuses and how it says so),
and the limits of ``training.on_nonfinite: skip``.

Runs use the 2-layer, hidden-64 Llama of tests/test_train.py, fp32 on CPU. Non-finite steps
come from the plugins below (the recipe's public extension point): a forward hook that turns
the training loss of chosen forwards into NaN, so the gradients are NaN and the loop must drop
them. One micro-batch per step, so forward n is the n-th step this process runs.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable

import pytest
import torch
import yaml

from ligertune.config import RecipeError, load_recipe
from ligertune.run.checkpoint import load_checkpoint
from ligertune.run.manifest import write_manifest
from ligertune.training import TrainingError, train
from ligertune.training.optim import lr_factor
from ligertune.training.resume import RESUME_RULES, WORLD_SIZE, recipe_changes
from ligertune.training.trainer import Trainer
from tests.helpers import QUICKSTART, ROOT
from tests.test_train import TINY, read_metrics, tiny_recipe

THIS = "tests.test_resume"
PREVIOUS_LAYOUT = ROOT / "tests" / "data" / "previous_layout"


def _nan_loss_on(forward: Callable[[int], bool]):
    def plugin(model, recipe) -> None:
        calls = 0

        def poison(module, args, kwargs, output):
            nonlocal calls
            if module.training:
                calls += 1
                if forward(calls):
                    output.loss = output.loss * float("nan")
            return output

        model.register_forward_hook(poison, with_kwargs=True)

    return plugin


nan_loss_from_forward_2 = _nan_loss_on(lambda n: n >= 2)
nan_loss_on_even_forwards = _nan_loss_on(lambda n: n % 2 == 0)


def _records(run_dir, event="train") -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if r["event"] == event}


# --------------------------------------------------------------------------------------------
# What a resume applies
# --------------------------------------------------------------------------------------------


def test_a_resume_applies_the_new_lr_schedule_and_optimizer_settings(tmp_path, capsys):
    first = ["training.max_steps=4", "training.lr=1e-3", "training.lr_schedule=cosine"]
    train(tiny_recipe(tmp_path, *first))
    changed = [
        "training.max_steps=8",
        "training.lr=5e-4",
        "training.lr_schedule=linear",
        "training.warmup_steps=1",
        "training.min_lr_ratio=0.1",
        "training.weight_decay=0.05",
        "training.adam_betas=[0.8, 0.9]",
        "training.adam_eps=1e-6",
    ]
    capsys.readouterr()
    trainer = Trainer(tiny_recipe(tmp_path, *changed))
    try:
        trainer.setup()
        assert trainer.state.step == 4
        groups = trainer.parts.optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
        assert all(tuple(g["betas"]) == (0.8, 0.9) and g["eps"] == 1e-6 for g in groups)
        assert all(g["initial_lr"] == 5e-4 for g in groups) and trainer.parts.scheduler.base_lrs == [
            5e-4,
            5e-4,
        ]
        trainer.train()
    finally:
        trainer.cleanup()

    log = capsys.readouterr().out
    assert "resume: training.lr 0.001 → 0.0005 (applied)" in log
    assert "resume: training.lr_schedule 'cosine' → 'linear' (applied)" in log
    assert "resume: training.max_steps 4 → 8 (applied)" in log
    assert "resume: training.adam_betas [0.9, 0.95] → [0.8, 0.9] (applied)" in log
    # Steps 5..8 follow the new schedule (new peak, warmup, shape and length) at the resumed step.
    records = _records(tmp_path)
    for step in range(5, 9):
        expected = 5e-4 * lr_factor(step - 1, warmup=1, total=8, schedule="linear", min_ratio=0.1)
        assert records[step]["lr"] == pytest.approx(expected, rel=1e-12), step


def test_a_nonfinite_stop_then_a_resume_with_a_lower_lr_replays_the_step_at_that_lr(tmp_path, capsys):
    common = ["training.max_steps=3", "training.warmup_steps=0", "training.lr_schedule=constant"]
    with pytest.raises(TrainingError, match=r"at step 2; stopped.*\(step 1\).*Lower training.lr"):
        train(tiny_recipe(tmp_path, *common, "training.lr=1e-3", f"plugins=[{THIS}:nan_loss_from_forward_2]"))
    capsys.readouterr()
    resumed = train(tiny_recipe(tmp_path, *common, "training.lr=2e-4"))
    assert resumed.steps == 3
    log = capsys.readouterr().out
    assert "resume: training.lr 0.001 → 0.0002 (applied)" in log
    assert f"resume: plugins ['{THIS}:nan_loss_from_forward_2'] → [] (applied)" in log
    records = _records(tmp_path)
    assert records[1]["lr"] == 1e-3
    assert [records[s]["lr"] for s in (2, 3)] == [2e-4, 2e-4]  # step 2 replayed, at the new lr
    assert all(math.isfinite(records[s]["loss"]) for s in (2, 3))


# --------------------------------------------------------------------------------------------
# What a resume refuses
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "model.config_overrides={hidden_size: 32, intermediate_size: 128, num_hidden_layers: 2, "
            "num_attention_heads: 4, num_key_value_heads: 2}",
            "model.config_overrides.hidden_size: 64 → 32 since the checkpoint was saved; a resume cannot "
            "change it: the checkpoint holds the weights of the saved model",
        ),
        ("seed=7", "seed: 42 → 7 since the checkpoint was saved; a resume cannot change it: the data order"),
        ("data.max_samples=30", "data.max_samples: null → 30 since the checkpoint was saved"),
        (
            "training.micro_batch_size=1",
            "training.micro_batch_size: 2 → 1 since the checkpoint was saved; a resume cannot change it: "
            "micro_batch_size × world size goes from 2 to 1 rows",
        ),
    ],
    ids=["model-shape", "seed", "data", "micro-batch"],
)
def test_a_resume_refuses_what_the_checkpoint_cannot_honour_before_any_step(tmp_path, override, line):
    train(tiny_recipe(tmp_path, "training.max_steps=2"))
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RecipeError) as refused:
        train(tiny_recipe(tmp_path, "training.max_steps=4", override))
    assert refused.value.source == f"resuming {tmp_path / 'checkpoints' / 'step-2'}"
    assert any(problem.startswith(line) for problem in refused.value.problems), refused.value.problems
    assert all("→" in problem for problem in refused.value.problems)  # one line per changed key
    # Refused before any step: nothing trained, nothing saved.
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]


def test_the_cli_refuses_a_changed_model_with_status_2(tmp_path):
    from typer.testing import CliRunner

    from ligertune.cli import app

    # The run's own recipe file, as the checkpoint saved it: a resume from another file would be
    # refused before the model is compared (test_a_copied_recipe_does_not_take_over_a_finished_run).
    train(tiny_recipe(tmp_path, "training.max_steps=1"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((tmp_path / "checkpoints" / "step-1" / "recipe.yaml").read_text())
    result = CliRunner().invoke(
        app,
        ["train", str(recipe), "training.max_steps=2", "model.config_overrides.num_hidden_layers=3"]
        + ["checkpoint.resume=" + str(tmp_path / "checkpoints" / "step-1")],
    )
    assert result.exit_code == 2, result.output
    assert "model.config_overrides.num_hidden_layers: 2 → 3 since the checkpoint was saved" in result.output


def test_a_copied_recipe_does_not_take_over_a_finished_run(tmp_path):
    """Two recipe files naming the same run (a copy that kept ``name``): the second one's
    `train` refuses to resume the first one's finished run, with status 2, and writes nothing;
    the first file itself still continues its run (train longer)."""
    from typer.testing import CliRunner

    from ligertune.cli import app

    first, copy = tmp_path / "first.yaml", tmp_path / "copy.yaml"
    first.write_text(QUICKSTART.read_text())
    copy.write_text(QUICKSTART.read_text())
    run = tmp_path / "runs" / "quickstart"
    common = [*TINY, f"output_dir={run}", "checkpoint.export_hf=true"]
    runner = CliRunner()
    assert runner.invoke(app, ["train", str(first), *common, "training.max_steps=2"]).exit_code == 0
    exported = (run / "final" / "model.safetensors").read_bytes()
    metrics = (run / "metrics.jsonl").read_text()

    refused = runner.invoke(app, ["train", str(copy), *common, "training.max_steps=4", "training.lr=1e-4"])
    assert refused.exit_code == 2, refused.output
    assert (
        f"checkpoint.resume: auto would continue the finished run in {run} (step 2 of 2, started by {first})"
        in (refused.output)
    )
    assert "name: copy" in refused.output
    assert (run / "final" / "model.safetensors").read_bytes() == exported
    assert (run / "metrics.jsonl").read_text() == metrics
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]

    longer = runner.invoke(app, ["train", str(first), *common, "training.max_steps=3"])
    assert longer.exit_code == 0, longer.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-3"]


def test_an_unfinished_run_continues_from_a_fresh_copy_of_its_recipe(tmp_path):
    """A preempted job resubmitted from another copy of its recipe (a scheduler's job folder)
    resumes, and the log says which file started the run."""
    first, resubmitted = tmp_path / "job-1.yaml", tmp_path / "job-2.yaml"
    for path in (first, resubmitted):
        path.write_text(QUICKSTART.read_text())
    overrides = [*TINY, f"output_dir={tmp_path / 'run'}", "training.max_steps=4"]
    train(load_recipe(first, overrides), on_step_end=lambda record: record.step == 2)
    trainer = Trainer(load_recipe(resubmitted, overrides))
    try:
        trainer.setup()
        assert trainer.state.step == 2
    finally:
        trainer.cleanup()
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"was started by {first}; continuing it from {resubmitted}" in log


def widen_the_final_norm(model, recipe) -> None:
    """A plugin that changes a parameter's shape: its forward would fail, the resume must not get there."""
    model.model.norm.weight = torch.nn.Parameter(torch.ones(2 * model.config.hidden_size))


def test_a_state_dict_that_does_not_fit_is_one_line_not_a_traceback(tmp_path):
    """Plugins may change on a resume (they usually patch, numerically equivalent); one that
    changes a parameter's shape gets past the recipe comparison, and the load itself must say
    what does not fit."""
    train(tiny_recipe(tmp_path, "training.max_steps=1"))
    with pytest.raises(RecipeError) as refused:
        train(tiny_recipe(tmp_path, "training.max_steps=2", f"plugins=[{THIS}:widen_the_final_norm]"))
    (problem,) = refused.value.problems
    assert problem.startswith(f"checkpoint.resume: {tmp_path / 'checkpoints' / 'step-1'} does not fit")
    assert (
        "(size mismatch for model.norm.weight: copying a param with shape torch.Size([64]) from checkpoint, "
        "the shape in current model is torch.Size([128]).)" in problem
    )
    assert "\n" not in problem


def _flat_recipe(*overrides: str):
    return load_recipe(QUICKSTART, list(overrides))


def _changes(saved, current, *, saved_world_size=1, world_size=1, saved_format="full", current_format="full"):
    from ligertune.config import recipe_to_yaml

    return recipe_changes(
        recipe_to_yaml(saved),
        current,
        saved_world_size=saved_world_size,
        world_size=world_size,
        saved_format=saved_format,
        current_format=current_format,
    )


def test_the_resume_table_decides_precision_strategy_world_size_and_kernels():
    base = _flat_recipe("training.micro_batch_size=2")
    assert _changes(base, base) == ([], [])

    applied, refused = _changes(base, _flat_recipe("training.micro_batch_size=2", "kernels=none"))
    assert not refused and "resume: kernels.rms_norm True → False (applied)" in applied

    _, refused = _changes(base, _flat_recipe("training.micro_batch_size=2", "training.precision=bf16-mixed"))
    assert refused[0].startswith("training.precision: 'fp32' → 'bf16-mixed'") and "precision" in refused[0]

    # none and ddp read the same ("full") checkpoints; fsdp reads "dcp" ones.
    ddp = _flat_recipe("training.micro_batch_size=2", "parallel.strategy=ddp")
    assert _changes(base, ddp)[1] == []
    fsdp = _flat_recipe("training.micro_batch_size=2", "parallel.strategy=fsdp")
    (line,) = _changes(base, fsdp, current_format="dcp")[1]
    assert line.startswith("parallel.strategy: 'none' → 'fsdp'") and "'full' format" in line

    # Another world size: only with micro_batch_size × world size unchanged, and not for ZeRO.
    half = _flat_recipe("training.micro_batch_size=1", "parallel.strategy=ddp")
    applied, refused = _changes(ddp, half, saved_world_size=1, world_size=2)
    assert not refused and f"resume: {WORLD_SIZE} 1 → 2 (applied)" in applied
    _, refused = _changes(ddp, ddp, saved_world_size=1, world_size=2)
    assert refused == [
        f"{WORLD_SIZE}: 1 → 2 since the checkpoint was saved; a resume cannot change it: micro_batch_size × "
        "world size goes from 2 to 4 rows, so the saved data position would name other batches (keep the "
        "product: e.g. twice the micro-batch on half the processes). Set it back, or start over with "
        "checkpoint.resume=none or another output_dir"
    ]
    # A LoRA run saved while auto resolved to false with lora resumes now that it shards.
    lora = ("training.micro_batch_size=2", "parallel.strategy=fsdp", "lora.r=4")
    saved = _flat_recipe(*lora, "parallel.sharded_init=false")
    applied, refused = _changes(saved, _flat_recipe(*lora), saved_format="dcp", current_format="dcp")
    assert not refused and "resume: parallel.sharded_init False → 'auto' (applied)" in applied

    zero = _flat_recipe(
        "training.micro_batch_size=2", "parallel.strategy=deepspeed", "training.precision=fp32"
    )
    zero_half = _flat_recipe("training.micro_batch_size=1", "parallel.strategy=deepspeed")
    fmt = dict(saved_format="deepspeed", current_format="deepspeed", saved_world_size=1, world_size=2)
    refused = _changes(zero, zero_half, **fmt)[1]
    assert refused and all("one partition per rank" in line for line in refused)


def test_every_resume_rule_names_a_recipe_key():
    from pydantic import BaseModel

    from ligertune.config import Recipe

    def models(annotation) -> list[type[BaseModel]]:
        """The models a field holds: itself, or every member of a union (the chosen sections)."""
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        members = typing.get_args(annotation) or (annotation,)
        return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]

    def exists(dotted: str, model: type[BaseModel] = Recipe) -> bool:
        part, _, rest = dotted.partition(".")
        if part not in model.model_fields:
            return False
        return not rest or any(exists(rest, m) for m in models(model.model_fields[part].annotation))

    unknown = [key for key in RESUME_RULES if key not in ("", WORLD_SIZE) and not exists(key)]
    assert unknown == []


# --------------------------------------------------------------------------------------------
# Limits of on_nonfinite: skip
# --------------------------------------------------------------------------------------------


def test_skipping_stops_after_too_many_steps_in_a_row(tmp_path):
    recipe = tiny_recipe(
        tmp_path,
        "training.max_steps=8",
        "training.on_nonfinite=skip",
        "checkpoint.export_hf=true",
        f"plugins=[{THIS}:nan_loss_from_forward_2]",
    )
    with pytest.raises(TrainingError) as stopped:
        train(recipe)
    message = str(stopped.value)
    assert message.startswith(
        "non-finite loss nan and grad norm nan at step 5: 4 steps skipped in a row (4 in the run, 4 in a row), "
        "more than training.max_consecutive_skipped_steps=3; stopped. The last good state (step 4) is saved in "
        f"{tmp_path / 'checkpoints' / 'step-4'}."
    )
    assert "raise training.max_consecutive_skipped_steps" in message
    assert not (tmp_path / "final").exists()  # no export of a model that stopped learning
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "step-4")
    assert checkpoint.state["skipped_steps"] == 3 and checkpoint.scheduler["last_epoch"] == 4
    assert all(torch.isfinite(t).all() for t in checkpoint.model.values())
    assert [r["skipped_steps"] for r in _records(tmp_path).values()] == [0, 1, 2, 3]


def test_the_skip_total_counts_across_a_resume(tmp_path):
    """Skips at steps 2 (first process), then 5 and 7 (the resumed one: its even forwards):
    the third is over max_skipped_steps=2, though this process skipped only two."""
    common = [
        "training.max_steps=8",
        "training.on_nonfinite=skip",
        "training.max_skipped_steps=2",
        f"plugins=[{THIS}:nan_loss_on_even_forwards]",
    ]
    first = train(tiny_recipe(tmp_path, *common), on_step_end=lambda record: record.step == 3)
    assert first.steps == 3 and load_checkpoint(first.checkpoint).state["skipped_steps"] == 1
    with pytest.raises(
        TrainingError,
        match=r"^non-finite .* at step 7: 3 steps skipped in the run \(3 in the run, 1 in a row\), more than training.max_skipped_steps=2; stopped\. The last good state \(step 6\)",
    ):
        train(tiny_recipe(tmp_path, *common))
    records = _records(tmp_path)
    assert [records[s]["skipped_steps"] for s in range(1, 7)] == [0, 1, 1, 1, 2, 2]
    assert load_checkpoint(tmp_path / "checkpoints" / "step-6").state["skipped_steps"] == 2


def test_no_skip_limit_lets_every_step_be_skipped(tmp_path):
    recipe = tiny_recipe(
        tmp_path,
        "training.max_steps=6",
        "training.on_nonfinite=skip",
        "training.max_skipped_steps=null",
        "training.max_consecutive_skipped_steps=null",
        f"plugins=[{THIS}:nan_loss_from_forward_2]",
    )
    assert train(recipe).steps == 6
    assert _records(tmp_path)[6]["skipped_steps"] == 5


def test_a_checkpoint_of_the_previous_layout_resumes(tmp_path):
    """A checkpoint whose recipe.yaml the previous layout wrote (every objective's and every
    strategy's options, at the values that had no effect) resumes as if it had been written now:
    no key counts as changed."""
    train(tiny_recipe(tmp_path, "training.max_steps=2", "checkpoint.every_steps=2"))
    checkpoint = tmp_path / "checkpoints" / "step-2"
    saved = yaml.safe_load((checkpoint / "recipe.yaml").read_text())
    previous = yaml.safe_load((PREVIOUS_LAYOUT / "quickstart.yaml").read_text())
    saved["objective"] = previous["objective"]  # all fourteen keys of the old objective section
    saved["parallel"] = {**previous["parallel"], "strategy": saved["parallel"]["strategy"]}
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    write_manifest(checkpoint)  # the edit is ours, not damage
    trainer = Trainer(tiny_recipe(tmp_path, "training.max_steps=4", "checkpoint.every_steps=2"))
    try:
        trainer.setup()
        assert trainer.state.step == 2 and trainer.state.last_saved == checkpoint
        assert trainer.train().steps == 4
    finally:
        trainer.cleanup()
