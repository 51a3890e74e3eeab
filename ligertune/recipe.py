"""Recipes: YAML → validated pydantic models, with errors a user can act on.

A recipe is one YAML file with the sections below. Every field has a type, a default where
one makes sense, and a description; ``docs/recipes.md`` is generated from these models
(``python scripts/gen_recipe_docs.py``) and a test checks that it is current.

Loading goes: ``yaml.safe_load`` → command-line overrides (``training.lr=2e-5``) applied to
the raw mapping → pydantic validation → cross-field checks. Every failure raises
`RecipeError` with one line per problem, each naming the dotted key, before any model, data
or GPU work starts. The CLI prints those lines and exits with status 2.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Paths starting with this prefix name files shipped inside the package (ligertune/assets).
BUNDLED_PREFIX = "ligertune://"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")

KERNEL_NAMES = (
    "rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "cross_entropy",
    "fused_linear_cross_entropy",
)


class RecipeError(ValueError):
    """A recipe problem the user must fix. `problems` holds one message per line."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"{source}: " if source else ""
        super().__init__(head + "invalid recipe\n" + "\n".join(f"  {p}" for p in problems))


def resolve_path(path: str, base: Path | None = None) -> Path:
    """Turn a recipe path into a filesystem path: bundled assets, ~, or relative to `base`."""
    if path.startswith(BUNDLED_PREFIX):
        return ASSETS_DIR / path[len(BUNDLED_PREFIX) :]
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and base is not None and not p.exists():
        candidate = base / p
        if candidate.exists():
            return candidate
    return p


def looks_local(path: str) -> bool:
    """Whether a name is meant as a local path rather than a hub id like ``org/name``."""
    return (
        path.startswith((BUNDLED_PREFIX, "/", "./", "../", "~"))
        or path.lower().endswith(DATA_SUFFIXES)
        or Path(os.path.expanduser(path)).exists()
    )


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


class ModelSection(Section):
    name_or_path: str | None = Field(
        None, description="Hub id (meta-llama/Meta-Llama-3-8B) or local directory with weights to fine-tune."
    )
    config: str | dict[str, Any] | None = Field(
        None,
        description="Random-init architecture instead of weights: a shipped name (llama3-8b, llama3.2-1b, "
        "qwen2.5-7b, gemma2-2b, ...) or a transformers config mapping with model_type.",
    )
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Config fields to change after loading, e.g. {num_hidden_layers: 2}.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention backend handed to transformers."
    )
    trust_remote_code: bool = Field(False, description="Allow custom modeling code from the hub repository.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the weights.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.name_or_path is None) == (self.config is None):
            raise ValueError("set exactly one of model.name_or_path (weights) or model.config (random init)")
        return self


class TokenizerSection(Section):
    name_or_path: str | None = Field(
        None, description="Hub id or local directory; defaults to model.name_or_path."
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the tokenizer's own (chat format only)."
    )
    pad_token: str | None = Field(
        None, description="Pad token to set when the tokenizer has none (default: EOS)."
    )


class DataSection(Section):
    format: Literal["alpaca", "chat", "pretokenized"] = Field(
        "alpaca",
        description="alpaca: instruction/input/output; chat: a messages list; pretokenized: input_ids[/labels].",
    )
    path: str = Field(description="Hub dataset id, or a local JSON/JSONL/Parquet file or directory.")
    split: str = Field("train", description="Split to train on.")
    validation_split: str | None = Field(
        None, description="Split to evaluate on; when absent, validation_fraction is held out from train."
    )
    validation_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of the training split held out for evaluation."
    )
    max_seq_len: int = Field(
        2048, gt=0, description="Tokens per sequence; longer samples are truncated (and counted)."
    )
    packing: bool = Field(
        True, description="Concatenate samples into max_seq_len rows, attention kept within each sample."
    )
    train_on_inputs: bool = Field(False, description="Also compute the loss on prompt tokens.")
    messages_field: str = Field("messages", description="Column holding the messages list (chat format).")
    max_samples: int | None = Field(None, gt=0, description="Use only the first N samples (after shuffling).")
    shuffle: bool = Field(True, description="Shuffle samples (seeded by the recipe seed).")


