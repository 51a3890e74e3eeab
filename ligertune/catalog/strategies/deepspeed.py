"""``deepspeed``: DeepSpeed ZeRO stage 1/2/3 with our torch AdamW (`ligertune.distributed.deepspeed`
is the engine): its options, its rules, its memory, and the DeepSpeed config a recipe implies.

The recipe stays the one source of the batch shape, clipping, precision and ZeRO stage:
``parallel.deepspeed.config`` (a JSON file) is merged over the generated config key by key and
may repeat those keys with the same value but not change them, nor name an optimizer or
scheduler (the recipe's AdamW and schedule are handed to DeepSpeed). Everything else in the
file (bucket sizes, overlap_comm, offload details, ...) wins. Pure dictionaries: nothing here
imports DeepSpeed or torch.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator

from ligertune.catalog.rules import Rule
from ligertune.catalog.section import Section
from ligertune.catalog.shape import ModelShape
from ligertune.catalog.strategies.base import ParallelOptions, ResumeRule, scale_out
from ligertune.errors import RecipeError

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe


class DeepSpeedOptions(Section):
    zero_stage: Literal[1, 2, 3] = Field(3, description="ZeRO stage.")
    offload_optimizer: bool = Field(False, description="Offload optimizer states to the CPU.")
    offload_params: bool = Field(False, description="Offload parameters to the CPU (stage 3).")
    config: str | None = Field(None, description="A DeepSpeed JSON file merged over the generated config.")

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, value):
        """``True == 1`` in Python, so a Literal[1, 2, 3] would read ``zero_stage: true`` as 1."""
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}; allowed: 1, 2 or 3")
        return value


def options_agree(recipe: Recipe) -> list[str]:
    """Parameter offload needs ZeRO-3; the DeepSpeed JSON file agrees with the recipe."""
    options = recipe.parallel.deepspeed
    problems = []
    if options.offload_params and options.zero_stage != 3:
        problems.append("parallel.deepspeed.offload_params needs parallel.deepspeed.zero_stage: 3")
    if options.config and recipe.resolve(options.config).exists():
        problems += deepspeed_config_problems(recipe)
    return problems


class DeepSpeedParallel(ParallelOptions):
    strategy: Literal["deepspeed"] = Field("deepspeed", description="The parallel strategy.")
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions, description="Options of DeepSpeed.")

    summary: ClassVar[str] = "DeepSpeed ZeRO stage 1/2/3 (optimizer state, gradients, parameters sharded)"
    label: ClassVar[str] = "ZeRO"
    checkpoint_format: ClassVar[str] = "deepspeed"
    checkpoint_files: ClassVar[tuple[str, ...]] = ("deepspeed",)
    resume_rules: ClassVar[dict[str, ResumeRule]] = {
        "deepspeed": "a ZeRO checkpoint loads only into the DeepSpeed configuration that saved it"
    }
    resume_same_world_size: ClassVar[bool] = True  # one partition per rank
    unsupported: ClassVar[dict[str, str]] = {
        "context parallel": "its engine is untried with an all-gather inside every layer",
        "lora": "its checkpoints hold every weight",
        "quantized": "quantised weights cannot be sharded",
        "fp8": "torchao's float8 layers are not tested under DeepSpeed",
        "tiled mlp": "ZeRO-3's per-module gathers are untried around a forward called inside the backward",
        "bf16 weights": "its bf16 mode keeps fp32 master weights in the ZeRO optimizer",
        "generation": "generating in the loop is not wired to its engine (ZeRO-3 would gather every layer "
        "for each generated token)",
        "eval.tasks": "the DeepSpeed engine holds the model (ZeRO-3 shards it)",
    }
    cpu_warning: ClassVar[str | None] = (
        "compiles DeepSpeed's shared-memory communication op the first time (a minute or more on a small "
        "machine, silently; cached afterwards in ~/.cache/torch_extensions) and only tests the path; ddp or "
        "fsdp run the recipe on the CPU without it"
    )
    package: ClassVar[str | None] = "deepspeed"
    rules: ClassVar[tuple[Rule, ...]] = (
        *ParallelOptions.rules,
        Rule("parallel.deepspeed_options", options_agree),
    )

    def files(self) -> list[tuple[str, str]]:
        return [("parallel.deepspeed.config", self.deepspeed.config)] if self.deepspeed.config else []

    def shards_parameters(self) -> bool:
        return self.deepspeed.zero_stage == 3

    def sharded_init_problem(self) -> str | None:
        if self.shards_parameters():
            return None
        return (
            f"parallel.sharded_init: true, but parallel.strategy deepspeed (ZeRO stage {self.deepspeed.zero_stage}) "
            "keeps whole parameters on every rank; use fsdp or deepspeed with zero_stage 3, or sharded_init auto"
        )

    # -- memory ---------------------------------------------------------------------------------

    def bf16_parameters(self, precision: str) -> bool:
        return True  # DeepSpeed's bf16 mode: bf16 module weights, fp32 master weights

    def memory_states(self, shape: ModelShape, precision: str, world_size: int) -> tuple[dict[str, int], int]:
        """bf16 module weights (sharded at stage 3), fp32 master weights and AdamW moments in the
        ZeRO optimizer (sharded), gradients sharded from stage 2; at stage 3 about one layer
        prefetched ahead of the current one, and the embeddings and lm_head while they run."""
        options, t, w = self.deepspeed, shape.trainable, world_size
        stage, module = options.zero_stage, _module_bytes(precision)
        weights, weight_bytes = self._weights(shape, precision, world_size)
        optimizer, optimizer_bytes = self._optimizer(shape, precision, world_size)
        states = {  # what is offloaded is on the host (`memory_host`)
            weights: 0 if options.offload_params else weight_bytes,
            optimizer: 0 if options.offload_optimizer else optimizer_bytes,
        }
        if stage == 3:
            states["ZeRO-3 gathered layers (current + prefetch)"] = 2 * shape.layer_params * module
            states["ZeRO-3 gathered embeddings and lm_head"] = (
                shape.embed_params + shape.head_params
            ) * module
        # bf16 gradients, and the fp32 partition the optimizer steps on (on the host with offload_optimizer)
        fp32_on_gpu = precision != "fp32" and not options.offload_optimizer
        grads = t * module // (1 if stage == 1 else w) + (t * 4 // w if fp32_on_gpu else 0)
        return states, grads

    def memory_host(self, shape: ModelShape, precision: str, world_size: int) -> dict[str, int]:
        """``offload_params``: the module weights (sharded at stage 3); ``offload_optimizer``: the
        fp32 master weights and AdamW moments, and the fp32 gradients DeepSpeed's CPU Adam
        steps on (sharded)."""
        host = {}
        if self.deepspeed.offload_params:
            host.update([self._weights(shape, precision, world_size)])
        if self.deepspeed.offload_optimizer:
            host.update([self._optimizer(shape, precision, world_size)])
            host["fp32 gradients (sharded)"] = 4 * shape.trainable // world_size
        return host

    def _weights(self, shape: ModelShape, precision: str, world_size: int) -> tuple[str, int]:
        """The module weights' name and bytes on a rank: bf16 (fp32 for fp32), sharded at stage 3."""
        sharded = self.deepspeed.zero_stage == 3
        return "weights" + (" (sharded)" if sharded else ""), (
            shape.params * _module_bytes(precision) // (world_size if sharded else 1)
        )

    def _optimizer(self, shape: ModelShape, precision: str, world_size: int) -> tuple[str, int]:
        """The ZeRO optimizer's name and bytes on a rank: fp32 master weights (not for fp32, whose
        module weights are the master) and the two AdamW moments, sharded."""
        master = 4 * shape.trainable if precision != "fp32" else 0
        return "fp32 master weights + AdamW moments (sharded)", (master + 8 * shape.trainable) // world_size

    def frozen_memory(self, frozen: ModelShape, precision: str, world_size: int) -> tuple[int, int, str]:
        """Stage 3: an inference engine sharded like the policy, bf16 module weights (none on the
        GPU with parameter offload), gathering as the policy does; stages 1 and 2 shard nothing
        a frozen model has: a replica."""
        if not self.shards_parameters():
            return super().frozen_memory(frozen, precision, world_size)
        module = _module_bytes(precision)
        offloaded = self.deepspeed.offload_params
        weights = 0 if offloaded else frozen.params * module // world_size
        gathered = (2 * frozen.layer_params + frozen.embed_params + frozen.head_params) * module
        return (
            weights,
            gathered,
            f"{'bf16' if module == 2 else 'fp32'}, sharded" + (", on the CPU" if offloaded else ""),
        )

    def memory_fixes(self, precision: str, world_size: int) -> list[tuple[str, dict]]:
        offload = self.model_copy(
            update={"deepspeed": self.deepspeed.model_copy(update={"offload_optimizer": True})}
        )
        return [scale_out(world_size), ("parallel.deepspeed.offload_optimizer=true", {"parallel": offload})]


