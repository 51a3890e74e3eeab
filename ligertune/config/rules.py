"""Every rule that relates recipe keys to each other or to the machine, each with a name.

A field's own type and range are the schema's (`ligertune.config.schema`); everything that needs
two keys, a file, or a fact about the machine is a rule here, so that one list answers "what can
make a recipe invalid". ``docs/recipes.md`` lists them (generated from this module).

Three phases:

- *recipe* rules read the recipe (and the files it names) only. `ligertune.config.load_recipe`
  runs them, so ``ligertune validate``, ``train``, ``compare`` and ``bench`` all refuse the same
  recipes, before any model, data or GPU work.
- *model* rules read the model's config (``model.config``, a local model's config.json) against
  the installed transformers, which they import; reading a recipe must not (it would cost seconds
  and torch), so `load_recipe` leaves them out. ``validate`` runs them as errors, and ``train``
  runs them first thing (`machine_problems` includes them): a recipe that validates builds.
- *machine* rules need the machine the run goes on: is CUDA there, is a package installed.
  ``train`` runs them before building anything; a recipe is often checked on a laptop and run
  on a GPU server, so ``validate`` does not refuse a recipe for them.

A rule returns one line per problem, each starting with the key to change. The rules of one
objective or one strategy are declared by it (`ligertune.catalog.objectives`,
`ligertune.catalog.strategies`) and run only when the recipe chooses it; the rules here read what
every component declares (the data an objective trains on, what a strategy supports) and never
ask which one was chosen.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from ligertune.catalog.architectures import SHIPPED_CONFIGS
from ligertune.catalog.kernels import conflicts
from ligertune.catalog.objectives import OBJECTIVES
from ligertune.catalog.rules import Rule
from ligertune.catalog.section import BUILTIN_PLUGINS
from ligertune.catalog.strategies import STRATEGIES
from ligertune.config.data_rules import DATA_RULES
from ligertune.config.environment_rules import ENVIRONMENT_RULES
from ligertune.config.eval_rules import EVAL_RULES
from ligertune.config.objective_rules import OBJECTIVE_RULES
from ligertune.config.schema import Recipe
from ligertune.errors import shown
from ligertune.paths import looks_local

RULES: list[Rule] = []


def rule(name: str, phase: str = "recipe") -> Callable:
    def register(check: Callable[[Recipe], list[str]]) -> Callable[[Recipe], list[str]]:
        RULES.append(Rule(name, check, phase))
        return check

    return register


def recipe_problems(recipe: Recipe) -> list[str]:
    """Problems found by every recipe-phase rule, in rule order."""
    return [p for r in RULES if r.phase == "recipe" for p in r.check(recipe)]


def model_problems(recipe: Recipe) -> list[str]:
    """Problems of the model the recipe names, as the installed transformers sees it."""
    return [p for r in RULES if r.phase == "model" for p in r.check(recipe)]


def machine_problems(recipe: Recipe) -> list[str]:
    """What `train` checks before any work: the model rules, then running this recipe on this
    machine (CUDA, installed packages)."""
    return model_problems(recipe) + [p for r in RULES if r.phase == "machine" for p in r.check(recipe)]


# --------------------------------------------------------------------------------------------
# Recipe rules
# --------------------------------------------------------------------------------------------


@rule("model.one_source")
def _one_model_source(recipe: Recipe) -> list[str]:
    """Exactly one of model.name_or_path (weights) and model.config (random init)."""
    if (recipe.model.name_or_path is None) == (recipe.model.config is None):
        return ["model: set exactly one of model.name_or_path (weights) or model.config (random init)"]
    return []


@rule("model.config_known")
def _shipped_config_known(recipe: Recipe) -> list[str]:
    """model.config names a shipped architecture, or is a mapping with model_type."""
    config = recipe.model.config
    if isinstance(config, str) and config not in SHIPPED_CONFIGS:
        close = difflib.get_close_matches(config, list(SHIPPED_CONFIGS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return [
            f"model.config: unknown shipped config {config!r}{hint} (shipped: {', '.join(SHIPPED_CONFIGS)})"
        ]
    if isinstance(config, dict) and "model_type" not in config:
        return ["model.config: a config mapping needs model_type (e.g. llama, qwen2, gemma2)"]
    return []


@rule("files.exist")
def _local_files_exist(recipe: Recipe) -> list[str]:
    """Local paths the recipe names exist (hub ids are left to the loaders)."""
    problems = []
    candidates = [
        ("model.name_or_path", recipe.model.name_or_path),
        ("tokenizer.name_or_path", recipe.tokenizer.name_or_path),
        ("data.path", recipe.data.path),
        *((f"data.mix[{i}].path", source.path) for i, source in enumerate(recipe.data.mix or [])),
    ]
    # Paths that can only be local: no hub id looks like them.
    local = [*recipe.parallel.files()]
    if recipe.checkpoint.resume not in ("auto", "none"):
        local.append(("checkpoint.resume", recipe.checkpoint.resume))
    for key, value in candidates + local:
        if value and (looks_local(value) or (key, value) in local):
            path = recipe.resolve(value)
            if not path.exists():
                where = [Path.cwd()] + ([recipe._base_dir] if recipe._base_dir else [])
                looked = " and ".join(shown((d / path).resolve()) for d in dict.fromkeys(where))
                named = shown(path) if path.is_absolute() else f"{shown(value)} (looked for {looked})"
                problems.append(f"{key}: file not found: {named}")
    return problems


@rule("data.one_source")
def _one_data_source(recipe: Recipe) -> list[str]:
    """Exactly one of data.path (one dataset) and data.mix (several, by weight)."""
    data = recipe.data
    if data.path is None and not data.mix:
        return ["data.path: required key is missing (or list several datasets under data.mix)"]
    if data.path is not None and data.mix:
        return ["data: set data.path (one dataset) or data.mix (several), not both"]
    return []


@rule("data.streaming")
def _streaming_limits(recipe: Recipe) -> list[str]:
    """data.streaming needs training.max_steps; its validation data comes from validation_split only."""
    if not recipe.data.streaming:
        return []
    problems = []
    if recipe.training.max_steps is None:
        problems.append(
            "training.max_steps: data.streaming reads data of unknown length, so epochs cannot be "
            "counted; set training.max_steps"
        )
    if recipe.data.validation_fraction > 0:
        problems.append(
            "data.validation_fraction: cannot hold out a fraction of a stream of unknown length; "
            "set data.validation_split instead"
        )
    return problems


@rule("output_dir.writable")
def _output_dir_writable(recipe: Recipe) -> list[str]:
    """The run's folder (output_dir, default runs/<name>) is a folder that can be written, or can be created."""
    target = recipe.run_dir
    key = "output_dir" if recipe.output_dir else "output_dir (default runs/<name>)"
    if target.exists() and not target.is_dir():
        return [f"{key}: {target} is a file, not a folder; set output_dir to a folder"]
    # Nothing is created here: the nearest existing folder must let the run create the rest.
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    shown = existing if existing.is_absolute() or existing != Path(".") else Path.cwd()
    if not existing.is_dir():
        return [f"{key}: cannot create {target}: {shown} is a file, not a folder; set output_dir elsewhere"]
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == target else f", so {target} cannot be created"
        return [f"{key}: {shown} is not writable{where}; set output_dir to a folder you can write"]
    return []


