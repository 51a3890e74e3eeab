"""`ligertune generate`: a completion from a trained model, to sanity-check a run.

What it takes (`resolve_source`), in this order:

- a **run directory** (it has ``checkpoints/`` or ``final/``): its ``final-merged/`` export (a
  LoRA run's merged model) when there is one, else ``final/`` (a plain export, or a LoRA run's
  adapter: `ligertune.tools.adapters` rebuilds the base from the run's recipe and merges it);
  otherwise the newest intact checkpoint (verified against its manifest, as ``resume: auto``
  does: a damaged newer one is passed over with a warning), whose own ``recipe.yaml`` rebuilds
  the model (the
  recipe's architecture or base weights, without transforms; with the recipe's LoRA adapters
  around it for a LoRA checkpoint, merged once loaded) before the checkpoint's weights are
  loaded into it, in whatever format the strategy wrote: ``model.pt`` (none, ddp), ``dcp/``
  (fsdp, read without a process group), ``deepspeed/`` (consolidated by DeepSpeed's
  ``zero_to_fp32``): each strategy's engine reads its own format (`Runtime.read_weights`);
- a **model directory** (a ``config.json``): a Hugging Face model, e.g. an export; or an
  **adapter directory** (``adapter_config.json``), as ``final/`` above;
- anything else is taken for a **hub id** (offline, or without access: one error line).

It is a smoke test, not a server: ``generate`` with the KV cache, greedy at temperature 0 (the
default, so two runs print the same) and sampling above it. The prompt is sent the way the model
was trained to see it (`prompt_format`): for a run (or an export that carries its recipe) the
run's data format decides, the Alpaca prompt for ``alpaca``, the chat template for the
conversation formats, the raw text for ``prompt_completion`` and ``pretokenized``; for a model
without a recipe, the chat template when the tokenizer has one. ``--format`` overrides it
(``--no-chat`` is ``--format raw``). A chat prompt stops at the template's end-of-turn token as
well as EOS (`ligertune.data.chat.stop_tokens`), and a conversation can go on (`Generator`, what
``--interactive`` drives). CUDA when there is a GPU (weights in their saved dtype), else the CPU
in fp32.

Nothing loaded runs code (README, "What is safe to load"): checkpoint files are read with
``torch.load(weights_only=True)`` and the sharded formats through `ligertune.run.safe_load`;
custom modeling or tokenizer code (``auto_map``) runs only with ``--trust-remote-code`` on this
command line. A recipe stored in a run directory cannot grant it: its
``model.trust_remote_code`` is replaced by the command line's choice, for the model a checkpoint
rebuilds and for the base an adapter is merged into.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from ligertune.catalog.families import FAMILIES
from ligertune.config import load_recipe
from ligertune.data import load_tokenizer
from ligertune.data.chat import stop_tokens
from ligertune.data.formats import alpaca_prompt, canonical_format
from ligertune.data.images import BadImage, open_image
from ligertune.data.vision import VisionProcessor, load_processor, processor_from, prompt_inputs
from ligertune.distributed import Runtime
from ligertune.distributed.runtime import load_trainable_state
from ligertune.errors import DataError, RecipeError, UsageError
from ligertune.models.build import auto_class, build_model, tokens_per_image
from ligertune.run.checkpoint import CheckpointManager, load_checkpoint
from ligertune.run.manifest import DamagedCheckpoint
from ligertune.tools.adapters import (
    AdapterError,
    adapt_for_checkpoint,
    is_adapter,
    load_adapted,
    rebuild_overrides,
    recipe_of,
)

# How a prompt is put to the model: "auto" follows the run's data format (see the docstring).
PROMPT_FORMATS = ("auto", "alpaca", "chat", "raw")


class GenerateError(UsageError):
    """What `generate` cannot do, in one line (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class Source:
    """Where the model comes from: a Hugging Face model (folder or hub id), a LoRA adapter or a
    checkpoint; and the recipe that trained it, when known."""

    model: str  # a folder or hub id for from_pretrained; the adapter or checkpoint folder otherwise
    checkpoint: Path | None = None
    adapter: Path | None = None
    recipe: Path | None = None
    passed_over: tuple[str, ...] = ()  # a warning for each newer checkpoint found damaged

    def describe(self) -> str:
        if self.checkpoint:
            return f"checkpoint {self.checkpoint}"
        return f"adapter {self.adapter} merged into its recipe's base" if self.adapter else self.model


@dataclass(frozen=True)
class Generation:
    source: Source
    prompt_text: str  # what the model saw (after the Alpaca prompt or the chat template)
    completion: str
    format: str  # alpaca, chat or raw
    device: str

    @property
    def chat(self) -> bool:
        return self.format == "chat"


def resolve_source(run_or_model: str) -> Source:
    """A run directory → its export (merged first) or newest checkpoint; a model or adapter
    folder; else a hub id."""
    path = Path(run_or_model).expanduser()
    if path.is_dir():
        for export in (path / "final-merged", path / "final", path):
            if (export / "config.json").is_file():
                return Source(str(export), recipe=recipe_of(export))
            if is_adapter(export):
                return Source(str(export), adapter=export, recipe=recipe_of(export))
        if (path / "checkpoints").is_dir() or (path / "final").is_dir():
            latest, damaged = CheckpointManager(path / "checkpoints", keep_last=1).newest_intact()
            if latest is None and damaged:
                raise GenerateError(f"{path} has no intact checkpoint: {'; '.join(damaged)}")
            if latest is None:
                raise GenerateError(
                    f"{path} is a run directory with neither a final/ export nor a complete checkpoint; "
                    "train it further, or set checkpoint.export_hf=true"
                )
            passed_over = tuple(f"warning: {problem}; passed over it, using {latest}" for problem in damaged)
            return Source(
                str(latest), checkpoint=latest, recipe=latest / "recipe.yaml", passed_over=passed_over
            )
        raise GenerateError(
            f"{path} is a folder but neither a run directory nor a Hugging Face model or adapter (no config.json "
            "nor adapter_config.json)"
        )
    if path.exists() or run_or_model.startswith((".", "/", "~")) or run_or_model.count("/") > 1:
        raise GenerateError(f"{run_or_model}: no such run or model directory")
    return Source(run_or_model)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def load_for_generation(
    source: Source, device: torch.device, trust_remote_code: bool = False
) -> tuple[nn.Module, object]:
    """(model in eval mode with its KV cache on, tokenizer). `trust_remote_code`: the command
    line's ``--trust-remote-code``, the only thing that lets custom modeling code run."""
    if source.checkpoint is not None:
        model, tokenizer = _from_checkpoint(source.checkpoint, device, trust_remote_code)
    elif source.adapter is not None:
        try:
            model, tokenizer = load_adapted(source.adapter, trust_remote_code)
        except AdapterError as e:
            raise GenerateError(f"{e}{_remote_code_hint(e, trust_remote_code)}") from None
        model = model.to(device)
    else:
        from transformers import AutoConfig, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.model, trust_remote_code=trust_remote_code)
            config = AutoConfig.from_pretrained(source.model, trust_remote_code=trust_remote_code)
            model = auto_class(config).from_pretrained(
                source.model,
                dtype="auto" if device.type == "cuda" else torch.float32,
                device_map=str(device),
                trust_remote_code=trust_remote_code,
            )
        except Exception as e:  # transformers, safetensors (a damaged export), the hub: one line each
            raise GenerateError(
                f"cannot load {source.model!r}: {_first_line(e)}{_remote_code_hint(e, trust_remote_code)} "
                "(a hub id needs hub access or a copy in the cache: `ligertune download`)"
            ) from None
    model.config.use_cache = True
    if getattr(model.config, "text_config", None) is not None:  # training turned both off (build_model)
        model.config.text_config.use_cache = True
    return model.eval(), tokenizer


def _remote_code_hint(error: Exception, trusted: bool) -> str:
    # transformers' words for a config or tokenizer that names its own code (auto_map).
    if trusted or not any(words in str(error) for words in ("trust_remote_code", "custom code")):
        return ""
    return "; it needs its own modeling code: pass --trust-remote-code if you trust that code"


def _from_checkpoint(
    checkpoint: Path, device: torch.device, trust_remote_code: bool
) -> tuple[nn.Module, object]:
    """The model of a resumable checkpoint: rebuilt from the run's recipe, weights loaded. The
    stored recipe's ``model.trust_remote_code`` is replaced by `trust_remote_code` (the command
    line's): a recipe that came with a run directory cannot grant it."""
    try:
        recipe = load_recipe(checkpoint / "recipe.yaml", rebuild_overrides(trust_remote_code))
        tokenizer = load_tokenizer(recipe)
        torch.manual_seed(recipe.seed)
        model = build_model(recipe, torch.device("cpu"))
        if recipe.lora is not None:  # the checkpoint holds the adapters: wrap the base as training did
            model = adapt_for_checkpoint(model, recipe)
    except (RecipeError, DataError) as e:
        detail = "; ".join(e.problems) if isinstance(e, RecipeError) else str(e)
        raise GenerateError(
            f"cannot rebuild the model of {checkpoint} from its recipe.yaml: {detail}"
            + _remote_code_hint(e, trust_remote_code)
        ) from None
    try:
        state = load_checkpoint(checkpoint)
        reader = Runtime.reading(state.format)
        if reader is None:
            raise GenerateError(f"{checkpoint}: unknown checkpoint format {state.format!r}")
        with contextlib.redirect_stdout(sys.stderr):  # a reader's progress prints; stdout is the completion's
            weights = reader.read_weights(state, model)
    except DamagedCheckpoint as e:
        raise GenerateError(str(e)) from None
    if recipe.lora is not None:
        try:
            load_trainable_state(model, weights, checkpoint)
        except RecipeError as e:
            raise GenerateError("; ".join(e.problems)) from None
        return model.merge_and_unload().to(device), tokenizer
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # A tied head is saved once by some formats; anything else missing is a wrong checkpoint.
    tied = {"lm_head.weight"} if model.lm_head.weight is model.get_input_embeddings().weight else set()
    if set(missing) - tied or unexpected:
        raise GenerateError(
            f"{checkpoint}: its weights do not fit the model its recipe builds (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    return model.to(device), tokenizer


def prompt_format(requested: str, source: Source, tokenizer) -> str:
    """How to put a prompt to this model (see the module docstring): `requested` unless ``auto``."""
    if requested != "auto":
        if requested == "chat" and not getattr(tokenizer, "chat_template", None):
            raise GenerateError(
                "--format chat: the tokenizer has no chat template; use --format raw or alpaca"
            )
        return requested
    trained = _trained_format(source.recipe)
    if trained == "alpaca":
        return "alpaca"
    if trained in ("prompt_completion", "pretokenized"):
        return "raw"
    return "chat" if getattr(tokenizer, "chat_template", None) else "raw"


def _trained_format(recipe: Path | None) -> str | None:
    """The data format of the run that trained the model: ``data.format``, or the format every
    source of a mix shares. Read from the saved YAML alone (its files need not exist here)."""
    if recipe is None or not recipe.is_file():
        return None
    try:
        data = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("data") or {}
    except (OSError, yaml.YAMLError):
        return None
    default = data.get("format", "alpaca")
    formats = {canonical_format(s.get("format") or default) for s in data.get("mix") or []} or {default}
    return canonical_format(formats.pop()) if len(formats) == 1 else canonical_format(default)


class Generator:
    """A loaded model and how to prompt it; `complete` answers a conversation (the last user
    message for the alpaca and raw formats, the whole conversation through the chat template)."""

    def __init__(
        self,
        run_or_model: str,
        *,
        device: torch.device | None = None,
        format: str = "auto",
        chat: bool = True,
        trust_remote_code: bool = False,
    ):
        from transformers.utils import logging as hf_logging

        if format not in PROMPT_FORMATS:
            raise GenerateError(f"--format must be one of {', '.join(PROMPT_FORMATS)}, got {format!r}")
        self.device = device or _device()
        self.source = resolve_source(run_or_model)
        hf_logging.disable_progress_bar()  # "Loading weights" bars around a one-line answer
        try:
            self.model, self.tokenizer = load_for_generation(self.source, self.device, trust_remote_code)
        finally:
            hf_logging.enable_progress_bar()
        self.format = prompt_format(format if chat else "raw", self.source, self.tokenizer)

    def render(self, messages: list[dict]) -> tuple[str, bool]:
        """(the text the model sees, whether the tokenizer adds its special tokens to it)."""
        if self.format == "chat":  # the template writes the special tokens (BOS) itself
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            ), False
        last = messages[-1]["content"]
        return (alpaca_prompt(last) if self.format == "alpaca" else last), True

    def vision_processor(self) -> VisionProcessor:
        """A vision-language model's image processor: from its run's recipe (the tokenizer's
        source, as training loaded it), else from the model folder or hub id itself."""
        family = FAMILIES.get(getattr(self.model.config, "model_type", None))
        if family is None or family.vision is None:
            raise GenerateError(f"--image: {type(self.model).__name__} is not a vision-language model")
        fixed = tokens_per_image(self.model.config, family.vision)
        try:
            if self.source.recipe is not None and self.source.recipe.is_file():
                recipe = load_recipe(self.source.recipe, rebuild_overrides(False))
                return load_processor(recipe, family.vision, self.tokenizer, fixed)
            return processor_from(self.source.model, family.vision, self.tokenizer, "the model", fixed)
        except (RecipeError, DataError) as e:
            raise GenerateError(
                f"--image: {'; '.join(e.problems) if isinstance(e, RecipeError) else e}"
            ) from None

    def complete(
        self,
        messages: list[dict],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        images: list[str] = (),
    ) -> Generation:
        """The model's answer to `messages`; `images` (paths) go before the last message's text."""
        if max_new_tokens <= 0:
            raise GenerateError(f"--max-new-tokens must be positive, got {max_new_tokens}")
        if temperature < 0:
            raise GenerateError(f"--temperature must be 0 (greedy) or positive, got {temperature}")
        if images:
            if self.format != "chat":
                raise GenerateError(
                    f"--image needs the chat template (--format chat), not --format {self.format}"
                )
            processor = self.vision_processor()
            try:
                opened = [open_image({"path": path}, None, [], 0) for path in images]
            except BadImage as e:
                raise GenerateError(f"--image: {e}") from None
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": messages[-1]["content"]}]
            messages = [*messages[:-1], {"role": messages[-1]["role"], "content": parts}]
            encoded = prompt_inputs(processor, messages, opened)
            text = self.tokenizer.decode(encoded["input_ids"][0])
        else:
            text, special = self.render(messages)
            encoded = self.tokenizer(text, return_tensors="pt", add_special_tokens=special)
        encoded = {k: v.to(self.device) for k, v in encoded.items()}
        sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stops = stop_tokens(tokenizer) if self.format == "chat" else [tokenizer.eos_token_id]
        with torch.no_grad():
            output = self.model.generate(
                **encoded, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=stops, **sampling
            )
        new_tokens = output[0, encoded["input_ids"].shape[1] :]
        completion = tokenizer.decode(new_tokens, skip_special_tokens=True)
        return Generation(self.source, text, completion, self.format, str(self.device))


def generate(
    run_or_model: str,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    chat: bool = True,
    device: torch.device | None = None,
    format: str = "auto",
    trust_remote_code: bool = False,
) -> Generation:
    """Complete `prompt` with the model `run_or_model` names (see the module docstring)."""
    if max_new_tokens <= 0:
        raise GenerateError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    generator = Generator(
        run_or_model, device=device, format=format, chat=chat, trust_remote_code=trust_remote_code
    )
    return generator.complete([{"role": "user", "content": prompt}], max_new_tokens, temperature)