def _module_bytes(precision: str) -> int:
    """DeepSpeed's module weights: bf16 in its bf16 mode, else fp32."""
    return 2 if precision != "fp32" else 4


# Keys of the DeepSpeed config that the recipe decides, with the recipe key to change instead.
_RECIPE_OWNED = {
    ("train_micro_batch_size_per_gpu",): "training.micro_batch_size",
    ("gradient_accumulation_steps",): "training.gradient_accumulation_steps",
    ("gradient_clipping",): "training.max_grad_norm",
    ("bf16", "enabled"): "training.precision",
    ("fp16", "enabled"): "training.precision",
    ("zero_optimization", "stage"): "parallel.deepspeed.zero_stage",
}

_MISSING = object()


def generated_config(recipe: Recipe) -> dict[str, Any]:
    """What the recipe alone says, before the user's file is merged in."""
    training, options = recipe.training, recipe.parallel.deepspeed
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if options.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "gradient_clipping": training.max_grad_norm or 0.0,
        "bf16": {"enabled": training.precision == "bf16-mixed"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        # torch's AdamW is not on DeepSpeed's list of ZeRO-tested optimizers, and with an
        # offloaded optimizer DeepSpeed would insist on its own (JIT-compiled) CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,  # our own metrics report the steps
        "wall_clock_breakdown": False,
    }


