"""The data section: formats, sources, mixing, streaming and the tokenised-data cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ligertune.catalog.formats import DataFormat
from ligertune.catalog.section import Section

# Upper bounds of the fields that size what the data pipeline allocates (a row of max_seq_len
# tokens; with a mix, an index of max_samples rows), far above real runs: a typo is refused by
# `validate` rather than exhausting memory.
MAX_SEQ_LEN = 2**22
MAX_SAMPLES = 2**28


class DataSource(Section):
    """One dataset of ``data.mix``; unset keys take the data section's value."""

    path: str = Field(description="Hub dataset id, or a local JSON/JSONL/Parquet/CSV file or directory.")
    weight: float = Field(
        1.0, gt=0, description="Relative share of the mix's samples (weights need not sum to 1)."
    )
    format: DataFormat | None = Field(None, description="Format of this dataset (default: data.format).")
    subset: str | None = Field(None, description="Hub config/subset (default: data.subset).")
    split: str | None = Field(None, description="Split to train on (default: data.split).")
    messages_field: str | None = Field(None, description="Messages column (default: data.messages_field).")
    columns: dict[str, str] | None = Field(
        None, description="This dataset's column names (default: data.columns)."
    )
    roles: dict[str, str] | None = Field(None, description="This dataset's role names (default: data.roles).")


class DataSection(Section):
    format: DataFormat = Field(
        "alpaca",
        description="alpaca: instruction/input/output; chat (or messages): an OpenAI-style list of "
        "{role, content}; sharegpt: a list of {from, value} (human/gpt/system); prompt_completion: "
        "prompt/completion, loss on the completion; pretokenized: input_ids[/labels]; preference: "
        "prompt/chosen/rejected (text or chat messages; dpo, orpo, simpo); kto: prompt/completion/label; "
        "prompt: prompt[/answer/metadata], completions generated in the loop (grpo).",
    )
    path: str | None = Field(
        None,
        description="Hub dataset id, or a local JSON/JSONL/Parquet/CSV file or directory (or set mix instead).",
    )
    subset: str | None = Field(
        None, description="Hub dataset config (subset) name: load_dataset(path, subset)."
    )
    mix: list[DataSource] | None = Field(
        None,
        description="Several datasets instead of path, each {path, weight, format, subset, split, "
        "messages_field, columns, roles}; samples are drawn by weight, seeded (see README).",
    )
    split: str = Field("train", description="Split to train on.")
    validation_split: str | None = Field(
        None, description="Split to evaluate on; when absent, validation_fraction is held out from train."
    )
    validation_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of the training split held out for evaluation."
    )
    max_seq_len: int = Field(
        2048,
        gt=0,
        le=MAX_SEQ_LEN,
        description="Tokens per sequence; longer samples are truncated (and counted).",
    )
    packing: bool = Field(
        True, description="Concatenate samples into max_seq_len rows, attention kept within each sample."
    )
    train_on_inputs: bool = Field(False, description="Also compute the loss on prompt tokens.")
    messages_field: str | None = Field(
        None,
        description="Column holding the conversation (default: messages for chat, conversations for sharegpt).",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="The dataset's own name for each field the format reads, e.g. {instruction: question, "
        "output: answer} (alpaca), {prompt: query, completion: response}; chat and sharegpt also name "
        "the keys inside each message: {messages: dialog, role: speaker, content: text}.",
    )
    roles: dict[str, str] = Field(
        default_factory=dict,
        description="chat/sharegpt: the dataset's role names as system, user, assistant or tool, e.g. "
        "{human: user, bot: assistant} (sharegpt already reads human, gpt and system).",
    )
    think_blocks: Literal["keep", "mask", "strip"] = Field(
        "keep",
        description="Reasoning in assistant turns (<think>...</think>, chat formats): keep (trained as "
        "written), mask (in the text, out of the loss) or strip (removed before the template renders).",
    )
    max_samples: int | None = Field(
        None,
        gt=0,
        le=MAX_SAMPLES,
        description="Use only the first N samples (after shuffling); with mix: the mix's size.",
    )
    shuffle: bool = Field(True, description="Shuffle samples (seeded by the recipe seed).")
    streaming: bool = Field(
        False,
        description="Read and tokenise the data on the fly (load_dataset(streaming=True)) instead of "
        "tokenising it all first; needs training.max_steps.",
    )
    cache: bool = Field(
        True,
        description="Keep the tokenised samples (a vision-language model's processed samples too) on disk "
        "and reuse them while the inputs are unchanged.",
    )
    image_min_pixels: int | None = Field(
        None,
        gt=0,
        le=2**26,
        description="Vision-language models: images smaller than this many pixels are scaled up to it "
        "(default: the image processor's min_pixels).",
    )
    image_max_pixels: int | None = Field(
        None,
        gt=0,
        le=2**26,
        description="Vision-language models: images larger than this many pixels are scaled down to it "
        "(default: the image processor's max_pixels); fewer pixels, fewer image tokens.",
    )
    skip_bad_images: bool = Field(
        False,
        description="Vision-language models: leave out (and count) rows whose image is missing or "
        "unreadable, instead of stopping at the first one.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where tokenised samples are cached (default: $LIGERTUNE_DATA_CACHE, else "
        "~/.cache/ligertune/datasets).",
    )
