"""The tokenised-samples cache: reused while the inputs are the same, rebuilt when any changes,
never left half-written, shared between ranks; and `ligertune preprocess`."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from typer.testing import CliRunner

from ligertune.cli import app
from ligertune.config import ASSETS_DIR, validate_recipe
from ligertune.data import DataError, build_datasets, load_tokenizer

SAMPLE = ASSETS_DIR / "alpaca_sample.jsonl"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGERTUNE_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def recipe(path=SAMPLE, tokenizer: dict | None = None, **data):
    return validate_recipe(
        {
            "model": {"config": "tiny-llama"},
            "tokenizer": {"name_or_path": "ligertune://tokenizer", **(tokenizer or {})},
            "data": {"path": str(path), "max_seq_len": 128, "max_samples": 50, **data},
        }
    )


def build(r):
    lines: list[str] = []
    data = build_datasets(r, load_tokenizer(r), log=lines.append)
    return data, " | ".join(lines)


def entries(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_second_build_loads_the_cache_and_gives_the_same_rows(cache):
    first, log = build(recipe())
    assert "tokenised 50 samples in" in log and "cached the tokenised samples at" in log
    assert len(entries(cache)) == 1 and first.cache_dir == cache / entries(cache)[0]
    second, log = build(recipe())
    assert (
        f"loaded 50 tokenised samples from cache {first.cache_dir}" in log
        and "tokenised 50 samples in" not in log
    )
    assert torch.equal(first.train.input_ids, second.train.input_ids)
    assert torch.equal(first.train.labels, second.train.labels)
    assert first.stats == second.stats
    # Layout is not part of the key: padding mode reuses the entry.
    unpacked, log = build(recipe(packing=False))
    assert "loaded" in log and len(entries(cache)) == 1
    assert unpacked.stats.num_tokens == first.stats.num_tokens


@pytest.mark.parametrize(
    "change",
    [
        {"data": {"max_seq_len": 64}},
        {"data": {"train_on_inputs": True}},
        {"seed": 1},
        {
            "tokenizer": {
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
            }
        },
    ],
    ids=["max_seq_len", "train_on_inputs", "seed", "chat_template"],
)
def test_changing_an_input_rebuilds(cache, change):
    base = recipe()
    build(base)
    changed = recipe(tokenizer=change.get("tokenizer"), **change.get("data", {}))
    if "seed" in change:
        changed.seed = change["seed"]
    _, log = build(changed)
    assert "tokenised 50 samples" in log and len(entries(cache)) == 2


def test_editing_the_file_rebuilds(cache, tmp_path):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:20]]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, _ = build(recipe(path))
    rows[0]["output"] = "Something else entirely."
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second, log = build(recipe(path))
    assert "tokenised 20 samples" in log and len(entries(cache)) == 2
    assert not torch.equal(first.train.input_ids, second.train.input_ids)


def test_a_crash_mid_write_leaves_no_entry(cache, monkeypatch):
    original = datasets.Dataset.save_to_disk

    def crash(self, path, *args, **kwargs):
        original(self, path, *args, **kwargs)  # the files are written, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", crash)
    with pytest.raises(KeyboardInterrupt):
        build(recipe())
    assert entries(cache) == []  # neither a half entry under its name nor the temporary folder
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", original)
    _, log = build(recipe())
    assert "tokenised 50 samples" in log and len(entries(cache)) == 1


def test_rank_zero_builds_and_the_others_load(cache):
    r = recipe()
    tok = load_tokenizer(r)
    events: list[str] = []
    build_datasets(r, tok, is_main=True, barrier=lambda: events.append("barrier"), log=events.append)
    # The entry is complete before the others are let through.
    assert events.index("barrier") == next(i for i, e in enumerate(events) if e.startswith("cached")) + 1
    other: list[str] = []
    build_datasets(r, tok, is_main=False, barrier=lambda: other.append("barrier"), log=other.append)
    assert other == ["barrier"]  # a non-main rank waits, loads, and prints nothing
    # A failing main rank still reaches the barrier, so the others do not hang.
    bad = recipe(ASSETS_DIR.parent.parent / "tests" / "data" / "wrong_columns.jsonl")
    events.clear()
    with pytest.raises(DataError):
        build_datasets(bad, tok, is_main=True, barrier=lambda: events.append("barrier"))
    assert events == ["barrier"]


def test_preprocess_command(cache, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        f"model: {{config: tiny-llama}}\ntokenizer: {{name_or_path: 'ligertune://tokenizer'}}\n"
        f"data: {{path: '{SAMPLE}', max_samples: 30}}\n"
    )
    runner = CliRunner()
    result = runner.invoke(app, ["preprocess", str(path), "data.max_seq_len=64"])
    assert result.exit_code == 0, result.output
    assert "tokenised 30 samples" in result.output
    (entry,) = entries(cache)
    assert f"cached: {cache / entry}" in result.output
    result = runner.invoke(app, ["preprocess", str(path), "data.max_seq_len=64"])
    assert result.exit_code == 0 and f"already cached: {cache / entry}" in result.output
    # Training with the same inputs finds it.
    r = validate_recipe(
        {
            "model": {"config": "tiny-llama"},
            "tokenizer": {"name_or_path": "ligertune://tokenizer"},
            "data": {"path": str(SAMPLE), "max_samples": 30, "max_seq_len": 64},
        }
    )
    assert build(r)[0].cache_dir == cache / entry
    result = runner.invoke(app, ["preprocess", str(path), "data.streaming=true", "training.max_steps=2"])
    assert result.exit_code == 2 and "nothing to preprocess" in result.output
