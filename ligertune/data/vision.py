"""Conversations with images → samples for a vision-language model (issue #32).

A row is a ``messages`` conversation (``data.format: chat``) whose message ``content`` is text or
a list of parts: ``{"type": "text", "text": ...}`` and ``{"type": "image", ...}`` with the image
as ``path`` (relative to the data file's folder, or absolute), a base64 ``data:`` URI (in
``url`` or ``image``), or nothing, for a hub dataset whose row holds the decoded images in an
``images`` column (taken in order). ``http(s)`` URLs are refused: runs are offline, and a
fetch in the middle of tokenising would make the data depend on the network.

Each sample is built in four steps, all with the model's own tools:

1. the images are opened with PIL (RGB) and run through the family's image processor. Qwen-VL:
   resized to between ``data.image_min_pixels`` and ``data.image_max_pixels`` pixels (the
   processor's own bounds when unset), ``pixel_values`` (one row per patch) and
   ``image_grid_thw``; Gemma 3: resized to the processor's fixed size, ``pixel_values``
   [images, 3, H, W]; Llama 3.2 Vision: tiled, ``pixel_values`` [images, tiles, 3, H, W],
   ``aspect_ratio_ids`` and ``aspect_ratio_mask``;
2. the conversation is rendered by the tokenizer's chat template, which writes one image
   placeholder per image, and split into trained and untrained text like a text conversation
   (`ligertune.data.chat.template_segments`: only assistant turns, with their end-of-turn token);
3. each placeholder is replaced as the model's processor does (`expand_placeholders`): Qwen-VL's
   ``<|image_pad|>`` repeated once per merged patch of its image (``t·h·w / merge²``); Gemma 3's
   ``<start_of_image>`` by the image between blank lines, ``<start_of_image>``, the config's
   ``mm_tokens_per_image`` ``<image_soft_token>`` and ``<end_of_image>``; Llama 3.2 Vision's
   ``<|image|>`` stays one token (its images are cross-attended). transformers 5.17's
   processor classes need torchvision, which a CPU install lacks; this is the one step of theirs
   we repeat;
4. the segments are tokenised; labels are −100 outside assistant text and on every vision token
   (image tokens, vision start/end), and the family's token-type input (``mm_token_type_ids``;
   Gemma 3: ``token_type_ids``) marks the image tokens (1): Qwen-VL computes its 3-D rotary
   positions from it, Gemma 3 lets each image's tokens attend to each other both ways. Llama 3.2
   Vision takes no token types; its sample holds each image's text span instead
   (``cross_attention_spans``), which `collate` turns into the batch's ``cross_attention_mask``.

A sample longer than ``data.max_seq_len`` is dropped and counted, not cut: a cut through an
image's tokens would leave the model more image features than placeholders. A broken or
missing image stops with one line naming the row and the image, or, with
``data.skip_bad_images: true``, its row is left out and counted. Rows are padded into
micro-batches (`VisionLoader`); packing is refused (`data_problem`).

The samples are cached as the text samples are (`ligertune.data.cache`: the same folder and
keys, one verified entry per key written in one rename, rank 0 building it while the others
wait), one safetensors file per split: a later run with the same inputs opens no image and runs
no processor. The key (`_Build.key`) adds to the text cache's the image processor's
configuration, the family's image tokens and the image files' sizes and modification times.
"""

from __future__ import annotations

import hashlib
import importlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ligertune.catalog.families import VisionTower
from ligertune.data.cache import (
    cache_root,
    data_keys,
    fingerprint,
    load_or_build,
    rank_zero_first,
    tokenizer_fingerprint,
)
from ligertune.data.chat import template_segments
from ligertune.data.formats import IGNORE_INDEX, default_messages_field
from ligertune.data.images import BadImage, image_files, read_conversation
from ligertune.data.loader import MicroBatchLoader
from ligertune.data.prepared import DataStats, Log, PreparedData
from ligertune.data.sources import load_split, source_fingerprint, source_specs
from ligertune.errors import DataError, RecipeError
from ligertune.paths import looks_local

if TYPE_CHECKING:
    from ligertune.config import Recipe

HOLDOUT_STREAM, SHUFFLE_STREAM = 1, 0  # as the text pipeline draws them (ligertune.data.pipeline)