@rule("kernels.one_per_computation")
def _one_kernel_per_computation(recipe: Recipe) -> list[str]:
    """At most one kernel replaces each computation (cross_entropy or fused_linear_cross_entropy)."""
    return [
        f"{' and '.join(f'kernels.{k}' for k in names)} are both on; they replace the same {target}: choose one"
        for target, names in conflicts(recipe.kernels.enabled())
    ]


@rule("training.cpu_processes_fp32")
def _cpu_processes_fp32(recipe: Recipe) -> list[str]:
    """Multi-process runs on CPU (gloo) train in fp32."""
    training = recipe.training
    if training.device == "cpu" and training.precision != "fp32" and recipe.parallel.multi_process:
        return ["training.precision: multi-process CPU runs (gloo) need fp32"]
    return []


@rule("parallel.sharded_init_needs_sharding")
def _sharded_init_needs_sharding(recipe: Recipe) -> list[str]:
    """parallel.sharded_init: true needs a strategy that shards the parameters (fsdp without cpu_offload, ZeRO-3)."""
    problem = recipe.parallel.sharded_init_problem() if recipe.parallel.sharded_init is True else None
    return [problem] if problem else []


def _supporting(feature: str) -> str:
    """The strategies that train with `feature`, for an error's advice: ``ddp or fsdp``."""
    names = [STRATEGIES.name_of(s) for s in STRATEGIES if s.supports(feature)]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


@rule("parallel.supports")
def _strategy_supports(recipe: Recipe) -> list[str]:
    """The parallel strategy trains what the recipe asks: LoRA adapters, quantised weights, FP8 layers, a tiled MLP, bf16 weights, an objective that generates."""
    parallel, strategy = recipe.parallel, recipe.parallel.strategy
    asked = [
        ("lora", recipe.lora is not None, "lora", "remove the lora section"),
        ("quantized", recipe.model.quantize != "none", "model.quantize", "set model.quantize=none"),
        ("fp8", recipe.training.fp8 != "none", "training.fp8", "set training.fp8=none"),
        (
            "tiled mlp",
            recipe.training.tiled_mlp is not False,
            "training.tiled_mlp",
            "set training.tiled_mlp=false",
        ),
        (
            "bf16 weights",
            recipe.training.precision == "bf16",
            "training.precision",
            "set training.precision=bf16-mixed",
        ),
        (
            "generation",
            recipe.objective.generated_tokens() > 0,
            f"objective.name {recipe.objective.name}",
            "an objective trained on fixed data",
        ),
    ]
    return [
        f"{key}: not supported with parallel.strategy {strategy} ({parallel.unsupported[feature]}); use "
        f"parallel.strategy {_supporting(feature)}, or {instead}"
        for feature, wanted, key, instead in asked
        if wanted and not parallel.supports(feature)
    ]


