"""Building the model a recipe asks for, and getting it ready to train.

Two sources (the recipe validator guarantees exactly one is set):

- ``model.name_or_path``: pretrained weights from a hub id or a local directory, loaded with
  ``AutoModelForCausalLM.from_pretrained`` in the parameter dtype of the chosen precision
  (``AutoModelForImageTextToText`` for a vision-language family of the family table: the
  ``...ForConditionalGeneration`` model, vision tower, projector and language model together).
- ``model.config``: a random-init architecture, either a shipped name
  (`ligertune.catalog.architectures.SHIPPED_CONFIGS`) or a transformers config mapping with ``model_type``;
  used for benchmarks and offline runs. Initialisation is seeded by the recipe seed.

``model.config_overrides`` change config fields. For a random-init architecture they are
merged into the mapping *before* the config is built, exactly as if the mapping had said so,
so derived fields (``head_dim`` from ``hidden_size``) follow. For pretrained weights they are
set on the loaded config (shapes must then still match the checkpoint). Unknown keys are an
error, not silently stored attributes.

Parameter dtype by ``training.precision`` (see `ligertune.training` for the trade-offs):
``bf16`` → bfloat16 parameters; ``bf16-mixed`` and ``fp32`` → float32 parameters.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ligertune.catalog.families import FAMILIES, VisionTower
from ligertune.errors import RecipeError
from ligertune.models.attention import choose_attention, unsupported_backends
from ligertune.models.config import build_config, load_problem, model_source

if TYPE_CHECKING:  # the schema is a layer above: models are built from its values, never import it
    from ligertune.config import Recipe


def param_dtype(precision: str) -> torch.dtype:
    """Storage dtype of the parameters for a `training.precision` value."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def build_model(
    recipe: Recipe, device: torch.device, *, empty: bool = False, draw_on: torch.device | None = None
):
    """Load or randomly initialise the causal LM, its parameters materialised on `device`.

    ``empty=True`` builds the same architecture on the meta device instead: shapes and dtypes
    only, no memory, no weights read and no random numbers drawn (whatever the source). The
    sharded strategies use it (``parallel.sharded_init``) to shard the model before any rank
    holds it whole, then fill the shards (`ligertune.distributed.fsdp`). `device` still
    decides the attention backend, so the empty model is the one a plain build would make.

    ``draw_on`` (a random init only): draw the init's random numbers on that device, one
    module at a time, into a model held on `device` (`draw_init_on`): a sharded init's rank 0
    builds a model too large for its GPU in CPU memory this way."""
    config = build_config(recipe)
    auto = auto_class(config)
    dtype = param_dtype(recipe.training.precision)
    attention, _ = choose_attention(
        recipe.model.attn_implementation, device.type == "cuda", recipe.data.packing, config
    )
    # An explicit choice the model cannot use: one line, not transformers' traceback.
    refused = unsupported_backends(config).get(attention)
    if refused:
        raise RecipeError([f"model.attn_implementation: {attention}: {refused}; use auto (or eager)"])
    common = dict(
        dtype=dtype,
        attn_implementation=attention,
        trust_remote_code=recipe.model.trust_remote_code,
    )
    if recipe.model.quantize != "none" and not empty:
        model = _build_quantized(recipe, config, device, common)
    elif empty:
        with torch.device("meta"):
            model = auto.from_config(config, **common)
    elif recipe.model.config is None:
        from transformers.integrations import is_deepspeed_zero3_enabled

        # Under DeepSpeed's zero.Init (a sharded ZeRO-3 build) the partitions decide where
        # the weights go; transformers refuses a device_map there.
        placement = {} if is_deepspeed_zero3_enabled() else dict(device_map=str(device))
        try:
            model = auto.from_pretrained(
                model_source(recipe),
                config=config,
                revision=recipe.model.revision,
                **placement,
                **common,
                **trainable_prequantized(config),
            )
        except OSError as e:
            raise load_problem(recipe, "weights", e) from None
    elif draw_on is not None and draw_on != device:
        from transformers.initialization import no_init_weights

        torch.manual_seed(recipe.seed)
        with no_init_weights(), torch.device(device):
            model = auto.from_config(config, **common)
        draw_init_on(model, draw_on)
    else:
        torch.manual_seed(recipe.seed)
        with torch.device(device):
            model = auto.from_config(config, **common)
    # Training never decodes. More than memory is at stake: with a cache, transformers 5.17
    # builds a plain causal mask and skips the packed-sequence detection from position ids,
    # so packed samples would attend to each other.
    model.config.use_cache = False
    text_config = getattr(model.config, "text_config", None)  # a vision-language model's language model
    if text_config is not None:
        text_config.use_cache = False
    _check_loss_kwargs(model)
    return model


