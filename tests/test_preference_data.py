"""Preference and KTO data: prompt masking, the truncation rule, chat messages, pairs kept
together in [2B, S] micro-batches, and the bundled samples being what the script writes."""

from __future__ import annotations

import json

import pytest

from ligertune.config import load_recipe
from ligertune.data import build_datasets, load_tokenizer
from ligertune.data.formats import IGNORE_INDEX
from ligertune.data.preference import PairLoader, PairRows, tokenize_pairs, truncate_pair
from tests.helpers import ROOT, run_repo_script


def test_truncate_pair_cuts_the_prompt_from_the_left_first():
    prefix, prompt = [1], list(range(10, 30))  # 21 prompt tokens with BOS
    full, responses, cut = truncate_pair(prefix, prompt, [[5] * 6, [6] * 3], max_seq_len=20)
    # Room for the longer response (6): 14 prompt tokens, BOS and the prompt's last 13.
    assert cut and full == [1, *range(17, 30)] and responses == [[5] * 6, [6] * 3]
    # A response longer than half: the prompt keeps max_seq_len // 2, the long response is cut.
    full, responses, cut = truncate_pair(prefix, prompt, [[5] * 30, [6] * 3], max_seq_len=20)
    assert len(full) == 10 and full[0] == 1 and full[-1] == 29
    assert responses == [[5] * 10, [6] * 3]  # each keeps its own length where it fits
    assert truncate_pair(prefix, prompt[:3], [[5], [6]], 20) == ([1, 10, 11, 12], [[5], [6]], False)


def test_pairs_mask_the_prompt_and_end_with_eos(tmp_path):
    tokenizer = load_tokenizer(load_recipe(ROOT / "recipes" / "quickstart-dpo.yaml"))
    rows = [("test, row 0", {"prompt": "Q: two plus two?\nA: ", "chosen": "Four.", "rejected": "Five."})]
    (pair,) = tokenize_pairs("preference", rows, tokenizer, 64)
    for sample in (pair.first, pair.second):
        trained = [i for i, label in enumerate(sample.labels) if label != IGNORE_INDEX]
        prompt_len = trained[0]
        assert sample.input_ids[:prompt_len] == pair.second.input_ids[:prompt_len]  # one shared prompt
        assert sample.labels[prompt_len:] == sample.input_ids[prompt_len:]
        assert sample.input_ids[-1] == tokenizer.eos_token_id
    chat = [
        (
            "test, row 0",
            {
                "prompt": [{"role": "user", "content": "Hi?"}],
                "chosen": "Hello!",
                "rejected": [{"role": "assistant", "content": "Go away."}],
            },
        )
    ]
    (pair,) = tokenize_pairs("preference", chat, tokenizer, 64)
    assert tokenizer.decode([t for t in pair.first.labels if t != IGNORE_INDEX]).startswith("Hello!")


def test_kto_pairs_a_completion_with_the_next_rows_completion():
    tokenizer = load_tokenizer(load_recipe(ROOT / "recipes" / "quickstart-kto.yaml"))
    rows = [
        (f"test, row {i}", {"prompt": f"P{i} ", "completion": f"C{i}", "label": i == 0}) for i in range(3)
    ]
    pairs = tokenize_pairs("kto", rows, tokenizer, 64)
    assert [p.label for p in pairs] == [1, 0, 0]
    decoded = [tokenizer.decode(p.second.input_ids) for p in pairs]
    assert "P0 C1" in decoded[0] and "P2 C0" in decoded[2]


def test_micro_batches_keep_pairs_together(tmp_path):
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart-dpo.yaml", [f"output_dir={tmp_path}", "data.cache=false"]
    )
    assert recipe.data.packing is False
    tokenizer = load_tokenizer(recipe)
    data = build_datasets(recipe, tokenizer)
    assert isinstance(data.train, PairRows)
    loader = PairLoader(
        data.train, 3, seed=0, pad_token_id=tokenizer.pad_token_id, packing=False, rank=1, world_size=2
    )
    batch = next(loader.iter_epoch(0))
    assert batch["input_ids"].shape[0] == 6 and batch["pair_label"].tolist() == [1, 1, 1]
    for i in range(3):
        chosen, rejected = batch["labels"][i], batch["labels"][3 + i]
        first = lambda labels: int((labels != IGNORE_INDEX).nonzero()[0])  # noqa: E731
        # Same prompt in both rows of a pair.
        assert first(chosen) == first(rejected)
        assert (batch["input_ids"][i, : first(chosen)] == batch["input_ids"][3 + i, : first(chosen)]).all()


def test_precomputed_reference_columns_reach_the_batch(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"Q{i} ",
                    "chosen": "yes",
                    "rejected": "no",
                    "ref_chosen_logps": -1.0 - i,
                    "ref_rejected_logps": -2.0,
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    recipe = load_recipe(
        ROOT / "recipes" / "quickstart-dpo.yaml",
        [
            f"data.path={path}",
            "data.validation_fraction=0.0",
            "objective.reference=precomputed",
            "data.cache=false",
        ],
    )
    tokenizer = load_tokenizer(recipe)
    data = build_datasets(recipe, tokenizer)
    loader = PairLoader(data.train, 4, seed=0, pad_token_id=0, packing=False, shuffle=False)
    batch = next(loader.iter_epoch(0))
    refs = batch["ref_logps"].tolist()  # chosen rows' then rejected rows' (the samples are shuffled)
    assert sorted(refs[:4]) == [-4.0, -3.0, -2.0, -1.0] and refs[4:] == [-2.0] * 4


def test_bundled_samples_are_what_the_script_writes():
    assert run_repo_script("scripts/make_preference_sample.py", "--check").returncode == 0


@pytest.mark.parametrize("name", ["dpo", "orpo", "simpo", "kto", "distill"])
def test_quickstarts_validate(name):
    recipe = load_recipe(ROOT / "recipes" / f"quickstart-{name}.yaml")
    assert recipe.objective.name == name