@rule("export.push_to_hub_needs_export")
def _push_needs_export(recipe: Recipe) -> list[str]:
    """export.push_to_hub uploads the Hugging Face export: it needs checkpoint.export_hf."""
    if recipe.export.push_to_hub and not recipe.checkpoint.export_hf:
        return [
            "export.push_to_hub is set but checkpoint.export_hf is false; the upload is the export's folder: "
            "set checkpoint.export_hf=true"
        ]
    return []


@rule("lora.combinations")
def _lora_combinations(recipe: Recipe) -> list[str]:
    """LoRA goes together with what supports it: model.quantize needs lora; lora trains without fp8; adapters on the experts (lora.target_parameters) take no dropout, DoRA or quantised base;
    export.merge_lora needs lora."""
    lora, quantize = recipe.lora, recipe.model.quantize
    problems = []
    if quantize != "none" and lora is None:
        problems.append(
            f"model.quantize: {quantize} freezes the base weights, so only adapters can train; add a lora "
            "section (QLoRA) or set model.quantize=none"
        )
    if lora is not None and recipe.training.fp8 != "none":
        problems.append(
            "training.fp8: not supported with lora (peft cannot wrap float8 layers); set training.fp8=none"
        )
    if lora is not None and lora.target_parameters is not None:
        problems += _expert_adapter_problems(recipe)
    if recipe.export.merge_lora and lora is None:
        problems.append("export.merge_lora: there is nothing to merge without a lora section; remove it")
    return problems


def _expert_adapter_problems(recipe: Recipe) -> list[str]:
    """What peft's adapters on 3-D parameters (``lora.ParamWrapper``) refuse, said before the model
    is built: it adds B·A to the weight itself, so no dropout can apply to the input and DoRA's
    per-row norm has no row; and a quantised base is refused as untried (bitsandbytes quantises
    ``nn.Linear`` layers only: the experts would stay 16-bit next to 4-bit attention)."""
    lora, problems = recipe.lora, []
    if lora.dropout:
        problems.append(
            f"lora.dropout: {lora.dropout:g} is not supported with lora.target_parameters (peft adds the "
            "adapter to the experts' weights, so there is no input to drop out); set lora.dropout=0"
        )
    if lora.use_dora:
        problems.append(
            "lora.use_dora: not supported with lora.target_parameters (peft has no DoRA for 3-D "
            "parameters); set lora.use_dora=false or remove lora.target_parameters"
        )
    if recipe.model.quantize != "none":
        problems.append(
            f"model.quantize: {recipe.model.quantize} is not supported with lora.target_parameters "
            "(bitsandbytes leaves the experts' 3-D weights unquantised, and this is untried); set "
            "model.quantize=none or remove lora.target_parameters"
        )
    return problems


@rule("plugins.named")
def _plugins_named(recipe: Recipe) -> list[str]:
    """Each plugin is 'module:function' or a built-in name."""
    return [
        f"plugins: {name!r} is not 'module:function' or a built-in plugin ({', '.join(BUILTIN_PLUGINS)})"
        for name in recipe.plugins
        if name not in BUILTIN_PLUGINS and not _is_function_path(name)
    ]


def _is_function_path(name: str) -> bool:
    module, sep, function = name.partition(":")
    return bool(sep) and all(part.isidentifier() for part in module.split(".")) and function.isidentifier()


