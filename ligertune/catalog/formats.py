"""The data formats a recipe can name (``data.format``), as the objectives and the data layer
both need them: which rows are single sequences, which are pairs trained together, and which
are prompts whose completions the objective generates.
`ligertune.data.formats` reads each of them; the objectives (`ligertune.catalog.objectives`)
say which they train on."""

from __future__ import annotations

from typing import Literal

DataFormat = Literal[
    "alpaca",
    "chat",
    "messages",
    "sharegpt",
    "prompt_completion",
    "pretokenized",
    "preference",
    "kto",
    "prompt",
]
DATA_FORMATS: tuple[str, ...] = DataFormat.__args__
# Formats whose rows are two sequences trained together (ligertune/data/preference.py): a
# micro-batch of B of them is a [2B, S] batch.
PAIR_FORMATS = ("preference", "kto")
# Formats of prompts alone (ligertune/data/prompts.py): the objective generates the completions
# it trains on (online RL), so a row is a prompt, its reference answer and metadata.
PROMPT_FORMATS = ("prompt",)
# Formats laid out one row per sample, never packed: a pair, or a prompt to complete.
UNPACKED_FORMATS = PAIR_FORMATS + PROMPT_FORMATS
# Formats of one sequence per row.
SEQUENCE_FORMATS = tuple(f for f in DATA_FORMATS if f not in UNPACKED_FORMATS)
# The fields (columns) each format reads: (required, optional). ``messages`` is another name for
# ``chat``. `data.columns` maps these names to a dataset's own columns.
FORMAT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alpaca": (("instruction", "output"), ("input",)),
    "prompt_completion": (("prompt", "completion"), ()),
    "chat": (("messages",), ()),
    "sharegpt": (("conversations",), ()),
    "pretokenized": (("input_ids",), ("labels",)),
    "preference": (("prompt", "chosen", "rejected"), ("ref_chosen_logps", "ref_rejected_logps")),
    "kto": (("prompt", "completion", "label"), ("ref_logps", "ref_kl_logps")),
    "prompt": (("prompt",), ("answer", "metadata")),
}
# Conversation formats: `data.columns` may also name the keys inside each message, and
# `data.roles` the dataset's role names.
MESSAGE_FORMATS = ("chat", "messages", "sharegpt")
MESSAGE_KEYS = ("role", "content")
ROLES = ("system", "user", "assistant", "tool")
