"""Preference and KTO data: rows of two sequences trained together.

Formats (columns; the prompt and responses are plain text, or chat messages):

* ``preference``: ``prompt``, ``chosen``, ``rejected`` (DPO, IPO, ORPO, SimPO). Plain text is used
  as written: the tokenizer's BOS, the prompt, the response, EOS. Chat: ``prompt`` is a list of
  ``{role, content}`` messages (a string is read as one user message) and ``chosen``/``rejected``
  are the assistant's reply (a list of messages, or a string read as one assistant message),
  rendered with the tokenizer's chat template; the response is the text the template adds after
  the prompt rendered with a generation prompt. Optional ``ref_chosen_logps``,
  ``ref_rejected_logps``: precomputed reference log-probs (``objective.reference: precomputed``),
  which must come from the same tokenisation and truncation.
* ``kto``: ``prompt``, ``completion``, ``label`` (bool: desirable or not). KTO's reference point
  z₀ is a KL estimate on *mismatched* pairs (Ethayarajh et al. 2024; TRL builds them the same
  way): each row's second sequence is its prompt with the completion of the next row of the same
  tokenisation batch (itself in a batch of one). Optional ``ref_logps``, ``ref_kl_logps``.

Every row becomes a `PairSample`: two sequences, prompt labelled −100, responses labelled.
Truncation, per sequence ``len(prompt) + len(response) ≤ max_seq_len`` (each sequence is a row
of the micro-batch): when the longer response does not fit, the prompt is cut *from the left*
(keeping BOS and the prompt's end, next to the response), to make room for the longer response
but never below ``min(len(prompt), max_seq_len // 2)`` tokens; then each response that still
does not fit is cut from the right (losing its EOS). Both sequences keep one prompt, and each
response keeps its own length wherever it fits: they are never padded or cut to equal length.

Layout: no packing (a recipe rule refuses ``data.packing: true``): a pair is one row of the
dataset (`PairRows`), so shuffling and rank sharding keep the pair together, and `PairLoader`
collates B pairs into a [2B, S] micro-batch: rows 0..B−1 the first sequences (chosen, or the
KTO completions), rows B..2B−1 the second (rejected, or the KL completions), padded to the
longest, with ``pair_label`` [B] (KTO's desirability, 1 for preference pairs) and, when the data
has them, ``ref_logps`` [2B].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ligertune.catalog.formats import PAIR_FORMATS
from ligertune.data.formats import (
    IGNORE_INDEX,
    Located,
    Rows,
    Sample,
    kto_label,
    special_affixes,
)
from ligertune.data.loader import MicroBatchLoader
from ligertune.data.packing import SequenceDataset, layout_rows
from ligertune.data.prepared import DataStats
from ligertune.errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = ["PAIR_FORMATS", "PairLoader", "PairRows", "pair_rows", "tokenize_pairs"]

REFERENCE_COLUMNS = {
    "preference": ("ref_chosen_logps", "ref_rejected_logps"),
    "kto": ("ref_logps", "ref_kl_logps"),
}


@dataclass
class PairSample:
    first: Sample  # chosen, or the KTO completion
    second: Sample  # rejected, or the KTO KL completion
    label: int  # KTO: 1 desirable, 0 undesirable; preference: 1
    ref_logps: list[float]  # [first, second] or empty
    truncated: bool


# --------------------------------------------------------------------------------------------
# Tokenising
# --------------------------------------------------------------------------------------------


def _text(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: {name} must be non-empty text, got {value!r}"[:300])
    return value


def chat_messages(value: Any, name: str, role: str, where: str) -> list[dict]:
    """Column `name` as chat messages: a list of ``{role, content}`` (checked), or text read as one
    message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": _text(value, name, where)}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {name} must be text or a non-empty list of {{role, content}} messages")
    for i, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"{where}: message {i} of {name} needs text fields role and content, got {message!r}"[:300]
            )
    return value


