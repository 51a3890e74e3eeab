"""A vision-language model's vision tower in the memory plan: how many patches a micro-batch
carries, and what the tower's forward holds. A simple model, an estimate not checked against a
measurement:

- *Patches.* The plan cannot know how many images a row holds; it takes the most it can hold,
  as it takes every row to be ``max_seq_len`` tokens: as many of the largest image
  (`VisionShape.tokens_per_image` image tokens, `VisionShape.patches_per_image` patches: Qwen-VL's
  ``data.image_max_pixels``, Gemma 3's fixed size) as fit in a row. Without a bound on the image
  (Qwen-VL, ``data.image_max_pixels`` unset) the row is taken to be image tokens only, each
  ``merge²`` patches. Fewer or smaller images need less; `assumption` is the line the plan prints.
  Llama 3.2 Vision's text holds one token per image, which bounds nothing: one image of all its
  tiles per row is assumed (`VisionShape.images_per_row`), and said. The language model's
  cross-attention over the image features (its keys and values, a few per cross-attention
  layer) is not counted.
- *Per patch and layer* (a block: norm → attention → norm → MLP, in the compute dtype): about
  eight hidden-sized tensors (both norms' inputs and outputs, q, k, v, the attention's output),
  and the MLP's intermediates (gated, as HF computes it: gate, up, the activation and the product;
  ungated: the up projection and its activation). Attention is counted as flash or FlexAttention
  keeps it (linear in the patches: the tower's images are attended in segments); our kernels on
  the tower save somewhat less than HF's modules, not counted.
- *A trainable tower* (its blocks train: no ``model.freeze: [vision]``, no LoRA) saves those
  tensors in every block until its backward, at the end of the step's backward: they are
  activations, alive at the loss and at the start of backward. Whole-layer checkpointing
  (transformers' ``gradient_checkpointing_enable`` reaches the vision blocks too) keeps only the
  blocks' inputs, in the same proportion as the decoder layers.
- *A frozen tower* saves nothing: no parameter before it or in its blocks requires grad, so
  autograd records none of its operations, and only the features it outputs enter the language
  model (a projector that trains after it, as Qwen-VL's merger inside the tower, saves its own
  input: hidden-sized, not counted). Its cost is a transient at the start of the forward, before
  any of the language model's activations exist: one block's tensors at a time (all of them, a
  slight overcount of the one block's peak), on top of the model states.
"""

from __future__ import annotations

from ligertune.catalog.shape import ModelShape, VisionShape
from ligertune.plan.setting import Setting, checkpointed_layers, compute_bytes


def images_per_row(v: VisionShape, s: Setting) -> int | None:
    """The largest images a row of ``seq_len`` tokens holds (None: no bound on an image's size),
    or the number assumed where the tokens bound nothing (`VisionShape.images_per_row`)."""
    if v.images_per_row is not None:
        return v.images_per_row
    return None if v.tokens_per_image is None else s.seq_len // v.tokens_per_image


def patches(v: VisionShape, s: Setting) -> int:
    """Patches of one micro-batch's images (`images_per_row` of the largest image in each row,
    or rows of image tokens only where an image has no bound)."""
    images = images_per_row(v, s)
    per_row = s.seq_len * v.patches_per_token if images is None else images * v.patches_per_image
    return s.rows * per_row


def block_bytes(v: VisionShape, s: Setting) -> int:
    """One vision block's tensors over the micro-batch's patches (the module docstring)."""
    mlp = (4 if v.gated else 2) * v.intermediate
    return patches(v, s) * (8 * v.hidden + mlp) * compute_bytes(s)


def vision_activation_bytes(shape: ModelShape, s: Setting) -> dict[str, int]:
    """A trainable tower's saved activations by part (none for a frozen tower or a text model)."""
    v = shape.vision
    if v is None or not v.trains:
        return {}
    n, each = patches(v, s), block_bytes(v, s)
    checkpointed = checkpointed_layers(v.layers, s) if s.whole_layers else 0
    parts = {}
    if checkpointed:
        parts[f"vision tower: {checkpointed} checkpointed blocks (their inputs, {n:,} patches)"] = (
            checkpointed * n * v.hidden * compute_bytes(s)
        )
    if v.layers - checkpointed:
        parts[f"vision tower: {v.layers - checkpointed} blocks ({n:,} patches)"] = (
            v.layers - checkpointed
        ) * each
    return parts


def frozen_tower_bytes(shape: ModelShape, s: Setting) -> int:
    """A frozen tower's transient at the start of the forward: one block's tensors (0 when the
    tower trains or there is none)."""
    v = shape.vision
    return 0 if v is None or v.trains else block_bytes(v, s)


def assumption(shape: ModelShape, s: Setting) -> str | None:
    """The line the plan prints about the images it counts (None for a text model)."""
    v = shape.vision
    if v is None:
        return None
    how = (
        "frozen: one block's forward at a time, nothing saved"
        if not v.trains
        else "trains: every block saved"
    )
    images = images_per_row(v, s)
    if images is None:
        return (
            f"vision tower ({v.layers} blocks, {how}): data.image_max_pixels is unset, so rows of "
            f"{s.seq_len} image tokens ({s.seq_len * v.patches_per_token:,} patches) are assumed, the "
            "most a row holds; set data.image_max_pixels for the bound the images really have"
        )
    if v.images_per_row is not None:
        return (
            f"vision tower ({v.layers} blocks, {how}): assumes {images} image{'s' if images != 1 else ''} of "
            f"all its tiles ({v.patches_per_image:,} patches) per row: the text's one token per image bounds "
            "nothing (more images need more); the cross-attention over the image features is not counted"
        )
    size = f"{v.max_pixels:,} pixels (data.image_max_pixels)" if v.max_pixels else "the model's fixed size"
    return (
        f"vision tower ({v.layers} blocks, {how}): assumes {images} image{'s' if images != 1 else ''} of "
        f"{size} per row, {v.tokens_per_image} image tokens and {v.patches_per_image:,} patches each: "
        f"as many as a row of {s.seq_len} tokens holds (fewer or smaller images need less)"
    )