class TrainingSection(Section):
    epochs: int = Field(1, gt=0, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to run; overrides epochs.")
    micro_batch_size: int = Field(1, gt=0, description="Sequences per forward/backward on each device.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    lr: float = Field(2e-5, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine or linear to min_lr_ratio·lr, or constant."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over this many steps.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final lr as a fraction of the peak.")
    weight_decay: float = Field(
        0.0, ge=0.0, description="AdamW weight decay (never applied to norms and biases)."
    )
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW beta1, beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, description="Clip the global gradient norm to this (null: no clipping)."
    )
    precision: Literal["bf16", "bf16-mixed", "fp32"] = Field(
        "bf16",
        description="bf16: bf16 weights and optimizer; bf16-mixed: fp32 master weights + bf16 autocast; fp32.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer in backward (non-reentrant)."
    )
    compile: bool = Field(False, description="torch.compile each decoder layer.")
    eval_every: int | None = Field(None, gt=0, description="Evaluate on the validation split every N steps.")
    eval_max_batches: int | None = Field(None, gt=0, description="Cap the batches per evaluation.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="NaN/inf loss or grad norm: save the last good state and stop, or skip the step."
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where to train; auto picks CUDA when present."
    )


class KernelsSection(Section):
    rms_norm: bool = Field(True, description="Triton RMSNorm (and q_norm/k_norm where the family has them).")
    layer_norm: bool = Field(True, description="Triton LayerNorm.")
    rope: bool = Field(True, description="Triton rotary embedding for q and k in one launch.")
    swiglu: bool = Field(True, description="Triton SwiGLU activation in the MLP.")
    geglu: bool = Field(True, description="Triton GeGLU (tanh GELU) activation in the MLP (Gemma).")
    cross_entropy: bool = Field(False, description="Triton cross entropy over materialised logits.")
    fused_linear_cross_entropy: bool = Field(
        True,
        description="lm_head + cross entropy fused in chunks; logits are never materialised in training.",
    )

    @model_validator(mode="after")
    def _one_loss_kernel(self):
        if self.cross_entropy and self.fused_linear_cross_entropy:
            raise ValueError(
                "kernels.cross_entropy and kernels.fused_linear_cross_entropy are both on; "
                "they replace the same loss: choose one"
            )
        return self

    @classmethod
    def preset(cls, name: str) -> KernelsSection:
        if name == "all":
            return cls()
        return cls(**{k: False for k in KERNEL_NAMES})

    def enabled(self) -> list[str]:
        return [k for k in KERNEL_NAMES if getattr(self, k)]


class FSDPOptions(Section):
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3 style)."
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters and gradients on the CPU.")
    mixed_precision: bool = Field(True, description="bf16 parameters in compute, fp32 gradient reduction.")


class DeepSpeedOptions(Section):
    zero_stage: Literal[1, 2, 3] = Field(3, description="ZeRO stage.")
    offload_optimizer: bool = Field(False, description="Offload optimizer states to the CPU.")
    offload_params: bool = Field(False, description="Offload parameters to the CPU (stage 3).")
    config: str | None = Field(None, description="A DeepSpeed JSON file merged over the generated config.")


class ParallelSection(Section):
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = Field(
        "none", description="none (one device), ddp, fsdp (FSDP2 fully_shard) or deepspeed (ZeRO)."
    )
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions, description="Options for strategy fsdp.")
    deepspeed: DeepSpeedOptions = Field(
        default_factory=DeepSpeedOptions, description="Options for strategy deepspeed."
    )


class LoggingSection(Section):
    log_every: int = Field(10, gt=0, description="Print and record metrics every N optimizer steps.")
    progress: Literal["auto", "rich", "plain"] = Field(
        "auto", description="auto: a rich progress bar on a terminal, plain lines otherwise."
    )
    tensorboard: bool = Field(
        False, description="Also write TensorBoard scalars (needs tensorboard installed)."
    )
    throughput_warmup_steps: int = Field(2, ge=0, description="Steps left out of tokens/s and MFU averages.")


