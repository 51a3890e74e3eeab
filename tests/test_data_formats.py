"""The data formats added for issue #19 (ShareGPT, the messages spelling, prompt/completion),
hub subsets, weighted mixes and streaming: each against an independent expectation, with its
bad-input errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from ligertune.config import ASSETS_DIR, validate_recipe
from ligertune.data import DataError, MicroBatchLoader, build_datasets, load_tokenizer
from ligertune.data import pipeline as pipeline_module
from ligertune.data.streaming import StreamingRows
from ligertune.errors import RecipeError

IGNORE = -100
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6."},
]
SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGERTUNE_DATA_CACHE", str(tmp_path / "data-cache"))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(recipe(ASSETS_DIR / "alpaca_sample.jsonl"))


def recipe(path, seed: int = 0, training: dict | None = None, **data):
    data = {"shuffle": False, "packing": False, **data}
    if path is not None:
        data["path"] = str(path)
    return validate_recipe(
        {
            "seed": seed,
            "model": {"config": "tiny-llama"},
            "tokenizer": {"name_or_path": "ligertune://tokenizer"},
            "data": data,
            "training": training or {},
        }
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def rows_of(dataset) -> list[tuple[list[int], list[int]]]:
    return [(r["input_ids"].tolist(), r["labels"].tolist()) for r in dataset]


def labelled(tok, row) -> str:
    ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
    return tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])


def sharegpt(messages: list[dict]) -> list[dict]:
    return [{"from": SPEAKERS[m["role"]], "value": m["content"]} for m in messages]


# --------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------


def test_sharegpt_and_messages_spelling_equal_chat(tok, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    share = write_jsonl(tmp_path / "share.jsonl", [{"conversations": sharegpt(CONVERSATION)}])
    expected = rows_of(build_datasets(recipe(chat, format="chat"), tok).train)
    assert rows_of(build_datasets(recipe(chat, format="messages"), tok).train) == expected
    got = build_datasets(recipe(share, format="sharegpt"), tok).train
    assert rows_of(got) == expected
    # Independently: only the two assistant turns (with their end markers) and the EOS train.
    assert labelled(tok, got[0]) == "4.<|im_end|>\n6.<|im_end|>\n" + tok.eos_token


def test_sharegpt_other_column_and_errors(tok, tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"turns": sharegpt(CONVERSATION)}])
    assert len(build_datasets(recipe(path, format="sharegpt", messages_field="turns"), tok).train) == 1
    bad = [{"from": "human", "value": "hi"}, {"from": "bard", "value": "hello"}]
    path = write_jsonl(
        tmp_path / "b.jsonl", [{"conversations": sharegpt(CONVERSATION)}, {"conversations": bad}]
    )
    with pytest.raises(
        DataError, match=r"b\.jsonl, row 1: turn 1 of conversations is from 'bard'; ShareGPT speakers"
    ):
        build_datasets(recipe(path, format="sharegpt"), tok)
    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": [{"from": "human"}]}])
    with pytest.raises(
        DataError, match=r"c\.jsonl, row 0: turn 0 of conversations needs text fields from and value"
    ):
        build_datasets(recipe(path, format="sharegpt"), tok)
    # ShareGPT rows read as chat: the message says which format they are.
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": sharegpt(CONVERSATION)}])
    with pytest.raises(DataError, match=r"d\.jsonl, row 0: message 0 .*set data\.format: sharegpt"):
        build_datasets(recipe(path, format="chat"), tok)
    with pytest.raises(
        DataError, match=r"data\.format sharegpt expects columns conversations; found messages"
    ):
        build_datasets(recipe(path, format="sharegpt"), tok)


def test_prompt_completion_trains_on_the_completion(tok, tmp_path):
    rows = [{"prompt": "Q: capital of France?\nA:", "completion": " Paris."}]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    row = build_datasets(recipe(path, format="prompt_completion"), tok).train[0]
    prompt = tok(rows[0]["prompt"], add_special_tokens=True)["input_ids"]
    completion = tok(rows[0]["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["input_ids"].tolist() == prompt + completion
    assert row["labels"].tolist() == [IGNORE] * len(prompt) + completion
    everything = build_datasets(recipe(path, format="prompt_completion", train_on_inputs=True), tok).train[0]
    assert everything["labels"].tolist() == [IGNORE] + (prompt + completion)[1:]


def test_prompt_completion_errors(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 3}]
    )
    with pytest.raises(DataError, match=r"pc\.jsonl, row 1: completion must be text, got int"):
        build_datasets(recipe(path, format="prompt_completion"), tok)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a", "completion": ""}])
    with pytest.raises(DataError, match=r"e\.jsonl, row 0: completion is empty"):
        build_datasets(recipe(path, format="prompt_completion"), tok)
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(
        DataError,
        match=r"data\.format prompt_completion expects columns prompt, completion; found prompt, response",
    ):
        build_datasets(recipe(path, format="prompt_completion"), tok)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"the columns fit data\.format: prompt_completion"):
        build_datasets(recipe(path), tok)


def test_hub_subset_goes_to_load_dataset(tok, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        return datasets.Dataset.from_list([{"prompt": "a", "completion": f"b{split}"}] * 3)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    build_datasets(recipe("org/set", format="prompt_completion", subset="en", validation_split="test"), tok)
    assert [(p, n, s) for p, n, s, _ in calls] == [("org/set", "en", "train"), ("org/set", "en", "test")]
    with pytest.raises(
        DataError, match=r"data\.subset: 'en' names a hub config, but .*alpaca_sample\.jsonl is a local"
    ):
        build_datasets(recipe(ASSETS_DIR / "alpaca_sample.jsonl", subset="en"), tok)


# --------------------------------------------------------------------------------------------
# Mixing
# --------------------------------------------------------------------------------------------


def mix_files(tmp_path, sizes=(40, 10)) -> list[Path]:
    files = []
    for name, size in zip("ab", sizes, strict=True):
        rows = [{"prompt": f"{name}{i} ", "completion": f"{name}{i}"} for i in range(size)]
        files.append(write_jsonl(tmp_path / f"{name}.jsonl", rows))
    return files


def sources_of(tok, dataset) -> list[str]:
    """Which file each sample came from, read back from its text."""
    return [tok.decode(r["input_ids"].tolist(), skip_special_tokens=True)[0] for r in dataset]


def test_mix_draws_each_source_by_weight(tok, tmp_path):
    a, b = mix_files(tmp_path)
    mix = [{"path": str(a), "format": "prompt_completion", "weight": 1}, {"path": str(b), "weight": 3}]
    data = build_datasets(recipe(None, mix=mix, format="prompt_completion", shuffle=True), tok)
    # 50 samples (the sources' total), a quarter from a and three quarters from b: b is repeated.
    counts = Counter(sources_of(tok, data.train))
    assert counts == {"a": 13, "b": 37}  # 12.5/37.5: equal remainders, the first source rounds up
    texts = Counter(tok.decode(r["input_ids"].tolist(), skip_special_tokens=True) for r in data.train)
    b_counts = sorted(c for t, c in texts.items() if t.startswith("b"))
    assert b_counts == [3] * 3 + [4] * 7  # every b row at least 3 times, none more than 4
    assert len([t for t in texts if t.startswith("a")]) == 13  # a's rows are a subset, no repeats
    # Shuffled together, seeded: the same seed gives the same rows, another seed others.
    assert sources_of(tok, data.train) != sorted(sources_of(tok, data.train))
    again = build_datasets(recipe(None, mix=mix, format="prompt_completion", shuffle=True), tok)
    assert rows_of(again.train) == rows_of(data.train)
    other = build_datasets(recipe(None, seed=1, mix=mix, format="prompt_completion", shuffle=True), tok)
    assert rows_of(other.train) != rows_of(data.train)


def test_mix_size_and_recipe_rules(tok, tmp_path):
    a, b = mix_files(tmp_path)
    mix = [{"path": str(a)}, {"path": str(b), "format": "prompt_completion"}]
    data = build_datasets(recipe(None, mix=mix, format="prompt_completion", max_samples=8), tok)
    assert Counter(sources_of(tok, data.train)) == {"a": 4, "b": 4}
    with pytest.raises(RecipeError, match=r"data: set data\.path \(one dataset\) or data\.mix"):
        recipe(a, mix=mix)
    with pytest.raises(RecipeError, match=r"data\.mix\[1\]\.path: file not found"):
        recipe(None, mix=[{"path": str(a)}, {"path": str(tmp_path / "gone.jsonl")}])
    with pytest.raises(RecipeError, match=r"data\.mix\.0\.weight"):
        recipe(None, mix=[{"path": str(a), "weight": 0}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"bad\.jsonl: data\.format prompt_completion expects columns"):
        build_datasets(
            recipe(None, mix=[{"path": str(a)}, {"path": str(bad)}], format="prompt_completion"), tok
        )


# --------------------------------------------------------------------------------------------
# Parallel tokenising
# --------------------------------------------------------------------------------------------


def test_tokenising_in_several_processes_matches_one(tok, tmp_path, monkeypatch):
    path = ASSETS_DIR / "alpaca_sample.jsonl"
    one = build_datasets(recipe(path, max_seq_len=128, cache=False), tok)
    monkeypatch.setattr(pipeline_module, "PARALLEL_ROWS", 10)
    two = build_datasets(recipe(path, max_seq_len=128, cache=False), tok)
    assert torch.equal(one.train.input_ids, two.train.input_ids)
    assert torch.equal(one.train.labels, two.train.labels)
    assert one.stats == two.stats
    rows = [{"instruction": "x", "output": "y"}] * 30 + [{"instruction": "x", "output": None}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl, row 30: output must be text, got NoneType"):
        build_datasets(recipe(bad), tok)


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


def test_streaming_rows_match_the_cached_path(tok):
    path = ASSETS_DIR / "alpaca_sample.jsonl"
    training = {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    streamed = build_datasets(recipe(path, streaming=True, max_seq_len=128, training=training), tok)
    assert isinstance(streamed.train, StreamingRows) and "streaming" in streamed.report()
    cached = build_datasets(recipe(path, max_seq_len=128), tok)
    loader_args = dict(seed=0, pad_token_id=tok.pad_token_id, packing=False, shuffle=False)
    stream_loader = MicroBatchLoader(streamed.train, 2, **loader_args)
    assert stream_loader.batches_per_epoch == 6  # max_steps × accumulation
    batches = list(stream_loader.iter_epoch(0))
    expected = list(MicroBatchLoader(cached.train, 2, **loader_args).iter_epoch(0))[:6]
    assert len(batches) == 6
    for got, want in zip(batches, expected, strict=True):
        for key in want:
            assert torch.equal(got[key], want[key])
    # Two ranks together see what one sees; a resume skips exactly.
    ranks = [
        list(MicroBatchLoader(streamed.train, 1, rank=r, world_size=2, **loader_args).iter_epoch(0))
        for r in (0, 1)
    ]

    def unpadded(batch, b):
        return batch["input_ids"][b][batch["attention_mask"][b] == 1].tolist()

    assert [unpadded(ranks[r][0], 0) for r in (0, 1)] == [unpadded(batches[0], b) for b in (0, 1)]
    resumed = list(stream_loader.iter_epoch(0, start=4))
    assert len(resumed) == 2 and torch.equal(resumed[0]["input_ids"], batches[4]["input_ids"])


def test_streaming_restarts_a_short_source_and_packs(tok, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(3)])
    training = {"max_steps": 4}
    data = build_datasets(
        recipe(
            path,
            format="prompt_completion",
            streaming=True,
            packing=True,
            shuffle=True,
            max_seq_len=16,
            training=training,
        ),
        tok,
    )
    rows = data.train.rows()
    first = [next(rows) for _ in range(12)]  # more rows than 3 samples make: the stream starts over
    assert all(len(r["input_ids"]) == 16 for r in first)
    texts = Counter(tok.decode(r["input_ids"].tolist(), skip_special_tokens=True) for r in first)
    assert sum(texts.values()) == 12


def test_streaming_rules():
    path = ASSETS_DIR / "alpaca_sample.jsonl"
    with pytest.raises(
        RecipeError, match=r"training\.max_steps: data\.streaming reads data of unknown length"
    ):
        recipe(path, streaming=True)
    with pytest.raises(
        RecipeError, match=r"data\.validation_fraction: cannot hold out a fraction of a stream"
    ):
        recipe(path, streaming=True, validation_fraction=0.1, training={"max_steps": 2})