def draw_init_on(model: nn.Module, device: torch.device) -> None:
    """Randomly initialise `model`, built without an init (transformers' ``no_init_weights``),
    drawing the numbers on `device` one module at a time; every tensor stays where it lives.

    Why: a random init on the CPU draws from a generator that runs on one core (1.75·10⁸
    normal numbers a second on the CI machine), and a plain build draws twice (PyTorch's default
    init as each layer is constructed, then transformers' init over it): over 10 minutes for a
    70B model. On a GPU the draws take seconds, and only the copies remain (each module's
    tensors there and back, one module at a time, so the GPU holds one module's weights at most).

    How: transformers' own initialisation (`init_weights`: its traversal of the modules, every
    sub-model's `_init_weights`, then the weight tying) runs unchanged; each model's per-module
    step is wrapped to move that module's own parameters and buffers to `device` first and back
    after. The distribution is the plain build's; the numbers are not (other generator, and no
    construction-time draws before them)."""
    from transformers import PreTrainedModel

    def drawn_on_device(initialise):
        def step(module: nn.Module, *args, **kwargs) -> None:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            home = tensors[0].device if tensors else None
            if home is not None:
                module._apply(lambda t: t.to(device), recurse=False)
            try:
                initialise(module, *args, **kwargs)
            finally:
                if home is not None:
                    module._apply(lambda t: t.to(home), recurse=False)

        return step

    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    for m in models:
        m._initialize_weights = drawn_on_device(m._initialize_weights)
    try:
        model.init_weights()
    finally:
        for m in models:
            del m._initialize_weights


