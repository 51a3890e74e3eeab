"""Dataset formats → token ids and labels.

Every format ends as `Sample(input_ids, labels)` with labels aligned to input_ids (the model
shifts them: the logits at position t are scored against labels[t + 1]):

* ``alpaca``: columns instruction, output and optionally input, rendered with the standard
  Alpaca prompt. The prompt (and the tokenizer's BOS) is labelled −100 unless
  ``train_on_inputs``; the response and an appended EOS are labelled.
* ``prompt_completion``: columns prompt and completion, used as written (no template): the
  prompt is labelled −100 unless ``train_on_inputs``, the completion and an appended EOS are
  labelled. BOS as for alpaca.
* ``chat`` (also spelled ``messages``): the OpenAI layout, a list of ``{role, content}``
  messages (column ``messages``), rendered with the tokenizer's chat template. Only assistant
  turns, each with its end-of-turn marker, are labelled (`ligertune.data.chat`), and the EOS
  after a final assistant turn when the template's marker is not EOS itself.
* ``sharegpt``: a list of ``{from, value}`` turns (column ``conversations``), roles human, gpt
  and system read as user, assistant and system; then as ``chat``.

* ``pretokenized``: ``input_ids`` and optionally ``labels`` (default: every token), used as is.
* ``preference`` (prompt, chosen, rejected) and ``kto`` (prompt, completion, label): two
  sequences per row, see `ligertune.data.preference`.
* ``prompt`` (prompt, optional answer and metadata): prompts alone, whose completions an online
  RL objective generates, see `ligertune.data.prompts`.

``data.columns`` maps each field below to a dataset's own column name (`rename_columns`, applied
as a source is loaded) and, for the conversation formats, the message keys; ``data.roles`` maps
role names (`ligertune.data.chat.ChatOptions`).

Prompt and response are tokenized separately and concatenated, so the label boundary is
exact. The price is that no token spans that boundary: harmless for byte-level BPE (Llama 3,
Qwen, the bundled tokenizer), whose pre-tokenizer splits after the template's final newline or
special token anyway, so the ids equal tokenizing the whole text; SentencePiece tokenizers
that prefix every call with a space (Llama 2, Mistral) start each response with one.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ligertune.catalog.formats import FORMAT_FIELDS, UNPACKED_FORMATS
from ligertune.data.chat import ChatOptions, Segments, chat_segments, end_of_turn
from ligertune.errors import DataError, shown

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]
    # A row with no response text to learn from (an empty output or completion, a conversation
    # without an assistant turn): only the EOS, or nothing, would be trained. Counted and refused
    # by the pipeline, as a dataset that "trains" on such rows teaches nothing.
    empty: bool = False


# (where the row is, for messages: "<file>, row <k>"; the row)
Rows = Iterable[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Located:
    """How messages name a dataset and its rows, and how its values are stored.

    `name` is the dataset (a file, a directory, a hub id and split). A directory read file by file
    (`ligertune.data.local`) lists its `files` with the position of each one's first row, so that a
    row is named by its own file and its row there, counted from 0. `json_text`: every value is
    stored as the JSON text of the value the file held, decoded here (`ligertune.data.local` says
    why)."""

    name: str
    files: tuple[tuple[str, int], ...] = ()
    json_text: bool = False

    def __str__(self) -> str:
        return self.name

    def where(self, index: int) -> str:
        """``<file>, row <k>`` for row `index` of the dataset."""
        if not self.files:
            return f"{self.name}, row {index}"
        name, start = self.files[bisect.bisect_right([s for _, s in self.files], index) - 1]
        return f"{name}, row {index - start}"

    def value(self, stored: Any) -> Any:
        return json.loads(stored) if self.json_text and stored is not None else stored

    def row(self, index: int, row: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Row `index` of the dataset, as `Rows` hold it: named, its values decoded."""
        return self.where(index), {c: self.value(v) for c, v in row.items()}

    def rows(self, batch: dict[str, list], numbers: Iterable[int]) -> list[tuple[str, dict[str, Any]]]:
        """A `datasets.map` batch as `Rows`: its k-th row is row `numbers[k]` of the dataset."""
        columns = list(batch)
        return [self.row(n, {c: batch[c][k] for c in columns}) for k, n in enumerate(numbers)]