@rule("packages.installed")
def _packages_installed(recipe: Recipe) -> list[str]:
    """Packages the recipe's choices need are installed (deepspeed, flash-attn, torchao, peft, metric loggers)."""
    problems = []
    package, strategy = recipe.parallel.package, recipe.parallel.strategy
    if package is not None and importlib.util.find_spec(package) is None:
        problems.append(
            f"parallel.strategy: {strategy} is chosen but "
            + ("not installed" if package == strategy else f"{package} is not installed")
            + f"; install it with: pip install 'ligertune[{package}]'"
        )
    if (
        recipe.model.attn_implementation == "flash_attention_2"
        and importlib.util.find_spec("flash_attn") is None
    ):
        problems.append(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not "
            "installed; install it (pip install flash-attn --no-build-isolation) or use sdpa"
        )
    if recipe.training.fp8 != "none" and importlib.util.find_spec("torchao") is None:
        problems.append(
            f"training.fp8: {recipe.training.fp8} needs torchao, which is not installed; "
            "install it with: pip install 'ligertune[fp8]'"
        )
    if recipe.lora is not None and importlib.util.find_spec("peft") is None:
        # QLoRA's extra brings bitsandbytes too: name the one the recipe needs.
        extra = "qlora" if recipe.model.quantize != "none" else "lora"
        problems.append(
            f"lora: needs peft, which is not installed; install it with: pip install 'ligertune[{extra}]'"
        )
    # Each metric logger's package has the logger's name (tensorboard, wandb, mlflow).
    for name in [n for n in recipe.logging.selected_loggers() if importlib.util.find_spec(n) is None]:
        key = "logging.tensorboard" if name not in recipe.logging.loggers else "logging.loggers"
        problems.append(
            f"{key}: {name} is selected but not installed; install it with: pip install 'ligertune[{name}]' "
            f"or remove it from {key}"
        )
    return problems


@rule("training.memory_auto")
def _memory_auto(recipe: Recipe) -> list[str]:
    """training.global_batch_size goes with micro_batch_size auto; activation_checkpointing_every with selective."""
    training = recipe.training
    problems = []
    if training.global_batch_size is not None and training.micro_batch_size != "auto":
        problems.append(
            "training.global_batch_size: used only with training.micro_batch_size=auto (the global batch is "
            "otherwise micro_batch_size × gradient_accumulation_steps × world size); remove it or set "
            "training.micro_batch_size=auto"
        )
    selective = training.activation_checkpointing in ("selective", "auto")
    default_every = type(training).model_fields["activation_checkpointing_every"].default
    # Compared with the default, not "was it written": a saved recipe.yaml writes every key.
    if training.activation_checkpointing_every != default_every and not selective:
        problems.append(
            "training.activation_checkpointing_every: used only with training.activation_checkpointing=selective"
        )
    return problems


@rule("training.checkpointing_modules")
def _checkpointing_modules(recipe: Recipe) -> list[str]:
    """training.activation_checkpointing_modules goes with activation_checkpointing selective (auto chooses its own)."""
    training = recipe.training
    modules = training.activation_checkpointing_modules
    if modules and training.activation_checkpointing != "selective":
        return [
            f"training.activation_checkpointing_modules: [{', '.join(modules)}] is used only with "
            f"training.activation_checkpointing=selective (it is {training.activation_checkpointing}"
            + ("; auto chooses the sub-modules itself" if training.activation_checkpointing == "auto" else "")
            + "); set it to selective or remove the modules"
        ]
    return []


@rule("training.tiled_mlp")
def _tiled_mlp(recipe: Recipe) -> list[str]:
    """training.tiled_mlp goes neither with a checkpointed mlp sub-module (the tiled MLP keeps only its input already) nor with training.compile (untried)."""
    training = recipe.training
    if training.tiled_mlp is False:
        return []
    problems = []
    if "mlp" in training.activation_checkpointing_modules:
        problems.append(
            "training.tiled_mlp: the tiled MLP keeps only its input already; checkpointing it too "
            "(training.activation_checkpointing_modules [mlp]) would only add a forward: remove mlp from "
            "the modules or set training.tiled_mlp=false"
        )
    if training.compile:
        problems.append(
            "training.tiled_mlp: not with training.compile (its backward calls the MLP's forward, "
            "untried under torch.compile); set one of them to false"
        )
    return problems


# --------------------------------------------------------------------------------------------
# Model and machine rules (`ligertune.config.environment_rules`), the rules between the
# objective and the data (`ligertune.config.objective_rules`), then each component's own
# --------------------------------------------------------------------------------------------

for _name, _phase, _check in ENVIRONMENT_RULES:
    rule(_name, _phase)(_check)
for _name, _check in OBJECTIVE_RULES:
    rule(_name)(_check)
# The data section's column and role mappings (`ligertune.config.data_rules`) and the eval
# section's tasks (`ligertune.config.eval_rules`).
for _name, _check in DATA_RULES + EVAL_RULES:
    rule(_name)(_check)


def _when_chosen(component: Rule, section: str, owners: tuple[type, ...]) -> Rule:
    """A component's rule, run only when the recipe's `section` is one of `owners`."""

    def check(recipe: Recipe) -> list[str]:
        return component.check(recipe) if isinstance(getattr(recipe, section), owners) else []

    check.__doc__ = component.check.__doc__
    return Rule(component.name, check, component.phase)


for _choice in (OBJECTIVES, STRATEGIES):
    for _rule in dict.fromkeys(r for c in _choice for r in c.rules):
        RULES.append(_when_chosen(_rule, _choice.section, tuple(c for c in _choice if _rule in c.rules)))