def trainable_prequantized(config) -> dict:
    """``from_pretrained`` arguments that make a checkpoint shipped quantised trainable. GPT-OSS
    ships its experts in MXFP4, which transformers 5.17 keeps quantised where its MXFP4 kernels
    run (and then refuses to train) and dequantises elsewhere: ``dequantize=True`` always loads
    them dequantised, in bf16, as transformers documents for fine-tuning."""
    quantized = getattr(config, "quantization_config", None)
    method = (
        quantized.get("quant_method")
        if isinstance(quantized, dict)
        else getattr(quantized, "quant_method", None)
    )
    if getattr(method, "value", method) != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def auto_class(config) -> type:
    """``AutoModelForImageTextToText`` for a vision-language family (`Family.vision`), else
    ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    family = FAMILIES.get(getattr(config, "model_type", None))
    return AutoModelForImageTextToText if family is not None and family.vision else AutoModelForCausalLM


def vision_tower(recipe: Recipe) -> VisionTower | None:
    """The recipe's model's vision tower record (`Family.vision`), None for a text model. Reads
    the config only (`ligertune.models.config.build_config`: no weights)."""
    family = FAMILIES.get(getattr(build_config(recipe), "model_type", None))
    return family.vision if family is not None else None


def tokens_per_image(config, vision: VisionTower) -> int | None:
    """The image tokens each image gets where the family fixes their count in its config
    (Gemma 3's ``mm_tokens_per_image``: its projector pools every image to that many), else None
    (Qwen-VL: one per merged patch, which the image's size decides)."""
    return getattr(config, vision.tokens_per_image_attr) if vision.tokens_per_image_attr else None


# The parts of a vision-language model `model.freeze` names, and what each is.
FREEZABLE = {
    "vision": "the vision tower without its projector",
    "projector": "the projector from vision features to the language model (Qwen-VL's merger, Gemma 3's multi_modal_projector)",
    "language_model": "the language model's decoder (embeddings, layers, final norm; not the lm_head unless tied to the embeddings, as in Gemma 3)",
}


def vision_parts(model: nn.Module) -> dict[str, list[nn.Module]] | None:
    """The `FREEZABLE` parts of a vision-language model, by name, or None for a text model."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is None or family.vision is None:
        return None
    v = family.vision
    return {
        "vision": [model.get_submodule(v.tower)],
        "projector": [model.get_submodule(path) for path in v.projectors],
        "language_model": [model.get_submodule(v.language_model)],
    }


def frozen_parameters(model: nn.Module, parts: list[str]) -> list[nn.Parameter]:
    """The parameters ``model.freeze`` stops training: those of the named parts, less those of
    a part left training that sits inside one (Qwen2.5-VL's merger inside ``model.visual``: freezing
    ``vision`` leaves it trainable), each once. The memory plan counts them as `freeze` freezes them."""
    found = vision_parts(model)
    if found is None:
        raise RecipeError(
            [
                f"model.freeze: {type(model).__name__} is not a vision-language model of the family table; remove model.freeze"
            ]
        )
    keep = {
        id(p) for part, modules in found.items() if part not in parts for m in modules for p in m.parameters()
    }
    frozen = {}
    for part in parts:
        for param in (p for m in found[part] for p in m.parameters()):
            if id(param) not in keep:
                frozen[id(param)] = param
    return list(frozen.values())


def freeze(model: nn.Module, parts: list[str]) -> str:
    """``model.freeze``: the named parts' parameters (`frozen_parameters`) stop requiring grad
    (the optimizer takes only what requires grad). Returns a line for the run log."""
    frozen = 0
    for param in frozen_parameters(model, parts):
        if param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"frozen: {', '.join(parts)} ({frozen:,} parameters); {trainable:,} parameters train"


def quantization_config(quantize: str):
    """transformers' ``BitsAndBytesConfig`` for ``model.quantize``: QLoRA's 4-bit recipe (NF4 —
    levels at the quantiles of a normal distribution, where trained weights lie; double
    quantisation — the per-64-weight absmax scales themselves quantised to 8 bits, ~0.4 bit per
    weight saved; bf16 compute — each 4-bit tile is dequantised to bf16 for the matmul), or
    LLM.int8() for 8bit. The lm_head is left out (transformers' default), so the fused linear
    cross entropy still reads a plain weight."""
    from transformers import BitsAndBytesConfig

    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _build_quantized(recipe: Recipe, config, device: torch.device, common: dict):
    """The model with its linear layers quantised by bitsandbytes as they load (``model.quantize``).

    bitsandbytes quantises weights on their way in through ``from_pretrained``. A random-init
    model (``model.config``, the benchmarks) takes the same path: it is initialised as an
    unquantised build would be (seeded, on `device`), written to a temporary folder and loaded
    back quantised, so a quantised benchmark trains the unquantised benchmark's weights, rounded
    to 4 or 8 bits (at 8B that is ~16 GB of temporary disk per process and half a minute)."""
    import tempfile

    auto = auto_class(config)
    load = dict(
        common, quantization_config=quantization_config(recipe.model.quantize), device_map=str(device)
    )
    if recipe.model.config is None:
        try:
            return auto.from_pretrained(
                model_source(recipe), config=config, revision=recipe.model.revision, **load
            )
        except OSError as e:
            raise load_problem(recipe, "weights", e) from None
    torch.manual_seed(recipe.seed)
    with torch.device(device):
        model = auto.from_config(config, **common)
    with tempfile.TemporaryDirectory(prefix="ligertune-quantize-") as tmp:
        model.save_pretrained(tmp)
        del model
        return auto.from_pretrained(tmp, **load)


def _check_loss_kwargs(model: nn.Module) -> None:
    """The loop normalises the loss by passing `num_items_in_batch` through the model's
    forward to its loss function; a model that drops it would silently average per
    micro-batch instead, so refuse it."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is not None and family.vision is not None:
        # Qwen2.5-VL's class says False (for transformers' Trainer), yet in 5.17 its forward hands
        # **kwargs, num_items_in_batch included, to its loss function; tests/test_vision.py checks
        # the sum / num_items_in_batch normalisation. Judge by the signature.
        accepts = None
    if accepts is None:
        params = inspect.signature(model.forward).parameters.values()
        accepts = any(p.kind is p.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params)
    if not accepts:
        raise RecipeError(
            [
                f"model: {type(model).__name__}.forward does not accept num_items_in_batch, which ligertune "
                "passes to normalise the loss over the accumulation window; this model is not supported"
            ]
        )


def check_vocab(model: nn.Module, tokenizer: Any) -> None:
    """Every token id the tokenizer can produce must have an embedding row."""
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise RecipeError(
            [
                f"model: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {vocab} rows; "
                f"use a matching tokenizer, or for a random-init model set model.config_overrides.vocab_size={len(tokenizer)}"
            ]
        )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of the language model: the family table's decoder layer
    class and any interleaved with it (`ligertune.catalog.families`: Mllama's cross-attention
    layers), else the class names the model itself declares as its
    units of sharding (``_no_split_modules``, e.g. LlamaDecoderLayer), which for a multimodal
    model also name its vision blocks."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is not None:
        names = {family.decoder_layer, *family.other_decoder_layers}
    else:
        names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise RecipeError(
            [
                f"model: cannot find the decoder layers of {type(model).__name__} (no _no_split_modules); "
                "turn off training.compile and training.activation_checkpointing for this model"
            ]
        )
    return layers


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The vision tower's repeated blocks (the family's `VisionTower.block` class); none for a
    text model or a family without a vision record."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is None or family.vision is None:
        return []
    return [m for m in model.modules() if type(m).__name__ == family.vision.block]