class CheckpointSection(Section):
    every_steps: int | None = Field(
        None, gt=0, description="Save a resumable checkpoint every N steps (and at the end)."
    )
    keep_last: int = Field(2, gt=0, description="Resumable checkpoints to keep; older ones are deleted.")
    save_final: bool = Field(
        True,
        description="Save a resumable checkpoint when the run ends (a stop by SIGTERM/SIGINT always saves).",
    )
    resume: str = Field(
        "auto", description="auto (newest complete checkpoint in output_dir), none, or a checkpoint path."
    )
    export_hf: bool = Field(
        True, description="Write a Hugging Face model (safetensors + config + tokenizer) at the end."
    )


class Recipe(Section):
    name: str = Field("run", description="Run name; also the default output directory under runs/.")
    description: str = Field("", description="One line shown by `ligertune recipes`.")
    seed: int = Field(42, description="Seed for weights (random init), data order and dropout.")
    output_dir: str | None = Field(
        None, description="Where checkpoints, metrics and the export go (default runs/<name>)."
    )
    model: ModelSection = Field(description="What to train.")
    tokenizer: TokenizerSection = Field(
        default_factory=TokenizerSection, description="Tokenizer source and padding."
    )
    data: DataSection = Field(description="Dataset, format and sequence layout.")
    training: TrainingSection = Field(
        default_factory=TrainingSection, description="Optimizer, schedule and loop."
    )
    kernels: KernelsSection = Field(
        default_factory=KernelsSection,
        description="Which Triton kernels to patch in: all, none, or per kernel.",
    )
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="Multi-GPU strategy.")
    logging: LoggingSection = Field(
        default_factory=LoggingSection, description="Metrics and progress output."
    )
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Saving and resuming."
    )

    # The directory the recipe file lives in: relative paths resolve against it.
    _base_dir: Path | None = None

    @field_validator("kernels", mode="before")
    @classmethod
    def _kernel_preset(cls, value):
        if isinstance(value, str):
            if value not in ("all", "none"):
                raise ValueError(f"expected 'all', 'none' or a mapping of kernel: true/false, got {value!r}")
            return KernelsSection.preset(value)
        return value

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    def resolve(self, path: str) -> Path:
        return resolve_path(path, self._base_dir)