def teaches_nothing(segments: Segments) -> bool:
    """No trained segment holds any text (module docstring of the pipeline: refused with counts)."""
    return not any(text for text, trained in segments if trained)


def alpaca_prompt(instruction: str, input: str = "") -> str:
    if input:
        return ALPACA_PROMPT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


FORMATS = ("alpaca", "prompt_completion", "chat", "sharegpt", "pretokenized", "preference", "kto", "prompt")
# UNPACKED_FORMATS (the catalog's): pairs trained together (`ligertune.data.preference`) and
# prompts whose completions are generated (`ligertune.data.prompts`), tokenised there.


def canonical_format(fmt: str) -> str:
    """``messages`` is another name for ``chat`` (the OpenAI layout)."""
    return "chat" if fmt == "messages" else fmt


def default_messages_field(fmt: str) -> str:
    return "conversations" if canonical_format(fmt) == "sharegpt" else "messages"


def columns_for(fmt: str, messages_field: str | None = None) -> tuple[list[str], list[str]]:
    """(required, optional) columns of a format (after `rename_columns`)."""
    fmt = canonical_format(fmt)
    required, optional = FORMAT_FIELDS[fmt]
    if fmt in ("chat", "sharegpt"):
        required = (messages_field or default_messages_field(fmt),)
    return list(required), list(optional)


def chat_options(fmt: str, columns: dict | None, roles: dict | None, think_blocks: str) -> ChatOptions | None:
    """How a source of a conversation format reads its messages; None for the other formats."""
    fmt = canonical_format(fmt)
    if fmt not in ("chat", "sharegpt"):
        return None
    return ChatOptions.for_source(fmt == "sharegpt", columns or {}, roles or {}, think_blocks)


def column_renames(columns: dict[str, str] | None, found: list[str], source: str) -> dict[str, str]:
    """``data.columns`` as {dataset column: field} renames, checked against the dataset's columns
    `found` (the message keys ``role``/``content`` are read inside each message instead): a
    mapped column the dataset lacks, or a field it already has besides, is a DataError naming it."""
    renames = {column: field for field, column in (columns or {}).items() if field not in ("role", "content")}
    missing = [column for column in renames if column not in found]
    if missing:
        fields = ", ".join(f"{renames[c]}: {c}" for c in missing)
        raise DataError(
            f"{source}: data.columns maps {fields}, but the dataset has no column "
            f"{', '.join(map(repr, missing))}; its columns: {', '.join(map(shown, found)) or 'none'}"
        )
    clash = [field for column, field in renames.items() if field in found and field not in renames]
    if clash:
        raise DataError(
            f"{source}: data.columns renames a column to {', '.join(clash)}, which the dataset already has; "
            "map that field to one column only"
        )
    return renames


def rename_columns(dataset, columns: dict[str, str] | None, source: str):
    """`dataset` with the columns ``data.columns`` maps renamed to the format's field names."""
    if not any(field not in ("role", "content") for field in columns or {}):
        return dataset
    # A stream's features may be unknown: its first row names the columns then.
    found = list(dataset.column_names if dataset.column_names is not None else next(iter(dataset.take(1))))
    renames = column_renames(columns, found, source)
    return dataset.rename_columns(renames) if renames else dataset


def check_columns(fmt: str, found: Sequence[str], source: str, messages_field: str | None = None) -> None:
    required, optional = columns_for(fmt, messages_field)
    missing = [c for c in required if c not in found]
    if not missing:
        return
    expected = ", ".join(required) + (f" (optional: {', '.join(optional)})" if optional else "")
    hint = _format_hint(fmt, found, messages_field)
    raise DataError(
        f"{source}: data.format {fmt} expects columns {expected}; found {', '.join(map(shown, found)) or 'none'}"
        f" (missing {', '.join(missing)}){hint}"
    )


def _format_hint(fmt: str, found: Sequence[str], messages_field: str | None) -> str:
    """Point at the setting that probably fixes a column mismatch."""
    for other in FORMATS:
        if other != canonical_format(fmt) and all(c in found for c in columns_for(other)[0]):
            return f"; the columns fit data.format: {other}"
    if canonical_format(fmt) in ("chat", "sharegpt"):
        lists = [c for c in found if c in ("conversations", "conversation", "dialog", "chat", "turns")]
        if lists:
            return f"; if {lists[0]} holds the messages, set data.columns: {{{columns_for(fmt)[0][0]}: {lists[0]}}}"
    missing = [c for c in columns_for(fmt, messages_field)[0] if c not in found]
    return f"; or name the dataset's own columns: data.columns: {{{', '.join(f'{c}: ...' for c in missing)}}}"


# --------------------------------------------------------------------------------------------
# Tokenizing text segments (alpaca and chat)
# --------------------------------------------------------------------------------------------


def special_affixes(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids a tokenizer adds around plain text (e.g. BOS for Llama, nothing for Qwen)."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def encode_segments(
    tokenizer: PreTrainedTokenizerBase,
    samples: list[Segments],
    *,
    train_on_inputs: bool,
    add_special_tokens: bool,
    add_eos: bool = True,
) -> list[Sample]:
    """Tokenize every sample's segments in one batched call, label them, and end with EOS.

    Untrained segments are labelled −100 unless `train_on_inputs`. With `add_special_tokens`
    the tokenizer's own prefix (BOS) and suffix wrap the sample; chat templates write their
    own. EOS is appended (with `add_eos`: a chat template whose end-of-turn marker is EOS has
    written it already) unless the sample already ends with it, and is labelled when the last
    segment is, so the model learns to stop after a response.
    """
    eos = tokenizer.eos_token_id
    prefix, suffix = special_affixes(tokenizer) if add_special_tokens else ([], [])
    texts = [text for segments in samples for text, _ in segments]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    out = []
    for segments in samples:
        input_ids, labels = list(prefix), [IGNORE_INDEX] * len(prefix)
        for _, trained in segments:
            ids = next(encoded)
            input_ids += ids
            labels += ids if trained or train_on_inputs else [IGNORE_INDEX] * len(ids)
        tail = suffix if not add_eos or (input_ids + suffix)[-1:] == [eos] else suffix + [eos]
        tail_trained = train_on_inputs or bool(segments and segments[-1][1])
        input_ids += tail
        labels += tail if tail_trained else [IGNORE_INDEX] * len(tail)
        out.append(Sample(input_ids, labels, empty=not train_on_inputs and teaches_nothing(segments)))
    return out


def alpaca_segments(rows: Rows) -> list[Segments]:
    samples = []
    for where, row in rows:
        instruction, input_, output = row["instruction"], row.get("input") or "", row["output"]
        for name, value in (("instruction", instruction), ("input", input_), ("output", output)):
            if not isinstance(value, str):
                raise DataError(f"{where}: {name} must be text, got {type(value).__name__}")
        samples.append([(alpaca_prompt(instruction, input_), False), (output, True)])
    return samples


def prompt_completion_segments(rows: Rows) -> list[Segments]:
    samples = []
    for where, row in rows:
        for name in ("prompt", "completion"):
            if not isinstance(row[name], str):
                raise DataError(f"{where}: {name} must be text, got {type(row[name]).__name__}")
        samples.append([(row["prompt"], False), (row["completion"], True)])
    return samples


def kto_label(row: dict[str, Any], where: str) -> int:
    """A ``kto`` row's label as 1 (desirable) or 0; DataError unless it is a boolean."""
    if not isinstance(row["label"], bool):
        raise DataError(f"{where}: label must be true (desirable) or false, got {row['label']!r}")
    return int(row["label"])


# What a row that teaches nothing lacks, by format (the pipeline's refusal names it).
NOTHING_TO_TEACH = {
    "alpaca": "output is empty",
    "prompt_completion": "completion is empty",
    "chat": "the conversation has no assistant turn",
    "sharegpt": "the conversation has no assistant (gpt) turn",
}


def empty_rows_message(wheres: list[str], count: int, total: int, fmt: str) -> str:
    """The refusal of rows that teach nothing (`Sample.empty`): the first, how many of how many,
    a few more."""
    what = NOTHING_TO_TEACH.get(canonical_format(fmt), "there is no response text")
    alternative = (
        "; or set data.train_on_inputs: true" if canonical_format(fmt) in ("chat", "sharegpt") else ""
    )
    if count == 1:
        return f"{wheres[0]}: {what}; there would be nothing to train on in it: remove the row{alternative}"
    others = ", ".join(wheres[1:]) + (", ..." if count > len(wheres) else "")
    return (
        f"{wheres[0]}: {what}, as in {count} of the {total} rows ({others}); there would be nothing to "
        f"train on in them: remove those rows{alternative}"
    )


# --------------------------------------------------------------------------------------------
# Pretokenized
# --------------------------------------------------------------------------------------------


def pretokenized_samples(rows: Rows, vocab_size: int) -> list[Sample]:
    """Rows used as given; labels default to the input ids (every token trained)."""
    out = []
    for where, row in rows:
        input_ids, labels = row["input_ids"], row.get("labels")
        if not isinstance(input_ids, list) or not input_ids:
            raise DataError(f"{where}: input_ids must be a non-empty list of token ids")
        _check_ids(input_ids, vocab_size, f"{where}: input_ids", allow_ignore=False)
        if labels is None:
            labels = list(input_ids)
        else:
            if not isinstance(labels, list) or len(labels) != len(input_ids):
                got = len(labels) if isinstance(labels, list) else type(labels).__name__
                raise DataError(
                    f"{where}: labels must be a list as long as input_ids ({len(input_ids)}), got {got}"
                )
            _check_ids(labels, vocab_size, f"{where}: labels", allow_ignore=True)
        out.append(Sample(list(input_ids), list(labels)))
    return out


def _check_ids(ids: list, vocab_size: int, where: str, allow_ignore: bool) -> None:
    for position, token in enumerate(ids):
        # bool is an int to Python (true would be token 1): a column of flags is not token ids.
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or not (0 <= token < vocab_size or allow_ignore and token == IGNORE_INDEX)
        ):
            allowed = f"0–{vocab_size - 1}" + (" or -100" if allow_ignore else "")
            raise DataError(f"{where}[{position}] is {token!r}; token ids must be integers in {allowed}")


def tokenize_rows(
    fmt: str,
    rows: Rows,
    tokenizer: PreTrainedTokenizerBase,
    *,
    train_on_inputs: bool,
    messages_field: str | None,
    source: str,
    chat: ChatOptions | None = None,
) -> list[Sample]:
    """Rows of one split in the given format → samples (not yet truncated). `chat`: how the
    conversation formats read their messages (default: the format's own keys and roles)."""
    fmt = canonical_format(fmt)
    if fmt in UNPACKED_FORMATS:
        raise DataError(
            f"{source}: data.format {fmt} is tokenised by ligertune.data.preference (pairs) or ligertune.data.prompts"
        )
    if fmt == "pretokenized":
        return pretokenized_samples(rows, len(tokenizer))
    if tokenizer.eos_token_id is None:
        raise DataError(f"data.format {fmt} appends an EOS token, and the tokenizer has none")
    add_eos = True
    if fmt == "alpaca":
        segments, special = alpaca_segments(rows), True
    elif fmt == "prompt_completion":
        segments, special = prompt_completion_segments(rows), True
    else:
        field = messages_field or default_messages_field(fmt)
        options = chat or ChatOptions.for_source(fmt == "sharegpt", {}, {}, "keep")
        segments = chat_segments(rows, tokenizer, field, train_on_inputs, options)
        special, add_eos = False, tokenizer.eos_token not in end_of_turn(tokenizer)
    return encode_segments(
        tokenizer, segments, train_on_inputs=train_on_inputs, add_special_tokens=special, add_eos=add_eos
    )
