"""The training loop: accumulation, schedules, optimizer groups, resume, NaN handling, signals,
export, metrics, and the quickstart through the CLI.

Runs use a 2-layer, hidden-64 Llama on the bundled sample at 64 tokens per row, fp32 on CPU.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ligertune.config import RecipeError, load_recipe, recipe_to_yaml
from ligertune.data.formats import IGNORE_INDEX
from ligertune.distributed import Runtime, create_runtime
from ligertune.models.build import build_config, build_model
from ligertune.objectives.causal_lm import CausalLM
from ligertune.run.checkpoint import load_checkpoint
from ligertune.training import TrainingError, train
from ligertune.training.optim import autocast_for, build_optimizer, build_scheduler
from ligertune.training.resume import recipe_changes
from ligertune.training.step import forward_backward
from ligertune.training.transforms import apply_transforms
from tests.helpers import PLAIN_RUN, QUICKSTART, ROOT, TINY_MODEL, tiny_llama

TINY = [
    *TINY_MODEL,
    *PLAIN_RUN,
    "data.validation_fraction=0.0",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=1",
    "training.warmup_steps=2",
    "training.eval_every=null",
]


def tiny_recipe(output_dir: Path, *overrides: str):
    return load_recipe(QUICKSTART, TINY + [f"output_dir={output_dir}", *overrides])


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["event"] == "train"}


# --------------------------------------------------------------------------------------------
# Gradient accumulation
# --------------------------------------------------------------------------------------------


def _packed_rows(generator: torch.Generator, vocab: int, seq: int) -> dict[str, torch.Tensor]:
    """Four packed rows whose label counts differ a lot (prompt spans masked with -100), as
    the data pipeline makes them: position ids restart at each sample."""
    segments = [[seq], [20, 12, seq - 32], [7, seq - 7], [5, 9, 11, seq - 25]]
    masked_prefix = [seq - 6, 3, 6, 2]  # row 0 trains on 5 tokens, row 1 on nearly all
    input_ids = torch.randint(0, vocab, (4, seq), generator=generator)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in segments])
    labels = input_ids.clone()
    for r, prefix in enumerate(masked_prefix):
        labels[r, :prefix] = IGNORE_INDEX
    labels[position_ids == 0] = IGNORE_INDEX  # nothing predicts a sample's first token
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Σ CE over every label token of the batch / their number, in float64, from the logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.double()
    targets = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return (ce / (targets != IGNORE_INDEX).sum()).item()


def test_accumulation_4x1_equals_1x4_with_unequal_label_counts():
    torch.manual_seed(0)
    model_a = tiny_llama(vocab_size=512, hidden_size=64, intermediate_size=128, attention_bias=True).float()
    model_a.config.use_cache = False  # as build_model sets it: needed for packed attention
    model_b = copy.deepcopy(model_a)
    batch = _packed_rows(torch.Generator().manual_seed(1), 512, 48)
    rows = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(4)]
    runtime = Runtime(torch.device("cpu"))
    no_autocast = lambda: autocast_for("fp32", runtime.device)

    one = forward_backward(model_a, CausalLM(), [batch], runtime, no_autocast)
    four = forward_backward(model_b, CausalLM(), rows, runtime, no_autocast)

    counts = [int((r["labels"][:, 1:] != IGNORE_INDEX).sum()) for r in rows]
    assert int(one.label_tokens) == int(four.label_tokens) == sum(counts)
    assert int(one.tokens) == int(four.tokens) == 4 * 48
    expected = _reference_loss(model_a, batch)
    assert float(one.loss) == pytest.approx(expected, rel=1e-6)
    assert float(four.loss) == pytest.approx(expected, rel=1e-6)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None, name
        error = (pa.grad - pb.grad).norm() / pa.grad.norm()
        assert error < 1e-6, f"{name}: relative gradient difference {error:.2e}"
    # The check has teeth: the naive accumulation (mean of per-micro-batch means) fails it.
    naive = sum(_reference_loss(model_a, r) for r in rows) / 4
    assert abs(naive - expected) / expected > 1e-4
    model_c = copy.deepcopy(model_b)
    model_c.zero_grad()
    for row in rows:
        (model_c(**row).loss / 4).backward()
    worst = max(
        (pa.grad - pc.grad).norm() / pa.grad.norm()
        for pa, pc in zip(model_a.parameters(), model_c.parameters(), strict=True)
    )
    assert worst > 1e-2


def test_accumulation_in_the_loop_gives_the_same_run(tmp_path):
    """bs 4 × ga 1 and bs 1 × ga 4 see the same rows each step (the loader cuts one shuffled
    stream into micro-batches), so the whole run must match."""
    a = train(tiny_recipe(tmp_path / "a", "training.max_steps=4", "training.micro_batch_size=4"))
    b = train(
        tiny_recipe(
            tmp_path / "b",
            "training.max_steps=4",
            "training.micro_batch_size=1",
            "training.gradient_accumulation_steps=4",
        )
    )
    la, lb = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert la[1] == pytest.approx(lb[1], rel=1e-6)  # the same weights: only summation order differs
    for step in (2, 3, 4):  # after Adam updates, rounding differences grow a little
        assert la[step] == pytest.approx(lb[step], rel=1e-5)
    # Adam divides by √v, so a gradient element at rounding level can still move its weight by
    # a fraction of lr: compare whole tensors, not elements.
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert (pa - pb).norm() / pa.norm() < 1e-5, name


# --------------------------------------------------------------------------------------------
# Optimizer and schedules
# --------------------------------------------------------------------------------------------


def _lrs(schedule: str, warmup: int, total: int, min_ratio: float) -> list[float]:
    recipe = load_recipe(
        QUICKSTART,
        [
            f"training.lr_schedule={schedule}",
            f"training.warmup_steps={warmup}",
            f"training.min_lr_ratio={min_ratio}",
            "training.lr=2.0",
        ],
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=recipe.training.lr)
    scheduler = build_scheduler(optimizer, recipe.training, total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])  # the lr optimizer step s runs with
        optimizer.step()
        scheduler.step()
    return lrs


def test_cosine_schedule_with_warmup():
    lrs = _lrs("cosine", warmup=4, total=12, min_ratio=0.1)
    # Warmup 2·s/4; then p = (s − 5)/8 for s = 5..12, so cos πp runs over cos(kπ/8), k = 0..7
    # = 1, .92388, .70711, .38268, 0, −.38268, −.70711, −.92388; lr = 2·(0.1 + 0.9·(1 + cos πp)/2).
    expected = [0.5, 1.0, 1.5, 2.0, 2.0, 1.93149, 1.73640, 1.44441, 1.1, 0.75559, 0.46360, 0.26851]
    assert lrs == pytest.approx(expected, abs=1e-4)


def test_linear_and_constant_schedules():
    # Linear: p = (s − 3)/8 for s = 3..10, lr = 2·(1 − p) with min_ratio 0.
    assert _lrs("linear", warmup=2, total=10, min_ratio=0.0) == pytest.approx(
        [1.0, 2.0, 2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, 0.25]
    )
    assert _lrs("constant", warmup=3, total=6, min_ratio=0.5) == pytest.approx(
        [2 / 3, 4 / 3, 2.0, 2.0, 2.0, 2.0]
    )
    # No warmup: the first step runs at the peak.
    assert _lrs("cosine", warmup=0, total=4, min_ratio=0.0)[0] == pytest.approx(2.0)


def test_weight_decay_skips_norms_and_biases():
    model = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=48, attention_bias=True)
    recipe = load_recipe(QUICKSTART, ["training.weight_decay=0.1"])
    optimizer = build_optimizer(model, recipe.training, torch.device("cpu"))
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(decay_of) == len(names)  # every parameter exactly once
    for name, p in names.items():
        no_decay = "norm" in name or name.endswith(".bias")
        assert decay_of[id(p)] == (0.0 if no_decay else 0.1), name
    assert any(name.endswith(".bias") for name in names) and any("norm" in name for name in names)


# --------------------------------------------------------------------------------------------
# Model building and recipe checks
# --------------------------------------------------------------------------------------------


def test_config_overrides_rebuild_derived_fields_and_reject_typos():
    recipe = load_recipe(QUICKSTART, ["model.config_overrides={hidden_size: 96, num_attention_heads: 3}"])
    config = build_config(recipe)
    assert config.hidden_size == 96 and config.head_dim == 32  # derived from the overridden fields
    with pytest.raises(RecipeError, match="num_hidden_layer .did you mean num_hidden_layers"):
        build_config(load_recipe(QUICKSTART, ["model.config_overrides={num_hidden_layer: 2}"]))


def test_built_model_keeps_packed_samples_apart():
    """A packed row of two samples scores each token as if the samples were separate rows."""
    recipe = load_recipe(QUICKSTART, TINY)
    model = build_model(recipe, torch.device("cpu")).train()
    generator = torch.Generator().manual_seed(5)
    first, second = (
        torch.randint(0, 2048, (1, 23), generator=generator),
        torch.randint(0, 2048, (1, 41), generator=generator),
    )
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(23), torch.arange(41)]).unsqueeze(0)
    labels = packed.clone()
    labels[0, 23] = IGNORE_INDEX  # the boundary: nothing in the first sample predicts the second
    one = torch.ones((), dtype=torch.int64)  # num_items_in_batch=1: the summed token loss
    with torch.no_grad():
        together = model(input_ids=packed, labels=labels, position_ids=positions, num_items_in_batch=one).loss
        apart = sum(model(input_ids=x, labels=x, num_items_in_batch=one).loss for x in (first, second))
    assert together.item() == pytest.approx(apart.item(), rel=1e-5)


def _save_random_init(tmp_path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Path]:
    """The tiny recipe's random init (seed 7), saved in `dtype` as a HF safetensors directory."""
    source = load_recipe(QUICKSTART, TINY + ["seed=7", f"output_dir={tmp_path / 'source'}"])
    model = build_model(source, torch.device("cpu"))
    model.to(dtype).save_pretrained(tmp_path / "weights")
    return model, tmp_path / "weights"