# --------------------------------------------------------------------------------------------
# Loading, overrides and error messages
# --------------------------------------------------------------------------------------------


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """``training.lr=2e-5`` → (["training", "lr"], 2e-05). Values are parsed as YAML."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError([f"{item}: an override is written section.key=value, e.g. training.lr=2e-5"])
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise RecipeError([f"{key}: cannot parse value {raw!r} as YAML ({e.problem})"]) from None
        parsed.append((key.split("."), value))
    return parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for keys, value in parse_overrides(overrides):
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None or isinstance(child, str) and key == "kernels":
                # `kernels: all` followed by `kernels.rope=false`: expand the preset first.
                child = {} if child is None else KernelsSection.preset(child).model_dump()
                node[key] = child
            if not isinstance(child, dict):
                path = ".".join(keys[: depth + 1])
                raise RecipeError([f"{'.'.join(keys)}: {path} is {child!r}, not a section with keys"])
            node = child
        node[keys[-1]] = value
    return raw


def _model_at(loc: tuple, root: type[BaseModel] = Recipe) -> type[BaseModel] | None:
    """The pydantic model class whose fields live at `loc` (a ValidationError location)."""
    model: Any = root
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = next(
            (
                a
                for a in getattr(annotation, "__args__", (annotation,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            annotation,
        )
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _describe_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
    dotted = ".".join(str(p) for p in loc) or "recipe"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        valid = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        prefix = ".".join(str(p) for p in loc[:-1])
        hint = f"; did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else ""
        return f"{dotted}: unknown key{hint} (valid keys here: {', '.join(valid)})"
    if kind == "missing":
        return f"{dotted}: required key is missing"
    if kind == "literal_error":
        allowed = err.get("ctx", {}).get("expected", "")
        return f"{dotted}: got {given!r}; allowed: {allowed}"
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{dotted}: {msg}"
    return f"{dotted}: got {given!r}; {err['msg'].lower()}"


def _check_files(recipe: Recipe) -> list[str]:
    """Local paths must exist; hub ids are left to the loaders (they need network access)."""
    problems = []
    candidates = [
        ("model.name_or_path", recipe.model.name_or_path),
        ("tokenizer.name_or_path", recipe.tokenizer.name_or_path),
        ("data.path", recipe.data.path),
        ("parallel.deepspeed.config", recipe.parallel.deepspeed.config),
    ]
    if isinstance(recipe.checkpoint.resume, str) and recipe.checkpoint.resume not in ("auto", "none"):
        candidates.append(("checkpoint.resume", recipe.checkpoint.resume))
    for key, value in candidates:
        if value and (looks_local(value) or key in ("parallel.deepspeed.config", "checkpoint.resume")):
            path = recipe.resolve(value)
            if not path.exists():
                where = [Path.cwd()] + ([recipe._base_dir] if recipe._base_dir else [])
                looked = " and ".join(str((d / path).resolve()) for d in dict.fromkeys(where))
                shown = str(path) if path.is_absolute() else f"{value} (looked for {looked})"
                problems.append(f"{key}: file not found: {shown}")
    return problems


def _check_compatibility(recipe: Recipe) -> list[str]:
    problems = []
    if recipe.parallel.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        problems.append(
            "parallel.strategy: deepspeed is chosen but not installed; "
            "install it with: pip install 'ligertune[deepspeed]'"
        )
    if recipe.parallel.strategy != "deepspeed" and recipe.parallel.deepspeed.config:
        problems.append("parallel.deepspeed.config is set but parallel.strategy is not deepspeed")
    if (
        recipe.training.device == "cpu"
        and recipe.training.precision != "fp32"
        and recipe.parallel.strategy != "none"
    ):
        problems.append("training.precision: multi-process CPU runs (gloo) need fp32")
    if recipe.model.config is not None and isinstance(recipe.model.config, str):
        from ligertune.configs import SHIPPED_CONFIGS

        if recipe.model.config not in SHIPPED_CONFIGS:
            close = difflib.get_close_matches(recipe.model.config, list(SHIPPED_CONFIGS), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(
                f"model.config: unknown shipped config {recipe.model.config!r}{hint} "
                f"(shipped: {', '.join(SHIPPED_CONFIGS)})"
            )
    if (
        recipe.model.config is not None
        and isinstance(recipe.model.config, dict)
        and "model_type" not in recipe.model.config
    ):
        problems.append("model.config: a config mapping needs model_type (e.g. llama, qwen2, gemma2)")
    if recipe.parallel.deepspeed.offload_params and recipe.parallel.deepspeed.zero_stage != 3:
        problems.append("parallel.deepspeed.offload_params needs parallel.deepspeed.zero_stage: 3")
    return problems


def validate_recipe(raw: Any, source: str | None = None, base_dir: Path | None = None) -> Recipe:
    if not isinstance(raw, dict):
        raise RecipeError(
            [f"the recipe must be a YAML mapping of sections, got {type(raw).__name__}"], source
        )
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError([_describe_error(err) for err in e.errors()], source) from None
    recipe._base_dir = base_dir
    problems = _check_files(recipe) + _check_compatibility(recipe)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file. Raises RecipeError with every problem found."""
    path = Path(path)
    if not path.exists():
        shipped = Path(__file__).resolve().parent.parent / "recipes" / path.name
        raise RecipeError(
            [f"recipe file not found: {path}"]
            + (
                [f"a shipped recipe has that name: {shipped}"]
                if shipped.exists() and shipped != path.resolve()
                else []
            )
        )
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise RecipeError(["the file is not UTF-8 text"], str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError([f"not valid YAML{where}: {getattr(e, 'problem', e)}"], str(path)) from None
    if raw is None:
        raw = {}
    if isinstance(raw, dict) and overrides:
        raw = apply_overrides(raw, overrides)
    return validate_recipe(raw, str(path), path.resolve().parent)


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
