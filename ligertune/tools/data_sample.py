"""``ligertune validate --check``'s data half: the first rows of each local source tokenised as
`train` will tokenise them (`ligertune.data.peek` reads them; the format, the column mapping, the
chat template and its loss mask all run), one line per source with what came out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ligertune.catalog.formats import PAIR_FORMATS, PROMPT_FORMATS
from ligertune.data.formats import IGNORE_INDEX, canonical_format, chat_options, tokenize_rows
from ligertune.data.peek import first_rows, mapped
from ligertune.data.preference import tokenize_pairs
from ligertune.data.prompts import tokenize_prompts
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
        named = [(f"{name}, row {index}", row) for index, row in enumerate(rows)]
        fmt = canonical_format(spec.format)
        if fmt in PROMPT_FORMATS:  # the completions are generated: the prompts have a budget of their own
            budget = data.max_seq_len - recipe.objective.generated_tokens()
            prompts = tokenize_prompts(named, tokenizer, budget)
            cut = sum(p["truncated"] for p in prompts)
            lines.append(
                f"{spec.key} ({name}): the first {len(rows)} prompts tokenise to "
                f"{sum(len(p['input_ids']) for p in prompts):,} tokens; longest "
                f"{max((len(p['input_ids']) for p in prompts), default=0)} of the prompt budget {budget}"
                + (f"; {cut} cut from the left" if cut else "")
            )
            continue
        if fmt in PAIR_FORMATS:
            pairs = tokenize_pairs(fmt, named, tokenizer, data.max_seq_len)
            samples = [s for pair in pairs for s in (pair.first, pair.second)]
        else:
            samples = tokenize_rows(
                fmt,
                named,
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
        untrained = sum(s.empty for s in samples)
        lines.append(
            f"{spec.key} ({name}): the first {len(rows)} rows tokenise to {tokens:,} tokens, {trained:,} trained; "
            f"longest {longest} of data.max_seq_len {data.max_seq_len}"
            + (f"; {over} would be truncated" if over else "")
            + (f"; {untrained} with nothing to train on (train refuses them)" if untrained else "")
        )
    return lines
