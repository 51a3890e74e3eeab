"""Fuzzing the two readers of what users hand us: the recipe loader and the data readers.

The property is the project's rule for a user's mistake: whatever the input, the answer is a
result or our own error type (`RecipeError` with one line per problem, `DataError` in one line),
never another exception, which the CLI would print as a traceback. The data readers have a
second property: a value read is the value the file held, exactly (`ligertune.data.local`).

Kept to a few seconds: modest ``max_examples`` and no deadline (the first examples pay for
imports). What the fuzzing found is listed in the closing note of issue #28.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ligertune.config import load_recipe
from ligertune.config.rules import model_problems
from ligertune.data.formats import tokenize_rows
from ligertune.data.local import load_local
from ligertune.errors import DataError, RecipeError
from tests.helpers import QUICKSTART

# No example database: a run leaves nothing behind in the checkout.
FUZZ = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# JSON values, NaN and infinity included (Python's json writes them; they are not JSON).
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _is_one_line_each(error: RecipeError) -> bool:
    return bool(error.problems) and all(p and "\n" not in p for p in error.problems)


# --------------------------------------------------------------------------------------------
# The recipe loader
# --------------------------------------------------------------------------------------------

BASE = yaml.safe_load(QUICKSTART.read_text())


def _load(text: str, overrides: list[str] | None = None):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            return load_recipe(path, overrides or [])
        except RecipeError as e:
            assert _is_one_line_each(e), e.problems
            return None


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("ab:-&*[]{},'\"!#|>\n\t 0.9eE%@`?")), max_size=120))
def test_any_yaml_text_is_a_recipe_or_a_recipe_error(text):
    _load(text)


def _dotted_keys(mapping: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in mapping.items():
        keys.append(prefix + key)
        if isinstance(value, dict):
            keys += _dotted_keys(value, prefix + key + ".")
    return keys


KNOWN_KEYS = _dotted_keys(BASE) + [
    "training.gradient_accumulation_steps",
    "training.micro_batch_size",
    "model.config_overrides",
    "model.config",
    "data.max_seq_len",
    "data.mix",
    "lora.r",
    "objective.name",
    "parallel.strategy",
    "checkpoint.resume",
    "checkpoint.data_changed",
]


@FUZZ
@given(st.sampled_from(KNOWN_KEYS), VALUES)
def test_any_value_under_any_key_is_a_recipe_or_a_recipe_error(key, value):
    """The quickstart with one key set to anything (written out as YAML), then its model rules
    (which build the model's config) when it loads."""
    raw = json.loads(json.dumps(BASE))
    node = raw
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node.get(part), dict | None) else {}
    node[last] = value
    recipe = _load(yaml.safe_dump(raw, allow_unicode=True))
    if recipe is not None:
        assert all(p and "\n" not in p for p in model_problems(recipe))


@FUZZ
@given(st.sampled_from(KNOWN_KEYS), st.text(max_size=40))
def test_any_override_is_a_recipe_or_a_recipe_error(key, text):
    _load(QUICKSTART.read_text(), [f"{key}={text}"])


# --------------------------------------------------------------------------------------------
# The data readers
# --------------------------------------------------------------------------------------------

ALPACA_COLUMNS = ["instruction", "input", "output"]
# Any text, lone surrogates included (json.dumps writes them as \\ud800 escapes: a cut emoji).
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=[]), max_size=12)
ROW_VALUES = st.recursive(
    SCALARS | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
ROWS = st.lists(
    st.dictionaries(
        st.sampled_from([*ALPACA_COLUMNS, "extra"]) | ANY_TEXT, ROW_VALUES, min_size=1, max_size=4
    ),
    min_size=1,
    max_size=6,
)


def _json_safe(value) -> bool:
    """Whether `value` is JSON of text: no NaN or infinity, no lone surrogate, anywhere in it."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return all(_json_safe(v) for v in value)
    if isinstance(value, dict):
        return all(_json_safe(k) and _json_safe(v) for k, v in value.items())
    return True


@FUZZ
@given(ROWS, st.booleans())
def test_json_rows_are_read_exactly_or_refused(rows, lines):
    """JSON Lines or a JSON list: every value of the format's columns comes back exactly as
    written, whatever its type; NaN, infinity and lone surrogates (not JSON text) are refused in one line."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("d.jsonl" if lines else "d.json")
        text = "".join(json.dumps(r) + "\n" for r in rows) if lines else json.dumps(rows)
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            dataset, located = load_local(path, "train", "alpaca", None)
        except DataError as e:
            assert "\n" not in str(e)
            assert not all(_json_safe(r) for r in rows) or any(
                c not in {k for r in rows for k in r} for c in ("instruction", "output")
            ), str(e)
            return
        assert all(_json_safe(r) for r in rows)
        for index, row in enumerate(rows):
            _, read = located.row(index, dataset[index])
            assert {c: read.get(c) for c in ALPACA_COLUMNS} == {c: row.get(c) for c in ALPACA_COLUMNS}


@FUZZ
@given(
    st.lists(
        st.lists(
            st.text(alphabet=st.characters(exclude_characters="\0\r"), max_size=12), min_size=2, max_size=2
        ),
        min_size=1,
        max_size=6,
    )
)
def test_csv_fields_are_read_as_the_text_they_are(fields):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "d.csv"
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["instruction", "output"])
        writer.writerows(fields)
        path.write_text(buffer.getvalue(), encoding="utf-8", errors="surrogatepass")
        try:
            dataset, located = load_local(path, "train", "alpaca", None)
        except DataError as e:
            assert "\n" not in str(e)
            return
        read = [located.row(i, dataset[i])[1] for i in range(len(dataset))]
        written = [dict(zip(["instruction", "output"], row, strict=True)) for row in fields]
        assert [{k: r[k] for k in ("instruction", "output")} for r in read] == written