def _render_pair(tokenizer, prompt, responses, names, where) -> tuple[str, list[str], bool]:
    """(prompt text, response texts, chat?) of one row."""
    chat = isinstance(prompt, list) or any(isinstance(r, list) for r in responses)
    if not chat:
        return (
            _text(prompt, "prompt", where),
            [_text(r, n, where) for r, n in zip(responses, names, strict=True)],
            False,
        )
    if tokenizer.chat_template is None:
        raise DataError(
            f"{where}: chat messages need a chat template; set tokenizer.chat_template in the recipe"
        )
    messages = chat_messages(prompt, "prompt", "user", where)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    texts = []
    for response, name in zip(responses, names, strict=True):
        full = tokenizer.apply_chat_template(
            messages + chat_messages(response, name, "assistant", where), tokenize=False
        )
        if not full.startswith(rendered) or len(full) == len(rendered):
            raise DataError(
                f"{where}: the chat template does not render the prompt as a prefix of prompt + {name}; "
                "set tokenizer.chat_template to a prefix-stable template"
            )
        texts.append(full[len(rendered) :])
    return rendered, texts, True


def truncate_pair(
    prefix: list[int], prompt: list[int], responses: list[list[int]], max_seq_len: int
) -> tuple[list[int], list[list[int]], bool]:
    """(prompt ids, response ids, truncated?) within ``max_seq_len`` per sequence (module
    docstring): the prompt body is cut from the left first, then responses from the right."""
    longest = max(len(r) for r in responses)
    full = prefix + prompt
    if len(full) + longest <= max_seq_len:
        return full, responses, False
    keep = max(max_seq_len - longest, min(len(full), max_seq_len // 2))
    body = max(0, keep - len(prefix))
    full = (prefix + prompt[len(prompt) - body :])[:keep] if body else prefix[:keep]
    room = max_seq_len - len(full)
    return full, [r[:room] for r in responses], True


def tokenize_pairs(
    fmt: str, rows: Rows, tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> list[PairSample]:
    """Rows of a ``preference`` or ``kto`` split → truncated `PairSample`s (module docstring)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"data.format {fmt} appends an EOS token, and the tokenizer has none")
    rows = list(rows)
    if fmt == "kto":
        # The KL sample: the next row's completion (cyclically) after this row's prompt.
        completions = [row["completion"] for _, row in rows]
        shifted = completions[1:] + completions[:1]
    parsed = []
    for k, (where, row) in enumerate(rows):
        if fmt == "preference":
            responses, names, label = [row["chosen"], row["rejected"]], ("chosen", "rejected"), 1
        else:
            responses, names, label = (
                [row["completion"], shifted[k]],
                ("completion", "completion"),
                kto_label(row, where),
            )
        prompt, texts, chat = _render_pair(tokenizer, row["prompt"], responses, names, where)
        refs = [row.get(c) for c in REFERENCE_COLUMNS[fmt]]
        if any(r is not None for r in refs) and not all(_finite_number(r) for r in refs):
            raise DataError(
                f"{where}: {' and '.join(REFERENCE_COLUMNS[fmt])} must both be finite numbers, got {refs}"
            )
        parsed.append((prompt, texts, chat, label, [float(r) for r in refs] if refs[0] is not None else []))
    texts = [t for prompt, responses, *_ in parsed for t in (prompt, *responses)]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else iter(())
    prefix = special_affixes(tokenizer)[0]
    out = []
    for _prompt, _responses, chat, label, refs in parsed:
        prompt_ids = next(encoded)
        responses = [ids if ids[-1:] == [eos] else ids + [eos] for ids in (next(encoded), next(encoded))]
        full, responses, truncated = truncate_pair(
            [] if chat else list(prefix), prompt_ids, responses, max_seq_len
        )
        first, second = (Sample(full + r, [IGNORE_INDEX] * len(full) + r) for r in responses)
        out.append(PairSample(first, second, label, refs, truncated))
    return out


def _finite_number(value: Any) -> bool:
    # bool is an int to Python; NaN and infinity would make every loss of the pair non-finite.
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def pair_features() -> datasets.Features:
    """The cached columns of a pair: both sequences' ids and labels one after the other, the
    length of the first (``split``), the KTO label and the reference log-probs."""
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "split": datasets.Value("int32"),
            "pair_label": datasets.Value("int8"),
            "ref_logps": datasets.Sequence(datasets.Value("float64")),
            "truncated": datasets.Value("bool"),
            "dropped": datasets.Value("bool"),
        }
    )


def tokenize_pair_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    rows: np.ndarray,
    fmt: str,
    tokenizer,
    max_seq_len: int,
    source: Located,
    **_,
) -> dict:
    """One `datasets.map` batch of pair rows → cached pair columns (`pair_features`)."""
    numbered = source.rows(batch, (int(rows[i]) for i in indices))
    out: dict[str, list] = {name: [] for name in pair_features()}
    for pair in tokenize_pairs(fmt, numbered, tokenizer, max_seq_len):
        out["input_ids"].append(pair.first.input_ids + pair.second.input_ids)
        out["labels"].append(pair.first.labels + pair.second.labels)
        out["split"].append(len(pair.first.input_ids))
        out["pair_label"].append(pair.label)
        out["ref_logps"].append(pair.ref_logps)
        out["truncated"].append(pair.truncated)
        out["dropped"].append(False)
    return out


# --------------------------------------------------------------------------------------------
# Rows and micro-batches
# --------------------------------------------------------------------------------------------


class PairRows:
    """Pair i: rows 2i and 2i + 1 of `sequences` (one sample per row), its label and, when the
    data has them, its reference log-probs. Indexing returns ``{"first", "second", "pair_label",
    "ref_logps"?}``."""

    def __init__(self, sequences: SequenceDataset, labels: torch.Tensor, ref_logps: torch.Tensor | None):
        self.sequences, self.labels, self.ref_logps = sequences, labels, ref_logps
        self.max_seq_len, self.packed = sequences.max_seq_len, False

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index %= len(self)
        row = {
            "first": self.sequences[2 * index],
            "second": self.sequences[2 * index + 1],
            "pair_label": self.labels[index],
        }
        if self.ref_logps is not None:
            row["ref_logps"] = self.ref_logps[index]
        return row

    def __repr__(self) -> str:
        return f"PairRows({len(self)} pairs, ≤ {self.max_seq_len} tokens per sequence)"


def pair_rows(samples: datasets.Dataset, max_seq_len: int, pad_token_id: int) -> tuple[PairRows, DataStats]:
    """Cached pair samples → `PairRows`, read as flat Arrow buffers (as `pipeline._rows` does)."""
    import pyarrow.compute as pc

    table = samples.with_format("arrow")[:]
    ids_col, labels_col = (table.column(c).combine_chunks() for c in ("input_ids", "labels"))
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    split = table.column("split").to_numpy(zero_copy_only=False).astype(np.int64)
    pieces = np.stack([split, lengths - split], axis=1).reshape(-1)  # first, second, first, ...
    ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    labels = labels_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    sequences = layout_rows(ids, labels, pieces, max_seq_len, pad_token_id, packed=False)
    refs = table.column("ref_logps").to_pylist()
    ref_logps = torch.tensor(refs, dtype=torch.float64) if refs and all(len(r) == 2 for r in refs) else None
    pair_labels = torch.from_numpy(table.column("pair_label").to_numpy(zero_copy_only=False).astype(np.int64))
    stats = DataStats(
        num_samples=len(samples),
        num_truncated=int(table.column("truncated").to_numpy(zero_copy_only=False).sum()),
        num_dropped=0,
        num_sequences=len(sequences),
        num_tokens=sequences.num_tokens,
        num_label_tokens=sequences.num_label_tokens,
        max_seq_len=max_seq_len,
        packed=False,
    )
    return PairRows(sequences, pair_labels, ref_logps), stats


class PairLoader(MicroBatchLoader):
    """`MicroBatchLoader` over `PairRows`: B pairs → a padded [2B, S] micro-batch (module
    docstring), first sequences then second ones, plus ``pair_label`` and ``ref_logps``."""

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().collate([r["first"] for r in rows] + [r["second"] for r in rows])
        batch["pair_label"] = torch.stack([r["pair_label"] for r in rows])
        if all("ref_logps" in r for r in rows):
            batch["ref_logps"] = torch.stack([r["ref_logps"] for r in rows]).t().reshape(-1).float()
        return batch


PairRows.loader = PairLoader