@dataclass
class VisionProcessor:
    """The tokenizer and the image processor of a vision-language model, its image tokens, and
    the resize bounds the run trains with (``data.image_min_pixels`` / ``image_max_pixels``;
    None: the image processor's own), which generation then uses too."""

    tokenizer: Any
    image_processor: Any
    vision: VisionTower
    vision_ids: frozenset[int]  # never trained: the family's vision tokens (VisionTower.vision_tokens)
    tokens_per_image: int | None = None  # Gemma 3's fixed count (mm_tokens_per_image); None: per patch
    min_pixels: int | None = None
    max_pixels: int | None = None

    def save_pretrained(self, directory) -> None:
        """The tokenizer and the image processor into one folder (an export's), as a hub model has them."""
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.vision.image_token)

    def image_token_inputs(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a sample keeps of where its image tokens are: the model's input marking them with
        1, under the family's name for it; for a cross-attention family (which takes no token
        types), the images' text spans (`cross_attention_spans`) instead."""
        if self.vision.cross_attention:
            return cross_attention_spans(ids, self.image_token_id)
        return {self.vision.token_type_key: (ids == self.image_token_id).to(torch.int64)}

    def images(self, images: list) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(the model's image inputs, each image's count of image tokens). Qwen-VL: pixel_values
        and image_grid_thw, one token per merged patch, ``t·h·w / merge²``; Gemma 3: pixel_values
        at the processor's fixed size, ``tokens_per_image`` each; Llama 3.2 Vision: its tiles
        (pixel_values [images, max tiles, 3, H, W], zero past an image's own tiles),
        aspect_ratio_ids [images] and aspect_ratio_mask [images, max tiles], one token each (the
        processor's batch dimension, one row here, is dropped: `VisionLoader` pads the images
        of a batch's rows to their most)."""
        if not images:
            return {}, []
        if self.vision.cross_attention:
            out = self.image_processor(images=[images], return_tensors="pt")
            keys = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
            return {k: out[k][0] for k in keys}, [1] * len(images)
        if self.tokens_per_image is not None:
            # num_crops, the processor's other output, counts pan-and-scan crops: off (processor_from).
            pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
            return {"pixel_values": pixels}, [self.tokens_per_image] * len(images)
        bounds = {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v}
        vision = dict(self.image_processor(images=images, return_tensors="pt", **bounds))
        merge = self.image_processor.merge_size
        return vision, [int(grid.prod()) // merge**2 for grid in vision["image_grid_thw"]]


def load_processor(
    recipe: Recipe, vision: VisionTower, tokenizer, tokens_per_image: int | None = None
) -> VisionProcessor:
    """The recipe's image processor, from the tokenizer's source (its ``preprocessor_config.json``),
    with the tokenizer `load_tokenizer` loaded. `tokens_per_image`: the model config's fixed count
    of image tokens for a family that has one (`VisionTower.tokens_per_image_attr`)."""
    data = recipe.data
    if data.image_min_pixels or data.image_max_pixels:
        if tokens_per_image is not None:
            fixed = f"resizes every image to its image processor's fixed size ({tokens_per_image} image tokens each)"
        elif vision.cross_attention:
            fixed = "tiles every image at its image processor's tile size (image_processor.max_image_tiles tiles at most)"
        else:
            fixed = None
        if fixed:
            raise RecipeError([f"data.image_min_pixels/image_max_pixels: this model {fixed}; remove them"])
    source = recipe.tokenizer.name_or_path or recipe.model.name_or_path
    key = "tokenizer.name_or_path" if recipe.tokenizer.name_or_path else "model.name_or_path"
    location = str(recipe.resolve(source)) if looks_local(source) else source
    processor = processor_from(location, vision, tokenizer, key, tokens_per_image)
    processor.min_pixels, processor.max_pixels = data.image_min_pixels, data.image_max_pixels
    return processor


def processor_from(
    location: str, vision: VisionTower, tokenizer, key: str, tokens_per_image: int | None = None
) -> VisionProcessor:
    """The family's image processor from `location` (a folder or hub id); its vision tokens must
    be in the tokenizer's vocabulary. Errors name `key`, where the location came from."""
    if vision.tokens_per_image_attr and tokens_per_image is None:
        raise ValueError(f"processor_from: this family needs the config's {vision.tokens_per_image_attr}")
    module, _, name = vision.image_processor.rpartition(".")
    try:
        image_processor = getattr(importlib.import_module(module), name).from_pretrained(location)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{key}: cannot load an image processor from {location}: {first}") from None
    if getattr(image_processor, "do_pan_and_scan", None):
        # Gemma 3's crops would each add an image (and its tokens) that the placeholders do not count.
        raise DataError(
            f"{key}: the image processor at {location} has do_pan_and_scan on: pan-and-scan crops are not "
            "supported yet; set it to false in preprocessor_config.json"
        )
    unknown = (None, tokenizer.unk_token_id)
    missing = [t for t in vision.vision_tokens if tokenizer.convert_tokens_to_ids(t) in unknown]
    if missing:
        raise DataError(f"{key}: the tokenizer at {location} lacks the vision tokens {', '.join(missing)}")
    ids = frozenset(tokenizer.convert_tokens_to_ids(t) for t in vision.vision_tokens)
    return VisionProcessor(tokenizer, image_processor, vision, ids, tokens_per_image)


def prompt_inputs(processor: VisionProcessor, messages: list[dict], images: list) -> dict[str, torch.Tensor]:
    """A conversation with images as the model's inputs for generation ([1, S] and the images),
    the chat template's generation prompt at its end; placeholders expanded as in training."""
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vision, counts = processor.images(images)
    [(text, _)] = expand_placeholders([(text, False)], processor.vision, counts, "--image")
    ids = torch.tensor(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    sample = {"input_ids": ids, "labels": ids, **processor.image_token_inputs(ids), **vision}
    batch = collate([sample], pad_token_id=0)  # one row: nothing is padded
    del batch["labels"]
    return batch


def data_problem(recipe: Recipe) -> str | None:
    """Why this recipe's data cannot go to a vision-language model as it is, or None."""
    data = recipe.data
    if data.packing:
        return (
            "data.packing: rows with images are padded, not packed (Qwen-VL computes its 3-D rotary positions, "
            "Gemma 3 its bidirectional image attention, per row from the image tokens, which packed samples "
            "would share); set data.packing: false"
        )
    if data.streaming:
        return "data.streaming: not supported for vision-language models yet; set data.streaming: false"
    if data.roles or {"role", "content"} & set(data.columns):
        return "data.roles, data.columns.role/content: not supported for rows with images yet; use role and content"
    if data.think_blocks != "keep":
        return "data.think_blocks: only keep is supported for rows with images yet"
    if data.format != "chat":
        return f"data.format: {data.format}: a vision-language model trains on chat (messages) rows with image parts"
    return None


def cross_attention_spans(ids: torch.Tensor, image_token_id: int) -> dict[str, torch.Tensor]:
    """``cross_attention_spans`` [images, 2]: the text span (start, end) each image of a row is
    seen from, by a cross-attention family's processor's rule (``MllamaProcessor``'s
    ``get_cross_attention_token_mask``: from its image token up to the next image's, the last to
    the end, −1 where the only image's span runs to the end of the padded text; consecutive
    image tokens all reach the text after them). Kept per sample instead of the dense
    ``cross_attention_mask`` [text, images, tiles], whose image count differs between rows and
    which `collate` builds for the batch's padded length (`cross_attention_mask`). Nothing for a
    row without images."""
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    spans = get_cross_attention_token_mask(ids.tolist(), image_token_id)
    return {"cross_attention_spans": torch.tensor(spans, dtype=torch.int64)} if spans else {}


def cross_attention_mask(rows: list[dict[str, torch.Tensor]], length: int) -> torch.Tensor:
    """The dense ``cross_attention_mask`` [B, length, images, max tiles] of rows with
    ``cross_attention_spans`` (1: the token sees that tile of that image; a row's missing images
    and an image's missing tiles 0), by the processor's own conversion
    (``convert_sparse_cross_attention_mask_to_dense``), each image's tile count from its
    ``aspect_ratio_mask``."""
    from transformers.models.mllama.processing_mllama import convert_sparse_cross_attention_mask_to_dense

    spans = [row["cross_attention_spans"].tolist() if "cross_attention_spans" in row else [] for row in rows]
    tiles = [row["aspect_ratio_mask"].sum(-1).tolist() if "aspect_ratio_mask" in row else [] for row in rows]
    max_tiles = next(row["aspect_ratio_mask"].shape[-1] for row in rows if "aspect_ratio_mask" in row)
    return torch.from_numpy(convert_sparse_cross_attention_mask_to_dense(spans, tiles, max_tiles, length))


def expand_placeholders(segments, vision: VisionTower, counts: list[int], where: str):
    """Each image placeholder in the rendered text replaced by the family's image sequence with
    `counts[i]` image tokens for image i, as the model's processor does."""
    placeholder = vision.placeholder or vision.image_token
    found = sum(text.count(placeholder) for text, _ in segments)
    if found != len(counts):
        raise DataError(
            f"{where}: the chat template wrote {found} image placeholder(s) {placeholder} for {len(counts)} image(s); "
            "use the model's chat template"
        )
    left = iter(counts)
    out = []
    for text, trained in segments:
        pieces = text.split(placeholder)
        expanded = pieces[0] + "".join(
            vision.image_sequence.format(tokens=vision.image_token * next(left)) + piece
            for piece in pieces[1:]
        )
        out.append((expanded, trained))
    return out


def encode_row(
    processor: VisionProcessor, row: dict, messages_field: str, where: str, base: Path | None, recipe: Recipe
) -> dict[str, torch.Tensor]:
    """One row → its sample tensors: input_ids, labels, the token types, and the image inputs."""
    messages, images = read_conversation(row[messages_field], where, base, row.get("images") or [])
    if messages[0]["role"] == "assistant":
        raise DataError(
            f"{where}: the conversation starts with an assistant turn; start it with a user message"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn to train on")
    tokenizer = processor.tokenizer
    segments = template_segments(tokenizer, messages, where, recipe.data.train_on_inputs)
    vision, counts = processor.images(images)
    segments = expand_placeholders(segments, processor.vision, counts, where)
    input_ids: list[int] = []
    labels: list[int] = []
    for ids, (_, trained) in zip(
        tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"],
        segments,
        strict=True,
    ):
        input_ids += ids
        labels += [i if trained and i not in processor.vision_ids else IGNORE_INDEX for i in ids]
    labels[0] = IGNORE_INDEX  # nothing predicts the first token (as the text pipeline masks it)
    ids = torch.tensor(input_ids, dtype=torch.int64)
    return {
        "input_ids": ids,
        "labels": torch.tensor(labels, dtype=torch.int64),
        **processor.image_token_inputs(ids),
        **vision,
    }


# A sample's per-token tensors (padded into [B, S]; the token types with 0, text); its other
# tensors are its images' inputs, concatenated over the rows, or for a cross-attention family
# (`cross_attention_spans` in the sample) stacked per row.
TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")


def collate(rows: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Samples → one padded batch (`VisionLoader`; generation's prompt, one row)."""
    longest = max(len(row["input_ids"]) for row in rows)
    token_types = [k for k in TOKEN_TYPE_KEYS if any(k in row for row in rows)]
    batch = {
        "input_ids": torch.full((len(rows), longest), pad_token_id, dtype=torch.int64),
        "labels": torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.int64),
        "attention_mask": torch.zeros((len(rows), longest), dtype=torch.int64),
        **{k: torch.zeros((len(rows), longest), dtype=torch.int64) for k in token_types},
    }
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        for name in ("input_ids", "labels", *token_types):
            batch[name][b, :n] = row[name]
        batch["attention_mask"][b, :n] = 1
    with_images = [row for row in rows if "pixel_values" in row]
    if not with_images:
        return batch
    if any("cross_attention_spans" in row for row in with_images):
        # Cross-attention (Llama 3.2 Vision): each row's images [B, images, ...], padded to the
        # batch's most as the processor pads a batch: zero pixels and aspect ratio id, and an
        # aspect_ratio_mask of its first tile only (the processor's, so that the tower's
        # attention over a padded image is not empty); no token sees a padded image.
        most = max(len(row["pixel_values"]) for row in with_images)
        for name in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"):
            shape = next(row[name].shape[1:] for row in with_images)
            batch[name] = torch.zeros((len(rows), most, *shape), dtype=with_images[0][name].dtype)
            for b, row in enumerate(rows):
                if name in row:
                    batch[name][b, : len(row[name])] = row[name]
        batch["aspect_ratio_mask"][..., 0] = 1
        batch["cross_attention_mask"] = cross_attention_mask(rows, longest)
        return batch
    for name in [k for k in with_images[0] if k not in batch]:
        batch[name] = torch.cat([row[name] for row in with_images])
    return batch


class VisionLoader(MicroBatchLoader):
    """Padded micro-batches of `VisionRows` (`collate`): input_ids, labels, attention_mask and
    the token types [B, S]; the images of all rows concatenated (Qwen-VL: pixel_values
    [patches, D], image_grid_thw [images, 3]; Gemma 3: pixel_values [images, 3, H, W]), in row
    order as the model reads them; Llama 3.2 Vision: per row (pixel_values [B, images, tiles, 3,
    H, W], aspect_ratio_ids, aspect_ratio_mask) with the cross_attention_mask [B, S, images,
    tiles]. No position_ids: Qwen-VL computes its 3-D positions from the image tokens."""

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(rows, self.pad_token_id)


class VisionRows(list):
    """The samples of one split, each a dict of tensors; `loader_class` reads its ``loader``."""

    loader = VisionLoader


def build_vision_datasets(
    recipe: Recipe,
    processor: VisionProcessor,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] | None = None,
    log: Log | None = None,
) -> PreparedData:
    """The recipe's train and validation samples for a vision-language model (module docstring):
    ``data.split`` shuffled (seeded) and cut to ``data.max_samples``; validation from
    ``data.validation_split``, else ``data.validation_fraction`` of the samples held out. Cached
    as the text samples are (`ligertune.data.cache`; `is_main` and `barrier` as for
    `ligertune.data.pipeline.build_datasets`), unless ``data.cache`` is false."""
    say: Log = log if (log is not None and is_main) else (lambda message: None)
    build = _Build(recipe, processor, _source(recipe), say)
    data = recipe.data
    if data.cache:
        directory = cache_root(data) / build.key()
        splits, meta, _ = rank_zero_first(
            lambda: load_or_build(directory, build.save, say, "processed", _read_samples), is_main, barrier
        )
    else:
        directory = None
        splits, meta = build.samples()
    if meta["skipped"]:
        say(
            f"warning: skipped {meta['skipped']} row(s) with a bad image (data.skip_bad_images); "
            f"first: {meta['first_skipped']}"
        )
    train = VisionRows(splits["train"])
    validation = VisionRows(splits["validation"]) if "validation" in splits else None
    stats = _stats(train, data.max_seq_len, meta["rows"], meta["too_long"])
    if validation is not None:
        stats.validation = _stats(validation, data.max_seq_len, len(validation), 0)
    fingerprint = {"samples": meta["samples"], **meta["splits"]}
    return PreparedData(train, validation, stats, directory, fingerprint)


def vision_cache_entry(
    recipe: Recipe, processor: VisionProcessor, log: Log | None = None
) -> tuple[Path, bool]:
    """Build the recipe's cache entry ahead of training (``ligertune preprocess``); returns its
    folder and whether it was already there."""
    say: Log = log or (lambda message: None)
    build = _Build(recipe, processor, _source(recipe), say)
    directory = cache_root(recipe.data) / build.key()
    _, _, existed = load_or_build(directory, build.save, say, "processed", _read_samples)
    return directory, existed


def _source(recipe: Recipe):
    """The recipe's one data source; RecipeError for what a vision-language run refuses."""
    problem = data_problem(recipe)
    if problem:
        raise RecipeError([problem])
    specs = source_specs(recipe)
    if len(specs) != 1:
        raise RecipeError(["data.mix: a vision-language run reads one dataset (data.path) for now"])
    return specs[0]


class _Build:
    """The samples of a recipe's splits, and the cache key that says which inputs made them."""

    def __init__(self, recipe: Recipe, processor: VisionProcessor, spec, log: Log):
        self.recipe, self.processor, self.spec, self.log = recipe, processor, spec, log
        data = recipe.data
        self.dataset, self.located = load_split(spec, spec.split)
        rows = np.arange(len(self.dataset))
        if data.shuffle:
            rows = np.random.default_rng([recipe.seed, SHUFFLE_STREAM]).permutation(rows)
        if data.max_samples is not None:
            rows = rows[: data.max_samples]
        self.rows = rows.tolist()
        self.held_out = None if data.validation_split is None else load_split(spec, data.validation_split)

    def key(self) -> str:
        """The cache entry's name: a hash of everything the samples depend on. As for text, the
        source (its file's path, size and modification time, or the hub snapshot), the tokenizer
        with its chat template, the data keys that change samples (``max_seq_len``, the resize
        bounds, ``skip_bad_images``, the selection and validation keys) and the seed; and here the
        image processor's whole configuration, the family's image tokens, the fixed count of image
        tokens, and the size and modification time of every image file the chosen rows name (an
        image replaced under the same name is a new sample). No image is opened to compute it."""
        processor, spec = self.processor, self.spec
        image_processor = processor.image_processor.to_json_string()
        return fingerprint(
            {
                "sources": [{**asdict(spec), "data": source_fingerprint(spec, self.dataset)}],
                "images": self.image_stats(),
                "tokenizer": tokenizer_fingerprint(processor.tokenizer),
                "image_processor": hashlib.sha256(image_processor.encode()).hexdigest(),
                "vision": asdict(processor.vision),
                "tokens_per_image": processor.tokens_per_image,
                "data": data_keys(self.recipe.data),
                "seed": self.recipe.seed,
            }
        )

    def image_stats(self) -> str:
        """sha256 of (path, size, modification time) of each image file of the chosen rows, in
        order (a missing file as such: its row fails or is skipped when the samples are built)."""
        digest = hashlib.sha256()
        field = self.spec.messages_field or default_messages_field("chat")
        base = _image_base(self.spec)
        chosen = [(self.dataset, self.located, self.rows)]
        if self.held_out is not None:
            chosen.append((*self.held_out, range(len(self.held_out[0]))))
        for dataset, located, rows in chosen:
            messages = dataset.select_columns([field])[field]  # not the images column: nothing decoded
            for index in rows:
                for path in image_files(located.value(messages[index]), base):
                    try:
                        stat = path.stat()
                        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
                    except OSError:
                        digest.update(f"{path}\0missing\0".encode())
        return digest.hexdigest()

    def samples(self) -> tuple[dict[str, list[dict[str, torch.Tensor]]], dict[str, Any]]:
        """Every split's samples, and the meta the cache keeps with them: the counts the log
        and the stats report, and the digest a checkpoint records."""
        data, start = self.recipe.data, time.perf_counter()
        encode = _Encoder(self.processor, self.recipe, self.spec)
        samples = encode(self.dataset, self.located, self.rows)
        validation = None
        if self.held_out is not None:
            validation = encode(*self.held_out, range(len(self.held_out[0])))
        elif data.validation_fraction > 0:
            held = max(1, round(len(samples) * data.validation_fraction))
            if held >= len(samples):
                raise DataError(
                    f"{self.located}: data.validation_fraction {data.validation_fraction} leaves nothing to train on"
                )
            rng = np.random.default_rng([self.recipe.seed, HOLDOUT_STREAM])
            chosen = set(rng.choice(len(samples), held, replace=False).tolist())
            validation = [s for i, s in enumerate(samples) if i in chosen]
            samples = [s for i, s in enumerate(samples) if i not in chosen]
        if not samples:
            raise DataError(
                f"{self.located}: no sample left to train on ({len(encode.skipped)} with bad images, "
                f"{encode.too_long} longer than data.max_seq_len)"
            )
        splits = {"train": samples} | ({"validation": validation} if validation is not None else {})
        images = sum(_image_count(s) for s in samples)
        self.log(
            f"processed {len(self.rows):,} rows with {images:,} images in {time.perf_counter() - start:.1f} s"
        )
        meta = {
            "splits": {name: len(split) for name, split in splits.items()},
            "samples": _digest(splits),
            "rows": len(self.rows),
            "too_long": encode.too_long,
            "skipped": len(encode.skipped),
            "first_skipped": encode.skipped[0] if encode.skipped else None,
        }
        return splits, meta

    def save(self, work: Path) -> dict[str, Any]:
        """The samples into `work` for `ligertune.data.cache.write_entry`: one safetensors file
        per split. Each tensor name holds its samples' tensors concatenated along the first
        dimension (``values/<name>``) and their lengths there (``lengths/<name>``; −1 where a
        sample has none, as a row without images has no ``pixel_values``). safetensors holds
        integer and float tensors of any shape and its reader runs no code (no pickle)."""
        from safetensors.torch import save_file

        splits, meta = self.samples()
        for name, rows in splits.items():
            keys = sorted({k for row in rows for k in row})
            tensors = {}
            for k in keys:
                tensors[f"values/{k}"] = torch.cat([row[k] for row in rows if k in row]).contiguous()
                tensors[f"lengths/{k}"] = torch.tensor([len(row[k]) if k in row else -1 for row in rows])
            save_file(tensors, str(work / f"{name}.safetensors"))
        return meta


def _read_samples(directory: Path, splits: list[str]) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The samples `_Build.save` wrote, each tensor a view into its split's tensors. The files
    are read into memory, not mapped: the samples are then those the digests just verified, and
    a file changed on disk during the run (or truncated: a mapped page past its end is a
    SIGBUS) cannot change or crash them."""
    from safetensors.torch import load

    loaded = {}
    for name in splits:
        tensors = load((directory / f"{name}.safetensors").read_bytes())
        keys = [k.removeprefix("values/") for k in tensors if k.startswith("values/")]
        rows: list[dict[str, torch.Tensor]] = []
        for k in keys:
            lengths = tensors[f"lengths/{k}"].tolist()
            if not rows:
                rows = [{} for _ in lengths]
            pieces = iter(tensors[f"values/{k}"].split([n for n in lengths if n >= 0]))
            for row, n in zip(rows, lengths, strict=True):
                if n >= 0:
                    row[k] = next(pieces)
        loaded[name] = rows
    return loaded


def _image_base(spec) -> Path | None:
    """The folder relative image paths start from: the data file's, or the data folder."""
    return None if spec.local is None else (spec.local if spec.local.is_dir() else spec.local.parent)


class _Encoder:
    """Rows of one source → samples, counting the rows left out: a bad image (with
    ``data.skip_bad_images``; else a DataError naming the row) or longer than ``data.max_seq_len``."""

    def __init__(self, processor: VisionProcessor, recipe: Recipe, spec):
        self.processor, self.recipe = processor, recipe
        self.base = _image_base(spec)
        self.field = spec.messages_field or default_messages_field("chat")
        self.skipped: list[str] = []
        self.too_long = 0

    def __call__(self, dataset, located, rows) -> list[dict[str, torch.Tensor]]:
        data, samples = self.recipe.data, []
        for index in rows:
            where, row = located.row(index, dataset[index])
            try:
                sample = encode_row(self.processor, row, self.field, where, self.base, self.recipe)
            except BadImage as e:
                if not data.skip_bad_images:
                    raise DataError(
                        f"{where}: {e}; fix it, or set data.skip_bad_images: true to leave such rows out"
                    ) from None
                self.skipped.append(f"{where}: {e}")
                continue
            if len(sample["input_ids"]) > data.max_seq_len:
                self.too_long += 1
                continue
            samples.append(sample)
        return samples


def _image_count(sample: dict[str, torch.Tensor]) -> int:
    """Qwen-VL: one image_grid_thw row per image (pixel_values holds patches); Gemma 3 and Llama
    3.2 Vision: one pixel_values entry per image."""
    if "image_grid_thw" in sample:
        return len(sample["image_grid_thw"])
    return len(sample.get("pixel_values", ()))


def _stats(rows: VisionRows, max_seq_len: int, read: int, dropped: int) -> DataStats:
    tokens = sum(len(r["input_ids"]) for r in rows)
    trained = sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows)
    return DataStats(read, 0, dropped, len(rows), tokens, trained, max_seq_len, packed=False)


def _digest(splits: dict[str, VisionRows]) -> str:
    """What a checkpoint records of the samples (as the text pipeline's digest): their tensors."""
    digest = hashlib.sha256()
    for name in sorted(splits):
        for row in splits[name]:
            for key in sorted(row):
                digest.update(key.encode())
                digest.update(row[key].contiguous().numpy().tobytes())
    return digest.hexdigest()[:20]
