"""`ligertune generate`: a completion from a trained model, to sanity-check a run.

What it takes (`resolve_source`), in this order:

- a **run directory** (it has ``checkpoints/`` or ``final/``): its ``final/`` export when the run
  finished with ``checkpoint.export_hf``; otherwise the newest intact checkpoint (verified
  against its manifest, as ``resume: auto`` does: a damaged newer one is passed over with a
  warning), whose own ``recipe.yaml`` rebuilds the model (the recipe's architecture or base
  weights, without transforms) before the checkpoint's weights are loaded into it, in whatever
  format the strategy wrote: ``model.pt`` (none, ddp), ``dcp/`` (fsdp, read without a process
  group) or ``deepspeed/`` (consolidated by DeepSpeed's ``zero_to_fp32``);
- a **model directory** (a ``config.json``): a Hugging Face model, e.g. an export;
- anything else is taken for a **hub id** (offline, or without access: one error line).

It is a smoke test, not a server: one prompt, ``generate`` with the KV cache, greedy at
temperature 0 (the default, so two runs print the same) and sampling above it. With ``--chat``
(the default) and a tokenizer that has a chat template, the prompt is sent as one user message
with the generation prompt appended, as a chat model was trained to see it; ``--no-chat`` (or
no template) sends the raw text. CUDA when there is a GPU (weights in their saved dtype), else
the CPU in fp32.

Nothing loaded runs code (README, "What is safe to load"): checkpoint files are read with
``torch.load(weights_only=True)`` and the sharded formats through `ligertune.run.safe_load`;
custom modeling or tokenizer code (``auto_map``) runs only with ``--trust-remote-code`` on this
command line. A recipe stored in a run directory cannot grant it: its
``model.trust_remote_code`` is replaced by the command line's choice.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ligertune.config import load_recipe
from ligertune.data import load_tokenizer
from ligertune.distributed import Runtime
from ligertune.errors import DataError, RecipeError, UsageError
from ligertune.models.build import build_model
from ligertune.run.checkpoint import CheckpointManager, load_checkpoint
from ligertune.run.manifest import DamagedCheckpoint


class GenerateError(UsageError):
    """What `generate` cannot do, in one line (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class Source:
    """Where the model comes from: a Hugging Face model (folder or hub id) or a checkpoint."""

    model: str  # a folder or hub id for from_pretrained; the checkpoint folder otherwise
    checkpoint: Path | None = None
    passed_over: tuple[str, ...] = ()  # a warning for each newer checkpoint found damaged

    def describe(self) -> str:
        return f"checkpoint {self.checkpoint}" if self.checkpoint else self.model


@dataclass(frozen=True)
class Generation:
    source: Source
    prompt_text: str  # what the model saw (after the chat template)
    completion: str
    chat: bool
    device: str


def resolve_source(run_or_model: str) -> Source:
    """A run directory → its export or newest checkpoint; a model folder; else a hub id."""
    path = Path(run_or_model).expanduser()
    if path.is_dir():
        if (path / "final" / "config.json").is_file():
            return Source(str(path / "final"))
        if (path / "config.json").is_file():
            return Source(str(path))
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
            return Source(str(latest), checkpoint=latest, passed_over=passed_over)
        raise GenerateError(
            f"{path} is a folder but neither a run directory nor a Hugging Face model (no config.json)"
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
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.model, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
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
    overrides = [
        "training.precision=fp32",
        "training.device=cpu",
        f"model.trust_remote_code={trust_remote_code}",
    ]
    try:
        recipe = load_recipe(checkpoint / "recipe.yaml", overrides)
        tokenizer = load_tokenizer(recipe)
        torch.manual_seed(recipe.seed)
        model = build_model(recipe, torch.device("cpu"))
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
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # A tied head is saved once by some formats; anything else missing is a wrong checkpoint.
    tied = {"lm_head.weight"} if model.lm_head.weight is model.get_input_embeddings().weight else set()
    if set(missing) - tied or unexpected:
        raise GenerateError(
            f"{checkpoint}: its weights do not fit the model its recipe builds (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    return model.to(device), tokenizer


def generate(
    run_or_model: str,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    chat: bool = True,
    device: torch.device | None = None,
    trust_remote_code: bool = False,
) -> Generation:
    """Complete `prompt` with the model `run_or_model` names (see the module docstring)."""
    if max_new_tokens <= 0:
        raise GenerateError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise GenerateError(f"--temperature must be 0 (greedy) or positive, got {temperature}")
    from transformers.utils import logging as hf_logging

    device = device or _device()
    source = resolve_source(run_or_model)
    hf_logging.disable_progress_bar()  # "Loading weights" bars around a one-line answer
    try:
        model, tokenizer = load_for_generation(source, device, trust_remote_code)
    finally:
        hf_logging.enable_progress_bar()
    use_chat = chat and bool(getattr(tokenizer, "chat_template", None))
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        # The template writes the special tokens (BOS) itself.
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        text = prompt
        encoded = tokenizer(text, return_tensors="pt")
    encoded = {k: v.to(device) for k, v in encoded.items()}
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
    new_tokens = output[0, encoded["input_ids"].shape[1] :]
    completion = tokenizer.decode(new_tokens, skip_special_tokens=True)
    return Generation(source, text, completion, use_chat, str(device))