def _user_config(recipe: Recipe) -> tuple[dict[str, Any] | None, list[str]]:
    """The parsed ``parallel.deepspeed.config`` file (None when unset), or why it cannot be read."""
    if recipe.parallel.deepspeed.config is None:
        return None, []
    path = recipe.resolve(recipe.parallel.deepspeed.config)
    try:
        user = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, [f"parallel.deepspeed.config: cannot read {path} as JSON: {e}"]
    if not isinstance(user, dict):
        return None, [f"parallel.deepspeed.config: {path} must hold a JSON object, got {type(user).__name__}"]
    return user, []


def deepspeed_config_problems(recipe: Recipe) -> list[str]:
    """Every way the user's DeepSpeed file contradicts the recipe, one line each."""
    user, problems = _user_config(recipe)
    if user is None:
        return problems
    path = recipe.resolve(recipe.parallel.deepspeed.config)
    problems = [
        f"parallel.deepspeed.config: {path} sets {key!r}; ligertune hands DeepSpeed the recipe's AdamW and LR "
        "schedule (training.*), remove it from the file"
        for key in ("optimizer", "scheduler")
        if key in user
    ]
    if "train_batch_size" in user:
        problems.append(
            f"parallel.deepspeed.config: {path} sets 'train_batch_size'; it follows from training.micro_batch_size × "
            "training.gradient_accumulation_steps × the number of processes: remove it from the file"
        )
    generated = generated_config(recipe)
    for keys, recipe_key in _RECIPE_OWNED.items():
        ours, theirs = _lookup(generated, keys), _lookup(user, keys)
        if theirs is not _MISSING and theirs != ours:
            problems.append(
                f"parallel.deepspeed.config: {path} sets {'.'.join(keys)}={theirs!r} but the recipe gives {ours!r}; "
                f"change {recipe_key} in the recipe instead and remove it from the file"
            )
    return problems


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
    """The DeepSpeed config of a recipe, with ``parallel.deepspeed.config`` merged over it.
    Raises RecipeError when the file contradicts the recipe (see the module docstring)."""
    problems = deepspeed_config_problems(recipe)
    if problems:
        raise RecipeError(problems)
    user, _ = _user_config(recipe)
    generated = generated_config(recipe)
    return generated if user is None else _merge(generated, user)


def _lookup(mapping: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return _MISSING
        mapping = mapping[key]
    return mapping


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged
