"""Data pipeline: formats and masking, truncation, packing isolation, loader order, bad files.

References are built independently of the code under test: prompts are spelled out here,
token ids come from the tokenizer's own calls on the full text, and packing isolation is
checked on a real (tiny, random) Llama. Broken fixture files live in tests/data/.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ligertune.catalog.architectures import SHIPPED_CONFIGS
from ligertune.config import ASSETS_DIR, validate_recipe
from ligertune.data import DataError, MicroBatchLoader, build_datasets, load_tokenizer
from ligertune.data.formats import Sample
from ligertune.data.packing import build_rows
from tests.helpers import ROOT, tiny_llama

FIXTURES = Path(__file__).resolve().parent / "data"
IGNORE = -100

# The standard Alpaca prompts, written out independently of ligertune.data.formats.
WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:\n"
)
NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{}\n\n### Response:\n"
)

ALPACA_ROWS = [
    {"instruction": "Add the numbers.", "input": "17 and 25", "output": "17 + 25 = 42."},
    {"instruction": "Name a planet with rings.", "input": "", "output": "Saturn has bright rings of ice."},
    {
        "instruction": "Describe rain in two paragraphs.",
        "input": "",
        "output": "Rain falls from clouds.\n\nIt fills rivers and lakes — and puddles, too.",
    },
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def make_recipe(path: str | Path, seed: int = 0, **data):
    data = {"path": str(path), "shuffle": False, "packing": False, **data}
    return validate_recipe(
        {
            "seed": seed,
            "model": {"config": "tiny-llama"},
            "tokenizer": {"name_or_path": "ligertune://tokenizer"},
            "data": data,
        }
    )


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    """Each test gets its own tokenised-samples cache, never the user's."""
    monkeypatch.setenv("LIGERTUNE_DATA_CACHE", str(tmp_path / "data-cache"))
    return tmp_path / "data-cache"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(make_recipe(ASSETS_DIR / "alpaca_sample.jsonl"))


def encode(tok, text: str, special: bool = False) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


def labelled(row: dict) -> list[int]:
    return [
        t for t, lab in zip(row["input_ids"].tolist(), row["labels"].tolist(), strict=True) if lab != IGNORE
    ]


# --------------------------------------------------------------------------------------------
# Formats and masking
# --------------------------------------------------------------------------------------------


def test_alpaca_masks_prompt_and_appends_eos(tok, tmp_path):
    data = build_datasets(make_recipe(write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)), tok)
    assert len(data.train) == len(ALPACA_ROWS)
    for row, raw in zip(data.train, ALPACA_ROWS, strict=True):
        template = (
            WITH_INPUT.format(raw["instruction"], raw["input"])
            if raw["input"]
            else NO_INPUT.format(raw["instruction"])
        )
        prompt = encode(tok, template, special=True)  # BOS + prompt
        response = encode(tok, raw["output"]) + [tok.eos_token_id]
        assert prompt[0] == tok.bos_token_id
        assert row["input_ids"].tolist() == prompt + response
        # Byte-level BPE splits after the prompt's last newline: the same as tokenizing the whole text.
        assert row["input_ids"].tolist() == encode(tok, template + raw["output"], special=True) + [
            tok.eos_token_id
        ]
        assert row["labels"].tolist() == [IGNORE] * len(prompt) + response
        assert row["position_ids"].tolist() == list(range(len(prompt) + len(response)))
        assert tok.decode(labelled(row)) == raw["output"] + tok.eos_token
        for tensor in row.values():
            assert tensor.dtype == torch.int64 and tensor.dim() == 1


def test_train_on_inputs_labels_everything_but_the_first_token(tok, tmp_path):
    data = build_datasets(
        make_recipe(write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS), train_on_inputs=True), tok
    )
    for row in data.train:
        ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
        assert labels == [IGNORE] + ids[1:]
        assert ids[-1] == tok.eos_token_id


CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is 6 × 7?"},
    {"role": "assistant", "content": "42."},
    {"role": "user", "content": "And 6 × 8?"},
    {"role": "assistant", "content": "48, which is 6 more."},
]


def test_chat_labels_only_assistant_turns(tok, tmp_path):
    trailing_user = CONVERSATION + [{"role": "user", "content": "Thanks!"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": trailing_user}])
    data = build_datasets(make_recipe(path, format="chat"), tok)
    for row, messages in zip(data.train, (CONVERSATION, trailing_user), strict=True):
        # The ids must be exactly the template tokenized as a whole (plus EOS).
        whole = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert row["input_ids"].tolist() == whole + [tok.eos_token_id]
        # The trained text is each assistant turn with its end-of-turn marker.
        expected = "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
        ends_with_assistant = messages[-1]["role"] == "assistant"
        expected += tok.eos_token if ends_with_assistant else ""
        assert tok.decode(labelled(row)) == expected
        assert row["labels"][0] == IGNORE


def test_chat_train_on_inputs_and_messages_field(tok, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"dialog": CONVERSATION}])
    data = build_datasets(
        make_recipe(path, format="chat", messages_field="dialog", train_on_inputs=True), tok
    )
    ids, labels = data.train[0]["input_ids"].tolist(), data.train[0]["labels"].tolist()
    assert labels == [IGNORE] + ids[1:]


def test_chat_without_assistant_turn_is_refused_with_counts(tok, tmp_path):
    """Such a row has nothing to train on: refused with the count and the rows (it used to be
    dropped, and a dataset of them trained on nothing), unless every turn is trained."""
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[:1]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(
        DataError,
        match=r"c\.jsonl, row 1: the conversation has no assistant turn, as in 2 of the 3 rows \(.*c\.jsonl, "
        r"row 2\); there would be nothing to train on in them: remove those rows; or set data\.train_on_inputs",
    ):
        build_datasets(make_recipe(path, format="chat"), tok)
    data = build_datasets(make_recipe(path, format="chat", train_on_inputs=True), tok)
    assert data.stats.num_samples == 3 and data.stats.num_dropped == 0


