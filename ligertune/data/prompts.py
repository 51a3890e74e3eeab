"""Prompt data (``data.format: prompt``): prompts whose completions the objective generates while
it trains (online RL, `ligertune.objectives.grpo`).

Columns: ``prompt`` (text, used as written after the tokenizer's BOS; or a list of ``{role,
content}`` chat messages, rendered with the chat template and its generation prompt), and
optionally ``answer`` (a reference answer, any JSON value: the ``exact_match`` reward compares
against it) and ``metadata`` (any JSON value). Both are handed to the reward functions with the
prompt's text and each completion (`ligertune.objectives.rewards`).

Truncation: a row holds the prompt and its completion, ``max_seq_len`` tokens in all, so a prompt
keeps at most ``max_seq_len − objective.max_new_tokens`` tokens (the objective's
`generated_tokens`); a longer one is cut from the left, keeping the tokenizer's BOS and the
prompt's end (the question, and the chat template's generation prompt), and counted.

Layout: one prompt per row (no packing: a recipe rule), in `PromptRows`; `PromptLoader`
collates B of them *left*-padded into [B, P] ``input_ids`` and ``attention_mask`` (so that every
row's next token is generated at the same position) and keeps the rows' text, answer and
metadata beside the tensors under ``"prompts"``, a list the device copy of the batch leaves out
(`ligertune.training.step.to_device` moves tensors only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ligertune.data.formats import Located, Rows, special_affixes
from ligertune.data.loader import Batch, MicroBatchLoader
from ligertune.data.preference import chat_messages
from ligertune.data.prepared import DataStats
from ligertune.errors import DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

PROMPTS = "prompts"  # the batch key of the rows' text, answer and metadata (a list, not a tensor)


@dataclass(frozen=True)
class Prompt:
    """What a reward function sees of a prompt besides the completion."""

    text: str  # the prompt as the model saw it (after the chat template, if any)
    answer: Any = None  # the reference answer, as the data held it
    metadata: Any = None
    where: str = ""  # "<file>, row <k>": what an error about this prompt's completion names


def _prompt_text(prompt: Any, tokenizer, where: str) -> tuple[str, bool]:
    """(the prompt's text, rendered with the chat template?) of one row: text as written, a list
    of messages with the template and its generation prompt."""
    if isinstance(prompt, str) and prompt:
        return prompt, False
    if not isinstance(prompt, list):
        raise DataError(
            f"{where}: prompt must be non-empty text or a list of {{role, content}} messages"[:300]
        )
    messages = chat_messages(prompt, "prompt", "user", where)
    if tokenizer.chat_template is None:
        raise DataError(
            f"{where}: chat messages need a chat template; set tokenizer.chat_template in the recipe"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), True


def truncate_prompt(prefix: list[int], ids: list[int], budget: int) -> tuple[list[int], bool]:
    """(prefix + prompt within `budget` tokens, truncated?): the prompt is cut from the left,
    keeping the prefix (BOS) and the prompt's end."""
    full = prefix + ids
    if len(full) <= budget:
        return full, False
    body = max(0, budget - len(prefix))
    return (prefix + ids[len(ids) - body :] if body else prefix)[:budget], True


def prompt_features() -> datasets.Features:
    """The cached columns of a prompt: its ids, its text, and the answer and metadata as JSON."""
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "text": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "metadata": datasets.Value("string"),
            "where": datasets.Value("string"),
            "truncated": datasets.Value("bool"),
            "dropped": datasets.Value("bool"),
        }
    )


def tokenize_prompts(rows: Rows, tokenizer: PreTrainedTokenizerBase, budget: int) -> list[dict[str, Any]]:
    """Rows of a ``prompt`` split → cached prompt columns (`prompt_features`), one per row."""
    rows = list(rows)
    rendered = [(where, row, *_prompt_text(row["prompt"], tokenizer, where)) for where, row in rows]
    texts = [text for _, _, text, _ in rendered]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    prefix = special_affixes(tokenizer)[0]
    out = []
    for (where, row, text, chat), ids in zip(rendered, encoded, strict=True):
        kept, truncated = truncate_prompt([] if chat else list(prefix), ids, budget)
        out.append(
            {
                "input_ids": kept,
                "text": text,
                "answer": json.dumps(row.get("answer")),
                "metadata": json.dumps(row.get("metadata")),
                "where": where,
                "truncated": truncated,
                "dropped": False,
            }
        )
    return out


def tokenize_prompt_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    rows: np.ndarray,
    tokenizer,
    max_seq_len: int,
    source: Located,
    **_,
) -> dict:
    """One `datasets.map` batch of prompt rows → cached prompt columns. `max_seq_len` is the
    prompts' budget here (the pipeline passes ``data.max_seq_len`` minus the generated tokens)."""
    numbered = source.rows(batch, (int(rows[i]) for i in indices))
    columns: dict[str, list] = {name: [] for name in prompt_features()}
    for prompt in tokenize_prompts(numbered, tokenizer, max_seq_len):
        for name, value in prompt.items():
            columns[name].append(value)
    return columns


class PromptRows:
    """The prompts of a split: row i is ``{"input_ids": [P_i] int64, "prompt": Prompt}``."""

    packed = False

    def __init__(self, ids: torch.Tensor, offsets: torch.Tensor, prompts: list[Prompt], max_seq_len: int):
        self.ids, self.offsets, self.prompts, self.max_seq_len = ids, offsets, prompts, max_seq_len

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index %= len(self)
        return {
            "input_ids": self.ids[self.offsets[index] : self.offsets[index + 1]],
            "prompt": self.prompts[index],
        }

    def __repr__(self) -> str:
        return f"PromptRows({len(self)} prompts, ≤ {self.max_seq_len} tokens with their completions)"


def prompt_rows(samples: datasets.Dataset, max_seq_len: int) -> tuple[PromptRows, DataStats]:
    """Cached prompt samples → `PromptRows` and their counts."""
    import pyarrow.compute as pc

    table = samples.with_format("arrow")[:]
    ids_col = table.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    ids = torch.from_numpy(ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    text, answer, metadata, where = (
        table.column(c).to_pylist() for c in ("text", "answer", "metadata", "where")
    )
    prompts = [
        Prompt(t, json.loads(a), json.loads(m), w)
        for t, a, m, w in zip(text, answer, metadata, where, strict=True)
    ]
    stats = DataStats(
        num_samples=len(samples),
        num_truncated=int(table.column("truncated").to_numpy(zero_copy_only=False).sum()),
        num_dropped=0,
        num_sequences=len(prompts),
        num_tokens=int(lengths.sum()),
        num_label_tokens=0,
        max_seq_len=max_seq_len,
        packed=False,
        prompts=True,
    )
    return PromptRows(ids, offsets, prompts, max_seq_len), stats


class PromptLoader(MicroBatchLoader):
    """`MicroBatchLoader` over `PromptRows`: B prompts left-padded into [B, P] ``input_ids`` and
    ``attention_mask``, and their `Prompt`s under ``"prompts"`` (module docstring)."""

    def collate(self, rows: list[dict[str, Any]]) -> Batch:
        longest = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), longest), dtype=torch.int64)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[b, longest - n :] = row["input_ids"]
            mask[b, longest - n :] = 1
        return {"input_ids": input_ids, "attention_mask": mask, PROMPTS: [row["prompt"] for row in rows]}


PromptRows.loader = PromptLoader
