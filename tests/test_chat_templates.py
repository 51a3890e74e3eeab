"""Chat templates and the loss mask (ligertune/data/chat.py), over a template of every supported
family (tests/data/chat_templates, written from each family's published template): render a
multi-turn conversation, mask it, and check that exactly the assistant turns are trained, each
with the family's stop token; plus generation markers that leave the stop token outside, reasoning
blocks kept, masked or stripped, and the column and role mappings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ligertune.config import ASSETS_DIR, validate_recipe
from ligertune.data import DataError, build_datasets
from ligertune.data.chat import ChatOptions, end_of_turn, stop_tokens
from ligertune.data.formats import IGNORE_INDEX, tokenize_rows

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"

# family: (template file, BOS, EOS, the stop token an assistant turn must train, whether the
# template takes a system message)
FAMILIES = {
    "llama3": ("llama3", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", True),
    "mistral": ("mistral", "<s>", "</s>", "</s>", True),
    "qwen2": ("qwen2", None, "<|im_end|>", "<|im_end|>", True),
    "qwen3": ("qwen3", None, "<|im_end|>", "<|im_end|>", True),
    "gemma": ("gemma", "<bos>", "<eos>", "<end_of_turn>", False),
    "gemma2": ("gemma", "<bos>", "<eos>", "<end_of_turn>", False),
    "gemma3": ("gemma3", "<bos>", "<eos>", "<end_of_turn>", True),
    "phi3": ("phi3", "<s>", "<|endoftext|>", "<|end|>", True),
}
FAMILY_TOKENS = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>",
    "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|end|>", "<|endoftext|>", "<think>", "</think>",
]  # fmt: skip
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is."},
]


def family_tokenizer(template: str, bos: str | None, eos: str):
    """The bundled BPE with a family's special tokens, template, BOS and EOS: what the masking
    reads of a tokenizer, without the family's vocabulary (no hub access here)."""
    tokenizer = AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS})
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tokenizer.bos_token, tokenizer.eos_token = bos, eos
    return tokenizer


def trained_runs(tokenizer, sample) -> list[str]:
    """The text of each maximal run of trained tokens."""
    runs, current = [], []
    for token, label in zip(sample.input_ids, sample.labels, strict=True):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run) for run in runs]


def mask(tokenizer, messages, think_blocks="keep", fmt="chat", **keys):
    options = ChatOptions.for_source(
        fmt == "sharegpt", keys.get("columns", {}), keys.get("roles", {}), think_blocks
    )
    field = "conversations" if fmt == "sharegpt" else "messages"
    [sample] = tokenize_rows(
        fmt,
        [(0, {field: messages})],
        tokenizer,
        train_on_inputs=False,
        messages_field=None,
        source="t",
        chat=options,
    )
    return sample


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_each_assistant_turn_with_its_stop_token_and_nothing_else(family):
    template, bos, eos, stop, system = FAMILIES[family]
    tokenizer = family_tokenizer(template, bos, eos)
    messages = ([SYSTEM] if system else []) + TURNS
    sample = mask(tokenizer, messages)
    # The ids are the template's rendering, tokenised whole (BOS written by the template).
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(sample.input_ids).startswith(rendered)
    runs = trained_runs(tokenizer, sample)
    replies = [m["content"] for m in TURNS if m["role"] == "assistant"]
    assert len(runs) == len(replies), runs
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    for run, reply in zip(runs, replies, strict=True):
        assert reply in run and stop in run, (run, reply)  # the reply and its stop token train
        assert not any(m["content"] in run for m in messages if m["role"] != "assistant")
    # One labelled stop token per reply (the model learns to end its turn), none elsewhere.
    labelled = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if t == stop_id == label]
    assert len(labelled) == len(replies)
    assert stop_id in stop_tokens(tokenizer)


def test_the_end_of_turn_marker_is_read_from_the_template():
    found = {family: end_of_turn(family_tokenizer(*FAMILIES[family][:3])) for family in FAMILIES}
    assert found == {
        "llama3": "<|eot_id|>",
        "mistral": "</s>",
        "qwen2": "<|im_end|>\n",
        "qwen3": "<|im_end|>\n",
        "gemma": "<end_of_turn>\n",
        "gemma2": "<end_of_turn>\n",
        "gemma3": "<end_of_turn>\n",
        "phi3": "<|end|>\n",
    }


