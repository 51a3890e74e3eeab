"""``ligertune validate --check``'s data half: the first rows of each local source tokenised as
`train` will tokenise them (`ligertune.data.peek` reads them; the format, the column mapping, the
chat template and its loss mask all run), one line per source with what came out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.data.formats import IGNORE_INDEX, canonical_format, chat_options, tokenize_rows
from ligertune.data.peek import first_rows, mapped
from ligertune.data.preference import PAIR_FORMATS, tokenize_pairs
from ligertune.data.sources import source_specs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ligertune.config import Recipe


def tokenised_sample(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """``validate --check``: the first rows of each local source tokenised as `train` will, one
    line per source with what came out (DataError for a row the tokenizer or template refuses)."""
    data = recipe.data
    lines = []
    for spec in source_specs(recipe):
        if spec.local is None:
            continue
        rows, columns, name = first_rows(spec, spec.split)
        rows, _ = mapped(rows, columns, spec, name)
        fmt = canonical_format(spec.format)
        if fmt in PAIR_FORMATS:
            pairs = tokenize_pairs(fmt, list(enumerate(rows)), tokenizer, data.max_seq_len, name)
            samples = [s for pair in pairs for s in (pair.first, pair.second)]
        else:
            samples = tokenize_rows(
                fmt,
                list(enumerate(rows)),
                tokenizer,
                train_on_inputs=data.train_on_inputs,
                messages_field=spec.messages_field,
                source=name,
                chat=chat_options(fmt, spec.columns, spec.roles, data.think_blocks),
            )
        tokens = sum(len(s.input_ids) for s in samples)
        trained = sum(label != IGNORE_INDEX for s in samples for label in s.labels)
        longest = max((len(s.input_ids) for s in samples), default=0)
        over = sum(len(s.input_ids) > data.max_seq_len for s in samples)
        untrained = sum(all(label == IGNORE_INDEX for label in s.labels) for s in samples)
        lines.append(
            f"{spec.key} ({name}): the first {len(rows)} rows tokenise to {tokens:,} tokens, {trained:,} trained; "
            f"longest {longest} of data.max_seq_len {data.max_seq_len}"
            + (f"; {over} would be truncated" if over else "")
            + (f"; {untrained} with nothing to train on (dropped)" if untrained else "")
        )
    return lines