def test_chat_template_errors_name_the_row(tok, tmp_path):
    bad_role = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": bad_role}])
    with pytest.raises(
        DataError, match=r"c\.jsonl, row 1: message 1 of messages is from 'robot'; .*data\.roles"
    ):
        build_datasets(make_recipe(path, format="chat"), tok)
    # A role of ours that this template does not write (the bundled one has no tool turns).
    tool = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"messages": CONVERSATION}, {"messages": tool}])
    with pytest.raises(DataError, match=r"t\.jsonl, row 1: the chat template rejected .*unknown role tool"):
        build_datasets(make_recipe(path, format="chat"), tok)
    no_content = [{"role": "user"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": no_content}])
    with pytest.raises(DataError, match=r"row 0: message 0 of messages needs text fields role and content"):
        build_datasets(make_recipe(path, format="chat"), tok)


def test_pretokenized_with_and_without_labels(tok, tmp_path):
    rng = random.Random(3)
    rows = []
    for n in (5, 9, 4):
        ids = [rng.randrange(len(tok)) for _ in range(n)]
        labels = [rng.choice([IGNORE, t]) for t in ids]
        rows.append({"input_ids": ids, "labels": labels})
    with_labels = build_datasets(
        make_recipe(write_jsonl(tmp_path / "p.jsonl", rows), format="pretokenized"), tok
    )
    without = build_datasets(
        make_recipe(
            write_jsonl(tmp_path / "q.jsonl", [{"input_ids": r["input_ids"]} for r in rows]),
            format="pretokenized",
        ),
        tok,
    )
    for raw, a, b in zip(rows, with_labels.train, without.train, strict=True):
        assert a["input_ids"].tolist() == raw["input_ids"] == b["input_ids"].tolist()  # no EOS, no BOS added
        assert a["labels"].tolist() == [IGNORE] + raw["labels"][1:]
        assert b["labels"].tolist() == [IGNORE] + raw["input_ids"][1:]


def test_pretokenized_rejects_bad_ids(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, len(tok), 6]}])
    with pytest.raises(
        DataError,
        match=rf"p\.jsonl, row 1: input_ids\[1\] is {len(tok)}; token ids must be integers in 0–2047",
    ):
        build_datasets(make_recipe(path, format="pretokenized"), tok)
    path = write_jsonl(tmp_path / "q.jsonl", [{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(DataError, match=r"row 0: labels must be a list as long as input_ids \(3\), got 2"):
        build_datasets(make_recipe(path, format="pretokenized"), tok)


# --------------------------------------------------------------------------------------------
# Truncation, packing, padding
# --------------------------------------------------------------------------------------------


def test_truncation_is_counted_and_reported(tok, tmp_path):
    rng = random.Random(0)
    words = "river stone cloud lamp orange seven quiet window".split()
    rows = [
        {"instruction": "Repeat.", "input": "", "output": " ".join(rng.choices(words, k=rng.randint(1, 40)))}
        for _ in range(24)
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    prompt = len(encode(tok, NO_INPUT.format("Repeat."), special=True))
    max_len = prompt + 16
    full_lengths = [prompt + len(encode(tok, r["output"])) + 1 for r in rows]
    expected = sum(n > max_len for n in full_lengths)
    assert 0 < expected < len(rows)
    for packing in (False, True):
        data = build_datasets(make_recipe(path, max_seq_len=max_len, packing=packing), tok)
        assert data.stats.num_truncated == expected
        assert f"{expected} truncated to {max_len}" in data.report()
        assert all(len(row["input_ids"]) <= max_len for row in data.train)
    unpacked = build_datasets(make_recipe(path, max_seq_len=max_len), tok)
    assert sorted(len(r["input_ids"]) for r in unpacked.train) == sorted(
        min(n, max_len) for n in full_lengths
    )


def split_samples(row: dict) -> list[tuple[list[int], list[int]]]:
    """Cut a packed row where position_ids restart; returns (ids, labels) per piece."""
    pieces, start = [], 0
    pos = row["position_ids"].tolist()
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] == 0:
            assert pos[start:i] == list(range(i - start))
            pieces.append((row["input_ids"][start:i].tolist(), row["labels"][start:i].tolist()))
            start = i
    return pieces


def test_packing_restarts_positions_and_masks_each_first_token(tok):
    recipe = make_recipe(ASSETS_DIR / "alpaca_sample.jsonl", max_seq_len=128, max_samples=60, shuffle=True)
    unpacked = build_datasets(recipe, tok)
    recipe.data.packing = True
    packed = build_datasets(recipe, tok)
    assert packed.stats.num_samples == unpacked.stats.num_samples == 60
    assert packed.stats.num_tokens == unpacked.stats.num_tokens
    assert packed.stats.num_label_tokens == unpacked.stats.num_label_tokens
    samples, padding = [], 0
    for row in packed.train:
        assert len(row["input_ids"]) == 128
        pieces = split_samples(row)
        last_ids, last_labels = pieces[-1]
        if last_ids[0] == tok.pad_token_id and set(last_ids) == {tok.pad_token_id}:
            assert set(last_labels) == {IGNORE}  # the padding "sample"
            padding += len(last_ids)
            pieces = pieces[:-1]
        for ids, labels in pieces:
            assert labels[0] == IGNORE
            samples.append((ids, labels))
    # Every sample appears whole, exactly once, as in padding mode.
    assert sorted(samples) == sorted((r["input_ids"].tolist(), r["labels"].tolist()) for r in unpacked.train)
    assert padding == len(packed.train) * 128 - packed.stats.num_tokens
    assert "packed sequences of 128 tokens" in packed.report()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_samples_cannot_see_each_other(tok, attn):
    """B's logits are the same packed after A as alone, on a real Llama, with only position_ids."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tok), hidden_size=64, intermediate_size=96, attn_implementation=attn)
    model = model.float().eval()
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(5, len(tok), (13,), generator=gen).tolist()
    b = torch.randint(5, len(tok), (11,), generator=gen).tolist()
    row = build_rows([Sample(a, a), Sample(b, b)], 32, tok.pad_token_id, packed=True)[0]

    def logits(ids, pos):
        # use_cache=False matters: with a cache object transformers skips packed-sequence detection.
        with torch.no_grad():
            return model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0].double()

    alone = logits(torch.tensor(b), torch.arange(len(b)))
    packed = logits(row["input_ids"], row["position_ids"])[len(a) : len(a) + len(b)]
    assert (packed - alone).abs().max() <= 1e-5
    # Control: the same row with continuous positions does let B see A, so the check can fail.
    leaky = logits(row["input_ids"], torch.arange(32))[len(a) : len(a) + len(b)]
    assert (leaky - alone).abs().max() > 1e-3


def test_padding_mode_batches(tok, tmp_path):
    data = build_datasets(make_recipe(write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)), tok)
    loader = MicroBatchLoader(
        data.train, 3, seed=0, pad_token_id=tok.pad_token_id, packing=False, shuffle=False
    )
    (batch,) = list(loader.iter_epoch(0))
    lengths = [len(r["input_ids"]) for r in data.train]
    assert set(batch) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert batch["input_ids"].shape == (3, max(lengths))
    for b, (row, n) in enumerate(zip(data.train, lengths, strict=True)):
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["input_ids"][b, :n].equal(row["input_ids"])
        assert batch["labels"][b, :n].equal(row["labels"])
        assert (batch["input_ids"][b, n:] == tok.pad_token_id).all() and (
            batch["labels"][b, n:] == IGNORE
        ).all()
        assert batch["position_ids"][b].tolist() == list(range(max(lengths)))


def test_packed_batches_have_no_attention_mask(tok):
    recipe = make_recipe(ASSETS_DIR / "alpaca_sample.jsonl", max_seq_len=256, max_samples=40, packing=True)
    data = build_datasets(recipe, tok)
    loader = MicroBatchLoader(data.train, 2, seed=0, pad_token_id=tok.pad_token_id, packing=True)
    batch = next(loader.iter_epoch(0))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.shape == (2, 256) and t.dtype == torch.int64 for t in batch.values())


# --------------------------------------------------------------------------------------------
# Order: determinism, sharding, resume
# --------------------------------------------------------------------------------------------


def indexed_rows(n: int) -> list[dict]:
    """Rows whose first token is their index, so batches show which rows they hold."""
    return [
        {
            "input_ids": torch.tensor([i, 7, 7]),
            "labels": torch.tensor([IGNORE, 7, 7]),
            "position_ids": torch.arange(3),
        }
        for i in range(n)
    ]


def batch_ids(batches) -> list[list[int]]:
    return [b["input_ids"][:, 0].tolist() for b in batches]


def test_build_is_deterministic_with_the_seed(tok):
    def rows(seed):
        recipe = make_recipe(
            ASSETS_DIR / "alpaca_sample.jsonl",
            seed=seed,
            max_seq_len=256,
            max_samples=50,
            shuffle=True,
            packing=True,
        )
        return [r["input_ids"].tolist() for r in build_datasets(recipe, tok).train]

    assert rows(5) == rows(5)
    assert rows(5) != rows(6)


def test_loader_order_is_seeded_per_epoch():
    data = indexed_rows(40)

    def epoch(seed, e):
        loader = MicroBatchLoader(data, 4, seed=seed, pad_token_id=0, packing=True)
        return batch_ids(loader.iter_epoch(e))

    assert epoch(1, 0) == epoch(1, 0)
    assert epoch(1, 0) != epoch(2, 0)
    assert epoch(1, 0) != epoch(1, 1)
    assert sorted(sum(epoch(1, 0), [])) == list(range(40))  # a permutation, nothing repeated
    plain = MicroBatchLoader(data, 4, seed=1, pad_token_id=0, packing=True, shuffle=False)
    assert sum(batch_ids(plain.iter_epoch(3)), []) == list(range(40))


def test_ranks_together_see_what_one_rank_sees():
    data = indexed_rows(37)  # not a multiple of 4: the tail is dropped the same way
    single = MicroBatchLoader(data, 4, seed=9, pad_token_id=0, packing=True)
    ranks = [
        MicroBatchLoader(data, 2, seed=9, pad_token_id=0, packing=True, rank=r, world_size=2) for r in (0, 1)
    ]
    assert single.batches_per_epoch == ranks[0].batches_per_epoch == 9
    per_rank = [batch_ids(r.iter_epoch(2)) for r in ranks]
    for step, whole in enumerate(batch_ids(single.iter_epoch(2))):
        assert set(whole) == set(per_rank[0][step]) | set(per_rank[1][step])
        assert not set(per_rank[0][step]) & set(per_rank[1][step])


def test_resume_skips_exactly_start_batches():
    loader = MicroBatchLoader(indexed_rows(30), 3, seed=4, pad_token_id=0, packing=True, rank=1, world_size=2)
    full = batch_ids(loader.iter_epoch(1))
    assert len(full) == loader.batches_per_epoch == 5
    assert batch_ids(loader.iter_epoch(1, start=2)) == full[2:]
    assert batch_ids(loader.iter_epoch(1, start=5)) == []
    with pytest.raises(ValueError, match="start must be in 0..5"):
        next(loader.iter_epoch(1, start=6))


def test_loader_too_small_for_one_batch():
    with pytest.raises(DataError, match="3 sequences, fewer than one micro-batch on each rank"):
        MicroBatchLoader(indexed_rows(3), 2, seed=0, pad_token_id=0, packing=True, world_size=2)


# --------------------------------------------------------------------------------------------
# Sources and splits
# --------------------------------------------------------------------------------------------


def test_validation_fraction_is_seeded_and_disjoint(tok, tmp_path):
    rows = [{"instruction": f"Echo {i}.", "input": "", "output": f"Item {i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "v.jsonl", rows)

    def outputs(ds):
        return {tok.decode(labelled(r), skip_special_tokens=True) for r in ds}

    recipe = make_recipe(path, validation_fraction=0.25)
    data = build_datasets(recipe, tok)
    train, val = outputs(data.train), outputs(data.validation)
    assert len(val) == 10 and len(train) == 30 and not train & val
    assert data.stats.validation.num_samples == 10 and "validation: 10 samples" in data.report()
    assert outputs(build_datasets(recipe, tok).validation) == val
    assert outputs(build_datasets(make_recipe(path, seed=1, validation_fraction=0.25), tok).validation) != val
    assert (
        build_datasets(make_recipe(path, max_samples=8, validation_fraction=0.25), tok).stats.num_samples == 6
    )


def test_validation_split_from_a_directory(tok, tmp_path):
    folder = tmp_path / "data"  # a folder of data files only (the test's cache is in tmp_path)
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ALPACA_ROWS)
    write_jsonl(folder / "validation.jsonl", ALPACA_ROWS[:1])
    data = build_datasets(make_recipe(folder, validation_split="validation"), tok)
    assert len(data.train) == 3 and len(data.validation) == 1
    with pytest.raises(DataError, match="no split 'test'; its files make train, validation"):
        build_datasets(make_recipe(folder, split="test"), tok)


def test_parquet_source(tok, tmp_path):
    import datasets

    datasets.Dataset.from_list(ALPACA_ROWS).to_parquet(str(tmp_path / "a.parquet"))
    data = build_datasets(make_recipe(tmp_path / "a.parquet"), tok)
    assert tok.decode(labelled(data.train[1])) == ALPACA_ROWS[1]["output"] + tok.eos_token


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fmt, message",
    [
        (
            "wrong_columns.jsonl",
            "alpaca",
            r"wrong_columns\.jsonl: data\.format alpaca expects columns instruction, output \(optional: input\); "
            r"found text, label \(missing instruction, output\)",
        ),
        ("empty.jsonl", "alpaca", r"empty\.jsonl: the file is empty"),
        (
            "latin1.jsonl",
            "alpaca",
            r"latin1\.jsonl: not UTF-8 text \(byte 0xe9 on line 2\); re-save the file as UTF-8",
        ),
        ("malformed.jsonl", "alpaca", r"malformed\.jsonl: line 2 is not valid JSON: Expecting ',' delimiter"),
        (
            "malformed.json",
            "alpaca",
            r"malformed\.json: not valid JSON: Expecting ',' delimiter at line 3, column 36",
        ),
    ],
)
def test_bad_files_raise_clear_errors(tok, name, fmt, message):
    with pytest.raises(DataError, match=message):
        build_datasets(make_recipe(FIXTURES / name, format=fmt), tok)


def test_missing_empty_and_mismatched_sources(tok, tmp_path):
    recipe = make_recipe(FIXTURES / "wrong_columns.jsonl")
    recipe.data.path = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(DataError, match=r"data\.path: file not found: .*nowhere\.jsonl"):
        build_datasets(recipe, tok)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match=r"empty\.json: the JSON list has no rows"):
        build_datasets(make_recipe(tmp_path / "empty.json"), tok)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(
        DataError, match=r"found messages \(missing instruction, output\); the columns fit data.format: chat"
    ):
        build_datasets(make_recipe(chat), tok)
    with pytest.raises(DataError, match=r"a single file holds one split, train, not 'validation'"):
        build_datasets(make_recipe(chat, format="chat", validation_split="validation"), tok)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"notes\.txt: unsupported file type '\.txt'"):
        build_datasets(make_recipe(tmp_path / "notes.txt"), tok)


def test_alpaca_field_types_are_checked(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl", [ALPACA_ROWS[0], {"instruction": "Count.", "input": "", "output": None}]
    )
    with pytest.raises(DataError, match=r"a\.jsonl, row 1: output must be text, got NoneType"):
        build_datasets(make_recipe(path), tok)


def test_load_tokenizer_sources_and_padding():
    recipe = make_recipe(FIXTURES / "wrong_columns.jsonl")
    recipe.tokenizer.name_or_path = None
    with pytest.raises(DataError, match="tokenizer.name_or_path is not set and model.config"):
        load_tokenizer(recipe)
    recipe.tokenizer.name_or_path = str(FIXTURES)  # a directory with no tokenizer in it
    with pytest.raises(
        DataError, match=r"tokenizer\.name_or_path: cannot load a tokenizer from .*tests/data"
    ):
        load_tokenizer(recipe)


def test_pad_token_defaults_to_eos(tmp_path):
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    source.pad_token = None
    source.save_pretrained(tmp_path)
    recipe = make_recipe(FIXTURES / "wrong_columns.jsonl")
    recipe.tokenizer.name_or_path = str(tmp_path)
    assert load_tokenizer(recipe).pad_token_id == source.eos_token_id
    recipe.tokenizer.pad_token = "<|im_end|>"
    assert load_tokenizer(recipe).pad_token == "<|im_end|>"
    recipe.tokenizer.pad_token = "<|not-a-token|>"
    with pytest.raises(
        DataError, match=r"tokenizer\.pad_token: '<\|not-a-token\|>' is not in the vocabulary"
    ):
        load_tokenizer(recipe)


# --------------------------------------------------------------------------------------------
# Bundled assets
# --------------------------------------------------------------------------------------------


def test_bundled_tokenizer_loads_round_trips_and_chats():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    assert len(tok) == SHIPPED_CONFIGS["tiny-llama"]["vocab_size"] == 2048
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    rng = random.Random(7)
    alphabet = "abcxyz XYZ 0123 .,;!?\n\t—é中🙂"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert (
        len(tok("The instruction describes a task.", add_special_tokens=False)["input_ids"]) <= 8
    )  # merges learned
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == "<|bos|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(chat, tokenize=True)["input_ids"]
    assert tok.decode(ids) == text and ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_bundled_samples_are_well_formed():
    rows = [
        json.loads(line)
        for line in (ASSETS_DIR / "alpaca_sample.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert 200 <= len(rows) <= 1000
    assert all(
        set(r) == {"instruction", "input", "output"} and r["instruction"] and r["output"] for r in rows
    )
    assert sum(bool(r["input"]) for r in rows) > len(rows) // 5
    words = [len(r["output"].split()) for r in rows]
    assert sum(n <= 5 for n in words) >= len(rows) // 10  # short answers ...
    assert sum(n >= 100 for n in words) >= 10 and max(words) >= 150  # ... and long ones
    assert sum("\n\n" in r["output"] for r in rows) >= len(rows) // 5  # multi-paragraph
    chats = [
        json.loads(line)
        for line in (ASSETS_DIR / "chat_sample.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert chats and all(c["messages"][-1]["role"] == "assistant" for c in chats)


@pytest.mark.parametrize(
    "script", ["make_alpaca_sample.py", "make_arithmetic_sample.py", "train_tokenizer.py"]
)
def test_bundled_assets_match_their_scripts(script):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# GPU: real sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_isolation_on_gpu_at_full_length(tok, attn):
    """A full 2048-token packed row of the bundled data on CUDA: every sample's logits match its
    logits alone (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = tiny_llama(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=2048,
        attn_implementation=attn,
    )
    model = model.cuda().float().eval()
    recipe = make_recipe(ASSETS_DIR / "alpaca_sample.jsonl", max_seq_len=2048, packing=True, shuffle=True)
    row = build_datasets(recipe, tok).train[0]
    with torch.no_grad():
        packed = model(
            input_ids=row["input_ids"][None].cuda(),
            position_ids=row["position_ids"][None].cuda(),
            use_cache=False,
        ).logits[0]
        start = 0
        for ids, _ in split_samples(row):  # the padding tail included: it is a "sample" too
            alone = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False).logits[0]
            assert (packed[start : start + len(ids)] - alone).abs().max() <= 1e-4
            start += len(ids)


def test_hub_ids_go_through_load_dataset(tok, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, split=None, **kwargs):
        calls.append((path, split))
        if path == "org/offline":
            raise ConnectionError("Couldn't reach the hub")
        return datasets.Dataset.from_list(ALPACA_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = build_datasets(make_recipe("org/alpaca-like", validation_split="test"), tok)
    assert calls == [("org/alpaca-like", "train"), ("org/alpaca-like", "test")]
    assert len(data.train) == len(data.validation) == 3
    with pytest.raises(
        DataError, match=r"cannot load 'org/offline' from the hub \(ConnectionError: Couldn't reach"
    ):
        build_datasets(make_recipe("org/offline"), tok)


# --------------------------------------------------------------------------------------------
# Text read as text; one set of rules for a file and a directory
# --------------------------------------------------------------------------------------------

# Outputs that a JSON reader typing columns from their values used to decode again: quoted text
# lost its quotes, "false" became False and "null" vanished.
JSON_LOOKING = ['"quoted"', "false", "null", "[1, 2]", "{}", "42", "Saturn"]


def _outputs(data, tok) -> list[str]:
    return [tok.decode(labelled(row)).removesuffix(tok.eos_token) for row in data.train]


def test_json_text_is_read_as_the_text_it_is(tok, tmp_path):
    rows = [{"instruction": "Repeat.", "output": text} for text in JSON_LOOKING]
    data = build_datasets(make_recipe(write_jsonl(tmp_path / "a.jsonl", rows)), tok)
    assert _outputs(data, tok) == JSON_LOOKING
    (tmp_path / "b.json").write_text(json.dumps(rows))  # a JSON list: the same
    assert _outputs(build_datasets(make_recipe(tmp_path / "b.json"), tok), tok) == JSON_LOOKING


def test_csv_fields_are_read_as_text(tok, tmp_path):
    """pandas would read NA, null and 42 as a missing value and a number."""
    texts = ["NA", "null", "42", "1e5", "True", "a, with a comma"]
    lines = ["instruction,output"] + [f'Repeat.,"{text}"' for text in texts]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    assert _outputs(build_datasets(make_recipe(tmp_path / "a.csv"), tok), tok) == texts


def test_a_directory_reads_every_file_with_the_rules_of_a_file(tok, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ALPACA_ROWS[:2])
    write_jsonl(folder / "b.jsonl", [*ALPACA_ROWS[2:], {"instruction": "x", "output": "y", "extra": 5}])
    data = build_datasets(make_recipe(folder), tok)
    assert data.stats.num_samples == len(ALPACA_ROWS) + 1  # every file, all its rows
    # A column typed differently in two typed files is refused (it used to be cast to the first's).
    import datasets

    typed = tmp_path / "typed"
    typed.mkdir()
    datasets.Dataset.from_list(ALPACA_ROWS).to_parquet(str(typed / "a.parquet"))
    datasets.Dataset.from_list([{"instruction": "x", "input": "", "output": 3}]).to_parquet(
        str(typed / "b.parquet")
    )
    with pytest.raises(DataError, match=r"column output is string in .*a\.parquet but int64 in .*b\.parquet"):
        build_datasets(make_recipe(typed), tok)
    # A column one typed file has as nulls only takes the others' type.
    datasets.Dataset.from_list([{"instruction": "x", "input": None, "output": "y"}]).to_parquet(
        str(typed / "b.parquet")
    )
    assert build_datasets(make_recipe(typed), tok).stats.num_samples == len(ALPACA_ROWS) + 1


def test_a_hub_column_of_mixed_types_is_refused():
    """A hub dataset goes through datasets' JSON builder, which reads a mixed column back as JSON:
    refused, since its text would not stay text (local files are read exactly instead)."""
    import datasets

    from ligertune.data.local import refuse_json_columns

    mixed = datasets.Dataset.from_dict(
        {"instruction": ["a", "b"], "output": ['"quoted"', "false"]},
        features=datasets.Features({"instruction": datasets.Value("string"), "output": datasets.Json()}),
    )
    with pytest.raises(DataError, match=r"org/mixed: column output holds values of mixed types"):
        refuse_json_columns(mixed, "alpaca", None, "org/mixed")
    refuse_json_columns(mixed.cast_column("output", datasets.Value("string")), "alpaca", None, "org/mixed")