def test_generation_markers_that_leave_the_stop_token_outside_still_train_it():
    """The template marks the assistant content only; trusting the markers alone would mask
    <|im_end|> and make a model that never stops."""
    tokenizer = family_tokenizer("chatml_generation", "<|bos|>", "<|eos|>")
    runs = trained_runs(tokenizer, mask(tokenizer, TURNS))
    assert runs[0] == "Paris is the capital.<|im_end|>\n"
    assert runs[1].startswith("Rome is.<|im_end|>\n")


@pytest.mark.parametrize(
    ("think_blocks", "trained", "in_text"),
    [
        ("keep", ["<think>\nrecall\n</think>\n\nRome is.<|im_end|>\n"], True),
        ("mask", ["Rome is.<|im_end|>\n"], True),
        ("strip", ["<think>\n\n</think>\n\nRome is.<|im_end|>\n"], False),
    ],
)
def test_reasoning_blocks_are_kept_masked_or_stripped(think_blocks, trained, in_text):
    """Qwen 3: the reasoning of the turn after the last user query is rendered; `mask` keeps it in
    the text and out of the loss, `strip` removes it (the template then writes an empty block)."""
    tokenizer = family_tokenizer("qwen3", None, "<|im_end|>")
    messages = [*TURNS[:3], {"role": "assistant", "content": "<think>recall</think>Rome is."}]
    sample = mask(tokenizer, messages, think_blocks)
    runs = trained_runs(tokenizer, sample)
    assert runs[1:] == trained
    assert ("recall" in tokenizer.decode(sample.input_ids)) is in_text


def test_earlier_reasoning_dropped_by_the_template_is_found_without_it():
    """Qwen 3 drops the reasoning of turns before the last user query: not prefix-stable, the
    turn is found by its content without the reasoning."""
    tokenizer = family_tokenizer("qwen3", None, "<|im_end|>")
    messages = [
        TURNS[0],
        {"role": "assistant", "content": "<think>hmm</think>Paris is the capital."},
        *TURNS[2:],
    ]
    runs = trained_runs(tokenizer, mask(tokenizer, messages))
    assert runs[0] == "Paris is the capital.<|im_end|>\n"


def test_message_keys_and_role_names_map_to_ours():
    tokenizer = family_tokenizer("qwen2", None, "<|im_end|>")
    theirs = [
        {"speaker": {"user": "human", "assistant": "bot"}[m["role"]], "text": m["content"]} for m in TURNS
    ]
    mapped = mask(
        tokenizer,
        theirs,
        columns={"role": "speaker", "content": "text"},
        roles={"human": "user", "bot": "assistant"},
    )
    assert mapped == mask(tokenizer, TURNS)
    with pytest.raises(
        DataError, match=r"message 0 of messages is from 'human'; .*data\.roles: \{human: user\}"
    ):
        mask(tokenizer, theirs, columns={"role": "speaker", "content": "text"})
    with pytest.raises(
        DataError, match=r"message 0 of messages needs text fields role and content.*data\.columns"
    ):
        mask(tokenizer, theirs)


def test_data_columns_rename_a_datasets_columns_for_alpaca_and_chat(tmp_path):
    """A hub-style dataset trains without a script: its columns named in the recipe."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "Name a colour.", "answer": "Blue."}) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"instruction": "Name a colour.", "output": "Blue."}) + "\n")
    dialogs = tmp_path / "dialog.jsonl"
    dialogs.write_text(
        json.dumps({"dialog": [{"who": "asker", "said": "Hi"}, {"who": "bot", "said": "Hello."}]}) + "\n"
    )

    def rows(path, **data):
        recipe = validate_recipe(
            {
                "model": {"config": "tiny-llama"},
                "tokenizer": {"name_or_path": "ligertune://tokenizer"},
                "data": {"path": str(path), "shuffle": False, "packing": False, "cache": False, **data},
            }
        )
        from ligertune.data import load_tokenizer

        train = build_datasets(recipe, load_tokenizer(recipe)).train
        return [(r["input_ids"].tolist(), r["labels"].tolist()) for r in train]

    assert rows(qa, columns={"instruction": "question", "output": "answer"}) == rows(plain)
    chat = rows(
        dialogs,
        format="chat",
        columns={"messages": "dialog", "role": "who", "content": "said"},
        roles={"asker": "user", "bot": "assistant"},
    )
    assert len(chat) == 1 and any(label != IGNORE_INDEX for label in chat[0][1])
    with pytest.raises(
        DataError, match=r"data\.columns maps output: reply, but the dataset has no column 'reply'"
    ):
        rows(qa, columns={"instruction": "question", "output": "reply"})