def _fine_tune_recipe(weights: Path, *overrides: str):
    # TINY minus its config overrides: the architecture comes from the saved config.json.
    return load_recipe(
        QUICKSTART,
        [*TINY[1:], "seed=7", "model.config=null", f"model.name_or_path={weights}", *overrides],
    )


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.bfloat16])
def test_fine_tuning_loads_saved_weights_in_the_parameter_dtype(tmp_path, saved_dtype):
    """`model.name_or_path` (the fine-tuning path) loads a local safetensors directory into
    parameters of the precision's dtype (fp32 here), value for value."""
    original, weights = _save_random_init(tmp_path, saved_dtype)
    loaded = build_model(_fine_tune_recipe(weights), torch.device("cpu"))
    expected = {k: v.to(saved_dtype).float() for k, v in original.state_dict().items()}
    assert {k: v.dtype for k, v in loaded.state_dict().items()} == {k: torch.float32 for k in expected}
    torch.testing.assert_close(loaded.state_dict(), expected, rtol=0, atol=0)


def test_fine_tuning_saved_weights_trains_like_the_model_they_came_from(tmp_path):
    """A run from saved fp32 weights gives, step by step, the losses of the run that trains
    the same seed's random init directly (same data order, same schedule)."""
    _, weights = _save_random_init(tmp_path, torch.float32)
    train(_fine_tune_recipe(weights, "training.max_steps=3", f"output_dir={tmp_path / 'tuned'}"))
    train(tiny_recipe(tmp_path / "direct", "seed=7", "training.max_steps=3"))
    tuned, direct = train_losses(tmp_path / "tuned"), train_losses(tmp_path / "direct")
    assert len(tuned) == 3
    assert tuned == pytest.approx(direct, rel=1e-6)