@FUZZ
@given(st.binary(max_size=200), st.sampled_from([".jsonl", ".json", ".csv"]))
def test_any_bytes_in_a_data_file_are_rows_or_one_data_error(data, suffix):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"d{suffix}"
        path.write_bytes(data)
        try:
            load_local(path, "train", "alpaca", None)
        except DataError as e:
            assert "\n" not in str(e)


@pytest.fixture(scope="module")
def tok():
    from ligertune.data import load_tokenizer

    return load_tokenizer(load_recipe(QUICKSTART))


FORMAT_ROWS = {
    "alpaca": st.fixed_dictionaries({"instruction": VALUES, "output": VALUES}, optional={"input": VALUES}),
    "prompt_completion": st.fixed_dictionaries({"prompt": VALUES, "completion": VALUES}),
    "chat": st.fixed_dictionaries(
        {
            "messages": VALUES
            | st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["user", "assistant", "system", "x"]) | VALUES,
                        "content": VALUES,
                    }
                ),
                max_size=3,
            )
        }
    ),
    "sharegpt": st.fixed_dictionaries(
        {
            "conversations": VALUES
            | st.lists(
                st.fixed_dictionaries(
                    {"from": st.sampled_from(["human", "gpt", "bard"]) | VALUES, "value": VALUES}
                ),
                max_size=3,
            )
        }
    ),
    "pretokenized": st.fixed_dictionaries(
        {"input_ids": VALUES | st.lists(st.integers(-200, 5000) | st.booleans() | st.floats(), max_size=5)},
        optional={"labels": VALUES | st.lists(st.integers(-200, 5000), max_size=5)},
    ),
}


@FUZZ
@given(st.data())
@pytest.mark.parametrize("fmt", list(FORMAT_ROWS))
def test_any_row_tokenises_or_is_one_data_error(tok, fmt, data):
    """The format's checks, on rows of any shape: samples, or one DataError naming the row."""
    rows = data.draw(st.lists(FORMAT_ROWS[fmt], min_size=1, max_size=3))
    numbered = [(f"d.jsonl, row {i}", row) for i, row in enumerate(rows)]
    try:
        samples = tokenize_rows(
            fmt, numbered, tok, train_on_inputs=False, messages_field=None, source="d.jsonl"
        )
    except DataError as e:
        assert "\n" not in str(e).strip() or "template" in str(e), str(e)
        assert str(e).startswith("d.jsonl, row ") or str(e).startswith("data.format"), str(e)
        return
    assert len(samples) == len(rows)
    for sample in samples:
        assert all(isinstance(t, int) and not isinstance(t, bool) for t in sample.input_ids)


MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "x"]) | VALUES, "content": VALUES}
    ),
    max_size=3,
)
PAIR_ROWS = {
    "preference": st.fixed_dictionaries(
        {"prompt": VALUES | MESSAGES, "chosen": VALUES | MESSAGES, "rejected": VALUES | MESSAGES},
        optional={"ref_chosen_logps": VALUES, "ref_rejected_logps": VALUES},
    ),
    "kto": st.fixed_dictionaries(
        {"prompt": VALUES | MESSAGES, "completion": VALUES | MESSAGES, "label": VALUES},
        optional={"ref_logps": VALUES, "ref_kl_logps": VALUES},
    ),
}


@FUZZ
@given(st.data())
@pytest.mark.parametrize("fmt", list(PAIR_ROWS))
def test_any_pair_row_tokenises_or_is_one_data_error(tok, fmt, data):
    from ligertune.data.preference import tokenize_pairs

    rows = data.draw(st.lists(PAIR_ROWS[fmt], min_size=1, max_size=3))
    try:
        pairs = tokenize_pairs(fmt, [(f"d.jsonl, row {i}", row) for i, row in enumerate(rows)], tok, 32)
    except DataError as e:
        assert str(e).startswith(("d.jsonl, row ", "data.format")), str(e)
        return
    assert len(pairs) == len(rows)
    assert all(math.isfinite(x) for pair in pairs for x in pair.ref_logps)
