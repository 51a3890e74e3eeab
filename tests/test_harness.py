"""lm-evaluation-harness through `ligertune eval` and a recipe's `eval.tasks`, offline on the bundled
tiny task (ligertune/assets/eval): the accuracy checked against the log-likelihoods computed here
from the model directly, the scores of the end-of-run evaluation in metrics.jsonl and the summary,
and the rules."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ligertune.cli import app
from ligertune.config import ASSETS_DIR, RecipeError, load_recipe
from ligertune.training import train
from ligertune.training.harness import scores
from tests.helpers import PLAIN_RUN, QUICKSTART, TINY_MODEL

TASK = "ligertune://eval/tiny_qa.yaml"
RUN = [*TINY_MODEL, *PLAIN_RUN, "training.max_steps=2", "data.validation_fraction=0.0"]
runner = CliRunner()


def oracle_accuracy(model_dir) -> float:
    """The tiny task's accuracy from the model itself: the choice with the highest summed
    log-probability after "Question: …\\nAnswer:" (lm-eval's multiple_choice, target delimiter " ")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (ASSETS_DIR / "eval" / "tiny_qa.jsonl").read_text().splitlines()]
    correct = 0
    for row in rows:
        context = tokenizer(f"Question: {row['question']}\nAnswer:")["input_ids"]
        totals = []
        for choice in row["choices"]:
            continuation = tokenizer(f" {choice}", add_special_tokens=False)["input_ids"]
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = model(ids).logits[0, :-1].log_softmax(-1)
            positions = range(len(context) - 1, ids.shape[1] - 1)
            totals.append(sum(logprobs[p, ids[0, p + 1]].item() for p in positions))
        correct += max(range(len(totals)), key=totals.__getitem__) == row["answer"]
    return correct / len(rows)


def test_eval_scores_a_run_on_a_local_task_offline(tmp_path):
    train(load_recipe(QUICKSTART, [*RUN, "checkpoint.export_hf=true", f"output_dir={tmp_path / 'run'}"]))
    out = tmp_path / "scores.json"
    done = runner.invoke(app, ["eval", str(tmp_path / "run"), "--tasks", TASK, "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert "tiny_qa_acc" in done.output and "tiny_qa_acc_norm" in done.output
    got = json.loads(out.read_text())["scores"]
    assert got["eval_tiny_qa_acc"] == pytest.approx(oracle_accuracy(tmp_path / "run" / "final"))
    unknown = runner.invoke(app, ["eval", str(tmp_path / "run"), "--tasks", "no_such_task_anywhere"])
    assert unknown.exit_code == 2 and "cannot load the tasks no_such_task_anywhere" in unknown.output


@pytest.mark.slow
def test_eval_tasks_in_a_recipe_run_at_the_end_with_scores_in_metrics_and_summary(tmp_path):
    args = ["train", str(QUICKSTART), *RUN, f"eval.tasks=[{TASK}]", "eval.limit=6", f"output_dir={tmp_path}"]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    [scored] = [r for r in records if r["event"] == "eval_tasks"]
    assert scored["step"] == 2 and set(scored) >= {"eval_tiny_qa_acc", "eval_tiny_qa_acc_norm"}
    assert records[-1]["event"] == "summary" and records[-1]["eval_tiny_qa_acc"] == scored["eval_tiny_qa_acc"]
    assert "eval tasks step 2 | tiny_qa_acc" in done.output and "eval_tiny_qa_acc" in done.output
    # eval.limit: 6 of the 10 questions, so the accuracy is a multiple of 1/6.
    assert round(scored["eval_tiny_qa_acc"] * 6, 6) == int(round(scored["eval_tiny_qa_acc"] * 6))


def test_eval_rules_and_score_keys(tmp_path):
    with pytest.raises(
        RecipeError,
        match=r"eval.tasks: not with parallel.strategy fsdp \(the model is sharded over the processes\)",
    ):
        load_recipe(QUICKSTART, [f"eval.tasks=[{TASK}]", "parallel.strategy=fsdp", "training.precision=fp32"])
    with pytest.raises(RecipeError, match=r"eval.tasks: missing.yaml: no such task file"):
        load_recipe(QUICKSTART, ["eval.tasks=[missing.yaml]"])
    flat = scores(
        {
            "tiny_qa": {"alias": "tiny_qa", "acc,none": 0.5, "acc_stderr,none": "N/A"},
            "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01},
        }
    )
    assert flat == {"eval_tiny_qa_acc": 0.5, "eval_gsm8k_exact_match_strict_match": 0.25}