def test_bad_setups_fail_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match="training.precision=fp32"):
        train(tiny_recipe(tmp_path, "training.precision=bf16", "training.device=cpu"))
    with pytest.raises(RecipeError, match="multi-process CPU runs \\(gloo\\) need fp32"):
        tiny_recipe(tmp_path, "parallel.strategy=ddp", "training.precision=bf16-mixed", "training.device=cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="launched as one of 2"):
        create_runtime(tiny_recipe(tmp_path))


def test_activation_checkpointing_keeps_gradients():
    recipe = load_recipe(QUICKSTART, TINY + ["training.activation_checkpointing=true"])
    torch.manual_seed(0)
    plain = tiny_llama(vocab_size=256, hidden_size=32, intermediate_size=48)
    plain.config.use_cache = False
    checkpointed = copy.deepcopy(plain)
    apply_transforms(checkpointed, recipe)
    assert checkpointed.is_gradient_checkpointing
    batch = _packed_rows(torch.Generator().manual_seed(3), 256, 32)
    runtime = Runtime(torch.device("cpu"))
    no_autocast = lambda: autocast_for("fp32", runtime.device)
    plain.train()
    forward_backward(plain, CausalLM(), [batch], runtime, no_autocast)
    forward_backward(checkpointed, CausalLM(), [batch], runtime, no_autocast)
    for pa, pb in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# Runs: resume, non-finite losses, export and metrics
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    """20 steps straight vs 10 steps, stop, resume for 10: identical losses at steps 11..20.
    GA 2 over a small sample, so windows and resumes cross epoch boundaries."""
    common = ["training.max_steps=20", "training.gradient_accumulation_steps=2", "data.max_samples=40"]
    straight = tmp_path / "straight"
    train(tiny_recipe(straight, *common))

    split = tmp_path / "split"
    first = train(tiny_recipe(split, *common), on_step_end=lambda record: record.step == 10)
    assert first.steps == 10 and first.checkpoint == split / "checkpoints" / "step-10"
    # Leftovers of a crashed save must be ignored by resume auto.
    (split / "checkpoints" / ".tmp-step-15").mkdir()
    (split / "checkpoints" / "step-12").mkdir()
    second = train(tiny_recipe(split, *common))
    assert second.steps == 20

    expected, got = train_losses(straight), train_losses(split)
    assert sorted(got) == list(range(1, 21))  # the resumed run appended steps 11..20
    for step in range(11, 21):
        assert got[step] == expected[step], f"step {step}: {got[step]} != {expected[step]}"
    epochs = {r["step"]: r["epoch"] for r in read_metrics(straight) if r["event"] == "train"}
    assert epochs[20] > 1.0  # the data really wrapped around


def test_resume_choices(tmp_path):
    first = train(tiny_recipe(tmp_path, "training.max_steps=2"))
    assert first.checkpoint == tmp_path / "checkpoints" / "step-2"
    # none: start over (the run redoes steps 1..2); an explicit path must be complete.
    again = train(tiny_recipe(tmp_path, "training.max_steps=2", "checkpoint.resume=none"))
    assert again.steps == 2 and again.final_loss == first.final_loss
    broken = tmp_path / "checkpoints" / "step-9"
    broken.mkdir()
    with pytest.raises(RecipeError, match="checkpoint.resume: .*incomplete"):
        train(tiny_recipe(tmp_path, "training.max_steps=2", f"checkpoint.resume={broken}"))


def test_save_final_false_leaves_no_checkpoint_but_a_signal_still_saves(tmp_path):
    run = train(tiny_recipe(tmp_path / "a", "training.max_steps=3", "checkpoint.save_final=false"))
    assert run.checkpoint is None
    assert not list((tmp_path / "a").glob("checkpoints/step-*"))
    stopped = train(
        tiny_recipe(tmp_path / "b", "training.max_steps=3", "checkpoint.save_final=false"),
        on_step_end=lambda record: record.step == 2,
    )
    assert stopped.steps == 2 and stopped.checkpoint is None, "a hook stop is not a preemption: no save"


def test_resume_refuses_when_the_data_order_changed():
    """A changed data order used to be a warning; the saved position would name other batches,
    so a resume now refuses it, one line per key."""
    saved = load_recipe(QUICKSTART, ["seed=1", "training.micro_batch_size=2"])

    def changes(*overrides):
        current = load_recipe(QUICKSTART, list(overrides))
        return recipe_changes(
            recipe_to_yaml(saved),
            current,
            saved_world_size=1,
            world_size=1,
            saved_format="full",
            current_format="full",
        )

    assert changes("seed=1", "training.micro_batch_size=2") == ([], [])
    applied, refused = changes("seed=2", "training.micro_batch_size=4", "data.shuffle=false")
    assert applied == []
    assert [line.split(" since ")[0] for line in refused] == [
        "seed: 1 → 2",
        "data.shuffle: True → False",
        "training.micro_batch_size: 2 → 4",
    ]
    assert "the data order depends on it" in refused[0]
    assert "micro_batch_size × world size goes from 2 to 4 rows" in refused[2]


# Step 1 is finite, every later one has a NaN loss (a plugin: see tests/test_resume.py).
NAN_FROM_STEP_2 = "plugins=[tests.test_resume:nan_loss_from_forward_2]"


def test_nonfinite_loss_stops_with_the_step_and_a_checkpoint(tmp_path):
    recipe = tiny_recipe(tmp_path, "training.max_steps=5", NAN_FROM_STEP_2, "training.warmup_steps=0")
    with pytest.raises(
        TrainingError, match=r"non-finite .* at step 2; stopped.*\(step 1\) is saved in .*step-1"
    ):
        train(recipe)
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / "step-1")
    assert checkpoint.step == 1
    assert all(torch.isfinite(t).all() for t in checkpoint.model.values())  # the last *good* state
    assert checkpoint.scheduler["last_epoch"] == 1


def test_nonfinite_skip_mode_skips_and_finishes(tmp_path):
    recipe = tiny_recipe(
        tmp_path,
        "training.max_steps=4",
        NAN_FROM_STEP_2,
        "training.warmup_steps=0",
        "training.on_nonfinite=skip",
    )
    result = train(recipe)
    assert result.steps == 4
    records = [r for r in read_metrics(tmp_path) if r["event"] == "train"]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2, 3]
    assert records[0]["loss"] is not None and all(r["loss"] is None for r in records[1:])
    assert result.final_loss == records[0]["loss"]


def test_export_round_trip_and_metrics_file(tmp_path):
    recipe = tiny_recipe(
        tmp_path,
        "training.max_steps=6",
        "logging.log_every=2",
        "checkpoint.export_hf=true",
        "data.validation_fraction=0.1",
        "training.eval_every=3",
        "checkpoint.every_steps=4",
    )
    result = train(recipe)
    assert result.export_dir == tmp_path / "final"
    assert (tmp_path / "final" / "model.safetensors").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "final")
    trained = result.model.eval()
    ids = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=0)
    assert loaded.config.use_cache  # inference gets its KV cache back

    records = read_metrics(tmp_path)
    events = [r["event"] for r in records]
    assert events[0] == "start" and events[-1] == "summary"
    assert records[0]["kernels_patched"] == {}, "kernels: none patches nothing"
    train_records = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train_records] == [2, 4, 6]
    fields = {
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "label_tokens_per_s",
        "tokens_per_s_per_gpu",
        "label_tokens_per_s_per_gpu",
        "mfu",
        "peak_mem_allocated_gib",
        "peak_mem_reserved_gib",
        "epoch",
    }
    for r in train_records:
        assert fields <= set(r), fields - set(r)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["mfu"] is None and r["peak_mem_allocated_gib"] is None  # n/a on CPU
    # Step 1-2 are the throughput warm-up: the first window reports n/a, later ones a rate.
    assert train_records[0]["tokens_per_s"] is None
    assert train_records[1]["tokens_per_s"] > 0 and train_records[1]["label_tokens_per_s"] > 0
    assert train_records[1]["tokens_per_s"] > train_records[1]["label_tokens_per_s"]
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval_label_tokens"] > 0 for r in evals)
    assert evals[-1]["eval_ppl"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    summary = records[-1]
    assert summary["steps"] == 6 and summary["final_loss"] == result.final_loss
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4", "step-6"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_step_lets_the_step_finish_then_saves_and_stops(tmp_path, monkeypatch, signum):
    import ligertune.training.trainer as loop

    real = loop.forward_backward
    calls = []

    def signal_during_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signum)  # arrives after step 3 started, before its forward
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "forward_backward", signal_during_step_3)
    result = train(tiny_recipe(tmp_path, "training.max_steps=50", "checkpoint.export_hf=true"))
    assert result.signal == signum and result.steps == 3
    assert sorted(train_losses(tmp_path)) == [1, 2, 3]  # step 3 ran to the end and was logged
    saved = load_checkpoint(tmp_path / "checkpoints" / "step-3").state
    assert (saved["epoch"], saved["batch_index"]) == (0, 3)  # the next micro-batch to train on
    assert result.export_dir is None and not (tmp_path / "final").exists()  # unfinished: no export
    assert signal.getsignal(signum) is not None  # handlers restored (pytest's own are back)


# --------------------------------------------------------------------------------------------
# Through the CLI, in subprocesses
# --------------------------------------------------------------------------------------------


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    # Without TRITON_INTERPRET, kernels on CPU run their PyTorch references: the interpreter
    # would take minutes per step at the quickstart's shapes (the kernel tests cover Triton).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen(
        [sys.executable, "-m", "ligertune", "train", *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **kwargs,
    )


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path):
    proc = _cli(str(QUICKSTART), *TINY, f"output_dir={tmp_path}", "training.max_steps=100000")
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count('"event": "train"') >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "received SIGTERM" in output
    last_logged = max(r["step"] for r in read_metrics(tmp_path) if r["event"] == "train")
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    assert load_checkpoint(checkpoint).step == last_logged  # the last step that ran is the one saved
    assert not (tmp_path / "final").exists()  # not finished: no export


@pytest.mark.slow
def test_quickstart_runs_from_the_cli(tmp_path):
    proc = _cli(str(QUICKSTART), "training.max_steps=4", "training.eval_every=2", f"output_dir={tmp_path}")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "step 4/4" in output and "run summary" in output
    # The quickstart's attention is auto; on a CPU that is SDPA, with our packed-row mask.
    assert "attention: sdpa (auto: CPU); packed rows: sdpa with a document mask" in output
    assert (tmp_path / "final" / "config.json").is_file() and (tmp_path / "checkpoints" / "step-4").is_dir()
    records = read_metrics(tmp_path)
    assert records[-1]["event"] == "summary" and records[-1]["steps"] == 4
    # The quickstart's tiny Llama (2 layers): 2 × 2 layer norms + the final norm, one attention
    # and one MLP per layer, one lm_head.
    assert records[0]["kernels_patched"] == {
        "rms_norm": 5,
        "rope": 2,
        "swiglu": 2,
        "fused_linear_cross_entropy": 1,
    }


def test_the_cli_labels_window_means_and_the_last_step_and_writes_snake_case_keys(tmp_path):
    """Step lines show the mean of the window's step losses, the summary the last step's loss:
    each says which. Every key metrics.jsonl writes is snake_case (the summary had spaces)."""
    from typer.testing import CliRunner

    from ligertune.cli import app

    args = ["train", str(QUICKSTART), *TINY, "training.max_steps=4", "logging.log_every=2"]
    result = CliRunner().invoke(app, [*args, f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert re.search(r"step 2/4 \| loss \d+\.\d{4} \(mean of 2 steps\) \|", result.output), result.output
    assert re.search(r"loss, last step +│ \d+\.\d{4}", result.output), result.output
    records = read_metrics(tmp_path)
    assert all(re.fullmatch(r"[a-z0-9_]+", key) for record in records for key in record), records[-1]
    assert records[-1]["skipped_steps"] == 0 and records[1]["loss_steps"] == 2


def test_save_every_epoch_saves_where_each_epoch_ends(tmp_path):
    """checkpoint.save_every_epoch: a checkpoint at the step each pass over the data ends, its
    state the start of the next epoch (the last one is the end-of-run save)."""
    from typer.testing import CliRunner

    from ligertune.cli import app

    epochs = [
        "training.max_steps=null",
        "training.epochs=3",
        "data.max_samples=24",
        "training.micro_batch_size=4",
    ]
    saving = ["checkpoint.save_every_epoch=true", "checkpoint.keep_last=10"]
    result = CliRunner().invoke(
        app, ["train", str(QUICKSTART), *TINY, *epochs, *saving, f"output_dir={tmp_path}"]
    )
    assert result.exit_code == 0, result.output
    total = read_metrics(tmp_path)[0]["total_steps"]
    assert total % 3 == 0 and total >= 3
    per_epoch = total // 3
    saved = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "checkpoints").iterdir())
    assert saved == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    state = json.loads((tmp_path / "checkpoints" / f"step-{per_epoch}" / "state.json").read_text())
    assert (state["epoch"], state["batch_index"]) == (1, 0)


def test_cli_reports_bad_input_with_status_2(tmp_path):
    from typer.testing import CliRunner

    from ligertune.cli import app

    result = CliRunner().invoke(app, ["train", str(QUICKSTART), "training.lr=-1", f"output_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "training.lr" in result.output


# --------------------------------------------------------------------------------------------
# GPU (run on the device machine)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_gpu_run_reports_mfu_and_memory(tmp_path, precision):
    result = train(
        tiny_recipe(
            tmp_path,
            "training.max_steps=6",
            f"training.precision={precision}",
            "training.device=cuda",
            "checkpoint.export_hf=true",
        )
    )
    records = [r for r in read_metrics(tmp_path) if r["event"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["peak_mem_allocated_gib"] > 0 and records[-1]["peak_mem_reserved_gib"] > 0
    if torch.cuda.get_device_name().startswith(("NVIDIA H100", "NVIDIA H200")):
        assert 0 < records[-1]["mfu"] < 1
    expected_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert next(result.model.parameters()).dtype == expected_dtype
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=expected_dtype).cuda().eval()
    trained = result.model.eval()
    for name, tensor in loaded.state_dict().items():  # the weights are bit-identical
        assert torch.equal(tensor, trained.state_dict()[name]), name
    ids = torch.randint(0, 2048, (1, 32), device="cuda")
    with torch.no_grad():  # the same math; GPU kernels may pick other algorithms per call
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_compile_and_checkpointing_match_eager(tmp_path):
    eager = train(
        tiny_recipe(
            tmp_path / "eager",
            "training.max_steps=3",
            "training.device=cuda",
            "training.precision=bf16-mixed",
        )
    )
    compiled = train(
        tiny_recipe(
            tmp_path / "compiled",
            "training.max_steps=3",
            "training.device=cuda",
            "training.precision=bf16-mixed",
            "training.compile=true",
            "training.activation_checkpointing=true",
        )
    )
    assert compiled.final_loss == pytest.approx(eager.final_loss, rel=2e-2)


@pytest.mark.gpu
def test_gpu_kernels_on_trains_like_kernels_off(tmp_path):
    common = ["training.max_steps=5", "training.device=cuda", "training.precision=bf16-mixed"]
    train(tiny_recipe(tmp_path / "off", *common))
    on = train(tiny_recipe(tmp_path / "on", *common, "kernels=all"))
    losses_off, losses_on = train_losses(tmp_path / "off"), train_losses(tmp_path / "on")
    for step in range(1, 6):
        assert losses_on[step] == pytest.approx(losses_off[step], rel=2e-2), step
    assert on.final_loss < losses_on[1]
