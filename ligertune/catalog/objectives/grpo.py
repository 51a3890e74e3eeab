"""``grpo``: online RL with group-relative advantages (GRPO, Dr. GRPO, DAPO, GSPO) on prompts whose
completions the policy generates while it trains, scored by reward functions
(`ligertune.objectives.grpo` has the loop's side, `ligertune.kernels.fused_linear_policy_loss`
the formulas)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from ligertune.catalog.formats import PROMPT_FORMATS
from ligertune.catalog.objectives.base import FrozenModel, ObjectiveOptions
from ligertune.catalog.rules import Rule
from ligertune.catalog.section import ModelSection, Section

if TYPE_CHECKING:
    from ligertune.config.schema import Recipe

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo")
BUILTIN_REWARDS = ("exact_match", "regex", "length_penalty")
# Each loss type's clip range as its paper sets it, when the recipe leaves epsilon unset:
# (ε, ε_high). DAPO's clip-higher; GSPO's ratio is a geometric mean over the sequence, hence
# ranges three orders of magnitude narrower.
DEFAULT_CLIP = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}
FUNCTION_NAME = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class RewardSpec(Section):
    """One reward function of ``objective.rewards``: ``fn`` or ``builtin``, and its weight."""

    fn: str | None = Field(
        None,
        description="A Python function as 'module:function' (a module next to the recipe, or installed), "
        "called as fn(prompt, completion, answer, metadata) → a number.",
    )
    builtin: Literal[BUILTIN_REWARDS] | None = Field(
        None,
        description="exact_match: 1 when the completion's final answer equals the data's answer "
        "(numbers compared as numbers); regex: 1 when pattern matches; length_penalty: DAPO's soft "
        "overlong punishment, 0 down to −1 over the last `buffer` tokens before max_new_tokens.",
    )
    weight: float = Field(1.0, description="Its weight in the sum that makes a completion's reward.")
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_]+$", description="Its name in the metrics (default: the function's)."
    )
    pattern: str | None = Field(None, description="regex: the regular expression (Python syntax).")
    match: Literal["search", "full"] = Field(
        "search",
        description="regex: search anywhere in the completion, or match all of it (surrounding space aside).",
    )
    buffer: int | None = Field(
        None, ge=1, description="length_penalty: the tokens before max_new_tokens over which it falls to −1."
    )

    def label(self) -> str:
        """The name its metrics carry: ``name``, the builtin's, or the function's."""
        if self.name:
            return self.name
        return self.builtin or (self.fn or "").rpartition(":")[2]


def reward_problems(recipe: Recipe) -> list[str]:
    """objective.rewards lists at least one reward, each a fn ('module:function') or a builtin with its own keys."""
    objective = recipe.objective
    if not objective.rewards:
        return [
            "objective.rewards: grpo needs at least one reward, e.g. [{builtin: exact_match}] or "
            "[{fn: my_rewards:correct, weight: 1.0}]"
        ]
    problems, labels = [], []
    for i, reward in enumerate(objective.rewards):
        key = f"objective.rewards[{i}]"
        if (reward.fn is None) == (reward.builtin is None):
            problems.append(
                f"{key}: set exactly one of fn ('module:function') and builtin ({', '.join(BUILTIN_REWARDS)})"
            )
            continue
        if reward.fn is not None and not FUNCTION_NAME.fullmatch(reward.fn):
            problems.append(f"{key}.fn: {reward.fn!r} is not 'module:function' (e.g. my_rewards:correct)")
        if (reward.pattern is not None) != (reward.builtin == "regex"):
            problems.append(
                f"{key}.pattern: {'needed by' if reward.builtin == 'regex' else 'only for'} builtin regex"
            )
        elif reward.pattern is not None:
            try:
                re.compile(reward.pattern)
            except re.error as e:
                problems.append(f"{key}.pattern: not a regular expression ({e})")
        if reward.buffer is not None and reward.builtin != "length_penalty":
            problems.append(f"{key}.buffer: only for builtin length_penalty")
        if reward.buffer is not None and reward.buffer > objective.max_new_tokens:
            problems.append(
                f"{key}.buffer: {reward.buffer} is more than objective.max_new_tokens {objective.max_new_tokens}"
            )
        labels.append(reward.label())
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        problems.append(
            f"objective.rewards: {', '.join(repeated)} named twice; give each a distinct name (its metrics' key)"
        )
    return problems


def grpo_fits(recipe: Recipe) -> list[str]:
    """A prompt leaves room for max_new_tokens in data.max_seq_len; the reference model goes with beta > 0 and no lora; no validation split (evaluation by reward is not implemented); generation_cache static only where the strategy allows CUDA graphs over its gathered weights; no training.compile (it would recompile for every generated token's shapes)."""
    objective, data = recipe.objective, recipe.data
    problems = []
    if objective.max_new_tokens >= data.max_seq_len:
        problems.append(
            f"objective.max_new_tokens: {objective.max_new_tokens} leaves no room for a prompt in data.max_seq_len "
            f"{data.max_seq_len} (a row holds both); raise data.max_seq_len or lower objective.max_new_tokens"
        )
    if objective.reference_model is not None and (objective.beta == 0 or recipe.lora is not None):
        why = (
            "beta is 0 (no KL term)"
            if objective.beta == 0
            else "with lora the reference is the adapters-off policy"
        )
        problems.append(f"objective.reference_model: not used, {why}; remove it")
    if objective.reference_model is not None:
        problem = objective.reference_model.source_problem("objective.reference_model")
        problems += [problem] if problem else []
    if data.validation_split is not None or data.validation_fraction > 0:
        key = "data.validation_split" if data.validation_split is not None else "data.validation_fraction"
        problems.append(
            f"{key}: grpo has no validation loss (its measure is the reward on new completions, which "
            "metrics.jsonl logs every step); remove it"
        )
    if objective.generation_cache == "static" and not recipe.parallel.supports("graphed generation"):
        problems.append(
            f"objective.generation_cache: static is not supported with parallel.strategy {recipe.parallel.strategy} "
            f"({recipe.parallel.unsupported['graphed generation']}); use auto or dynamic"
        )
    if recipe.training.compile:
        problems.append(
            "training.compile: grpo generates with the policy, and a compiled layer recompiles for every "
            "generated token's shapes; set training.compile=false"
        )
    return problems


class GRPOOptions(ObjectiveOptions):
    name: Literal["grpo"] = Field("grpo", description="The objective.")
    loss_type: Literal[LOSS_TYPES] = Field(
        "grpo",
        description="grpo (DeepSeekMath: token mean per completion), dr_grpo (Dr. GRPO: a constant normaliser, "
        "no length bias), dapo (DAPO: token mean over the batch, clip-higher), gspo (GSPO: sequence-level ratio).",
    )
    num_generations: int = Field(8, ge=2, le=1024, description="Completions per prompt (the group G).")
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer steps on each generation batch (μ); >1 clips against the sampling policy.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL penalty to the reference (k3 estimator); 0: no reference is held.",
    )
    reference_model: ModelSection | None = Field(
        None,
        description="The frozen reference for beta > 0 (default: the model section, i.e. the starting weights; "
        "with lora the adapters-off policy).",
    )
    epsilon: float | None = Field(
        None, gt=0, description="Lower clip: ratio ≥ 1 − ε (default 0.2; gspo 3e-4)."
    )
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clip: ratio ≤ 1 + ε_high (default ε; dapo 0.28, gspo 4e-4)."
    )
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None,
        description="Advantage = reward − its group's mean, divided by the std of the group, of the whole "
        "generation batch (every rank), or not at all (default: none for dr_grpo, group otherwise).",
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="The reward functions, each {fn: 'module:function'} or {builtin: exact_match|regex|"
        "length_penalty} with a weight; a completion's reward is their weighted sum.",
    )
    max_new_tokens: int = Field(256, ge=1, le=2**16, description="Tokens generated per completion at most.")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature of the generation.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: the smallest top tokens holding this mass."
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end a completion (kept in it); the tokenizer's EOS always does.",
    )
    generation_cache: Literal["auto", "static", "dynamic"] = Field(
        "auto",
        description="The generation's KV cache: static (preallocated at prompt + max_new_tokens, each token's "
        "step a CUDA graph on a GPU) or dynamic (grown per token, launched from Python). auto: static on a "
        "GPU where the strategy allows the graphs (none, ddp), dynamic elsewhere (the CPU, fsdp).",
    )
    log_samples_every: int = Field(
        0,
        ge=0,
        description="Write a prompt, its completions and their rewards to train.log every N steps (0: never).",
    )

    formats: ClassVar[tuple[str, ...]] = PROMPT_FORMATS
    # One pass per chunk of whole completions: log-probs, the clipped loss and its gradient.
    loss_head: ClassVar[str] = "policy"
    metrics: ClassVar[tuple[str, ...]] = (
        "reward_mean",
        "reward_std",
        "reward_<name>_mean",
        "reward_<name>_std",
        "advantage_std",
        "advantage_abs_mean",
        "zero_std_fraction",
        "completion_length",
        "truncated_fraction",
        "kl",
        "clip_fraction",
        "clip_low_fraction",
        "clip_high_fraction",
    )
    rules: ClassVar[tuple[Rule, ...]] = (
        Rule("objective.rewards", reward_problems),
        Rule("objective.grpo", grpo_fits),
    )
    summary: ClassVar[str] = (
        "online RL on prompts: generated completions, reward functions, group-relative advantages"
    )

    def clip(self) -> tuple[float, float]:
        """(ε, ε_high): the recipe's, else the loss type's paper's (`DEFAULT_CLIP`)."""
        low, high = DEFAULT_CLIP[self.loss_type]
        epsilon = self.epsilon if self.epsilon is not None else low
        if self.epsilon_high is not None:
            return epsilon, self.epsilon_high
        return epsilon, epsilon if self.epsilon is not None else high

    def reward_scaling(self) -> str:
        """``scale_rewards`` with its default resolved (none for dr_grpo, group otherwise)."""
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "none" if self.loss_type == "dr_grpo" else "group"

    def frozen_model(self, recipe: Recipe) -> FrozenModel | None:
        """With beta > 0, a frozen copy of the starting model (or of ``reference_model``); none with
        LoRA (the adapters-off policy is the reference) or without the KL term."""
        if self.beta == 0 or recipe.lora is not None:
            return None
        return FrozenModel("reference", self.reference_model or recipe.model)

    def generated_tokens(self) -> int:
        return self.max_new_tokens

    def rows_per_sample(self) -> int:
        return self.num_generations

    def updates_per_window(self) -> int:
        return self.num_iterations
