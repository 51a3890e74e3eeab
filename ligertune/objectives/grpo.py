"""``grpo``: online RL with group-relative advantages (Shao et al. 2024, "DeepSeekMath"), and the
Dr. GRPO, DAPO and GSPO variants of its loss (`ligertune.kernels.fused_linear_policy_loss` has the
formulas and the papers).

Each window of prompt micro-batches becomes a generation batch (`GRPO.prepare`, run by the loop
before the step):

1. every prompt is repeated G = ``num_generations`` times and completed by the policy itself
   (`ligertune.objectives.rollout.generate`), the whole window as one batch, with the strategy's
   weights gathered once (`Runtime.gathered`: one all-gather under FSDP2, not one per token), in eval
   mode, sampling from a generator seeded by (seed, generation, the micro-batch's place in the data
   order): the same completions on a resume and whatever the number of processes; on a GPU the
   decode is a static KV cache with each token's step a CUDA graph (``generation_cache``,
   `_generation_cache`);
2. with several updates per generation batch (``num_iterations`` μ > 1) the policy's log-probs of
   the completions now (the "old" policy of the ratio) and, with β > 0, the reference's (the
   frozen copy, or the adapters-off policy with LoRA), under ``no_grad``;
3. the rewards of every completion on this rank (`ligertune.objectives.rewards` says why each rank
   scores its own), their weighted sum, and the advantages within each group;
4. the rows `ligertune.objectives.rollout.completion_rows` lays out, with ``advantages`` and the
   log-probs, on the CPU: the loop trains on them for μ optimizer steps (and a checkpoint in
   between keeps them), then takes the next window.

The loss (`GRPO.__call__`): on the fused path the lm_head computes it chunk by chunk over the
completion positions only (`fused_linear_policy_loss` inside the lm_head's call, as the
preference objectives' one-pass loss); without the kernel, from the completion positions'
materialised logits (`policy_losses` on their log-probs, what TRL computes). What an item is
(a completion, or a token for dapo) is `policy_items`: `count` gives the loop N.

A micro-batch holds ``micro_batch_size`` prompts, so B·G rows, and whole groups: advantages never
need another micro-batch or rank (``scale_rewards: batch`` aside, one all-reduce of two sums).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ligertune.catalog.objectives.grpo import GRPOOptions
from ligertune.data.prompts import PROMPTS
from ligertune.kernels.fused_linear_policy_loss import (
    PolicyLoss,
    fused_linear_policy_loss,
    policy_items,
    policy_losses,
)
from ligertune.objectives.base import Batch, Building, Objective, ObjectiveOutput, Prepared
from ligertune.objectives.logps import completion_forward, completion_logps, lm_head_is_fused
from ligertune.objectives.reference import Placement, Reference, build_reference
from ligertune.objectives.rewards import RewardError, advantages, load_rewards, score
from ligertune.objectives.rollout import (
    Completions,
    RowNoise,
    Sampling,
    completion_rows,
    generate,
    generator_seed,
    split_rows,
)


class GRPO(Objective):
    options_model = GRPOOptions

    def __init__(self, options: GRPOOptions, reference: Reference, rewards, fused: bool, building: Building):
        self.options, self.reference, self.rewards, self.fused = options, reference, rewards, fused
        self.policy, self.runtime, self.tokenizer = building.policy, building.runtime, building.tokenizer
        self.seed = building.recipe.seed if building.recipe is not None else 0
        epsilon, epsilon_high = options.clip()
        self.spec = PolicyLoss(
            options.loss_type,
            epsilon,
            epsilon_high,
            options.beta,
            max_completion_length=options.max_new_tokens,
        )
        self.sampling = Sampling(
            options.max_new_tokens, options.temperature, options.top_p, tuple(options.stop)
        )
        self.cache = _generation_cache(options, self.runtime) if self.runtime is not None else "dynamic"

    @classmethod
    def build(cls, options: GRPOOptions, building: Building) -> GRPO:
        fused = building.policy is not None and lm_head_is_fused(building.policy)
        reference = build_reference("frozen" if options.beta > 0 else "none", options, building, fused)
        directory = building.recipe.base_dir if building.recipe is not None else None
        rewards = load_rewards(options.rewards, directory, options.max_new_tokens)
        return cls(options, reference, rewards, fused, building)

    # -- the loss ----------------------------------------------------------------------------

    def count(self, batch: Batch) -> int:
        return int(policy_items(batch["completion_mask"], self.spec.loss_type))

    def __call__(self, model: nn.Module, batch: Batch, num_items: torch.Tensor) -> ObjectiveOutput:
        inputs = (batch["advantages"], batch.get("old_logps"), batch.get("ref_logps"))
        if self.fused:
            found = {}

            def head(hidden, weight, target, bias=None, *, ignore_index=-100, softcap=None, **_):
                found["out"] = fused_linear_policy_loss(
                    hidden, weight, target, *inputs, bias, spec=self.spec, num_items=num_items,
                    ignore_index=ignore_index, softcap=softcap,
                )  # fmt: skip
                return found["out"].loss

            # The model output's loss: the tensor a wrapper (DDP) hands back, which backward starts from.
            return ObjectiveOutput(completion_forward(model, batch, head).loss, found["out"].metrics)
        rows, metrics = policy_losses(
            completion_logps(model, batch, False), batch["completion_mask"], *inputs, self.spec
        )
        n = num_items.to(torch.float32)
        return ObjectiveOutput(rows.sum() / n, {k: v.float().sum() / n for k, v in sorted(metrics.items())})

    # -- the generation batch ----------------------------------------------------------------

    def prepare(self, model: nn.Module, window: list[Batch], step: int) -> Prepared:
        """The generation batch of optimizer step `step` and the μ − 1 after it (module docstring)."""
        options, runtime = self.options, self.runtime
        group = options.num_generations
        done = self._generate(window, step // options.num_iterations)
        rows = [self._rows(model, *completed) for completed in done]
        stopped = torch.cat([completed.stopped.cpu() for *_, completed in done])
        prompts = [prompt for batch in window for prompt in batch[PROMPTS]]
        completions = [self._text(row) for row in rows]
        texts = [text for batch in completions for text in batch]
        lengths = torch.cat([row["completion_mask"].sum(-1) for row in rows])
        values, error = score(self.rewards, prompts, texts, lengths.tolist(), group)
        if runtime.max_over_ranks([int(error is not None)])[0]:
            raise RewardError(
                error or "objective.rewards: a reward function failed on another rank; its log names it"
            )
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        total = values @ weights
        scaling = options.reward_scaling()
        batch_std = _batch_std(runtime, total) if scaling == "batch" else None
        adv, agree = advantages(total, group, scaling, batch_std)
        for row, part in zip(
            rows, adv.float().split([len(row["completion_mask"]) for row in rows]), strict=True
        ):
            row["advantages"] = part
        metrics = _metrics(runtime, self.rewards, values, total, adv, agree, lengths, stopped)
        report = None
        if runtime.rank == 0 and _shows_samples(options, step):
            report = _samples(step, prompts[0], texts[:group], values[:group], total[:group], self.rewards)
        return Prepared(rows, metrics, report)

    def _generate(self, window: list[Batch], generation: int) -> list[tuple]:
        """The window's prompts, each repeated G times, completed as one batch in eval mode with
        the policy's weights gathered once, then cut back into its micro-batches (`split_rows`).
        Micro-batch i of this rank is slice i · world + rank of the data order
        (`ligertune.data.loader`): its rows draw from a generator seeded by that slice (`RowNoise`)."""
        group, runtime, policy, tokenizer = (
            self.options.num_generations,
            self.runtime,
            self.policy,
            self.tokenizer,
        )
        width = max(batch["input_ids"].shape[1] for batch in window)

        def left_padded(batch, key, value):  # to the window's longest prompt
            x = batch[key].repeat_interleave(group, 0)
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value).to(runtime.device)

        ids = torch.cat([left_padded(batch, "input_ids", tokenizer.pad_token_id) for batch in window])
        mask = torch.cat([left_padded(batch, "attention_mask", 0) for batch in window])
        rows = [batch["input_ids"].shape[0] * group for batch in window]
        places = [index * runtime.world_size + runtime.rank for index in range(len(window))]
        noise = RowNoise(
            [generator_seed(self.seed, generation, place) for place in places], rows, runtime.device
        )
        was_training = policy.training
        policy.eval()
        try:
            with runtime.gathered(policy):
                done = generate(
                    policy, ids, mask, self.sampling, noise,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer,
                    cache=self.cache,
                )  # fmt: skip
        finally:
            policy.train(was_training)
        return split_rows(ids, mask, done, rows)

    @torch.no_grad()
    def _rows(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, done: Completions) -> Batch:
        """One micro-batch's rows (`completion_rows`) with the old policy's and the reference's
        log-probs where the loss needs them, on the CPU."""
        row = completion_rows(ids, mask, done)
        if self.options.num_iterations > 1:
            row["old_logps"] = completion_logps(model, row, self.fused).float()
        if self.options.beta > 0:
            row["ref_logps"] = self.reference.run(model, row, completion_logps).float()
        return {k: v.cpu() for k, v in row.items()}

    def _text(self, row: Batch) -> list[str]:
        length = row["completion_mask"].shape[1]
        ids = torch.where(row["completion_mask"], row["input_ids"][:, -length:], self.tokenizer.pad_token_id)
        return self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)


def _generation_cache(options: GRPOOptions, runtime: Placement) -> str:
    """``objective.generation_cache`` resolved: auto is static (each decode step a CUDA graph) on a
    GPU under a strategy that allows the graphs, dynamic on the CPU (no launches to save, and a
    static cache reads every empty column) and under FSDP2 (its hooks inside a capture are
    untried)."""
    if options.generation_cache != "auto":
        return options.generation_cache
    graphs = runtime.options_model.supports("graphed generation")
    return "static" if runtime.device.type == "cuda" and graphs else "dynamic"


def _batch_std(runtime: Placement, total: torch.Tensor) -> float:
    """The sample std of the rewards of the whole generation batch, every rank's."""
    n, s, s2 = runtime.all_reduce_sum(
        torch.tensor([len(total), total.sum(), (total**2).sum()], dtype=torch.float64, device=runtime.device)
    ).tolist()
    return math.sqrt(max(0.0, (s2 - s * s / n) / max(n - 1, 1)))


def _metrics(runtime, rewards, values, total, adv, agree, lengths, stopped) -> dict[str, float]:
    """The generation batch's means and standard deviations over every rank (one all-reduce)."""
    columns = [total, *values.T]
    sums = torch.stack(
        [
            torch.tensor(float(len(total)), dtype=torch.float64),
            *(c.sum() for c in columns),
            *((c**2).sum() for c in columns),
            adv.sum(),
            (adv**2).sum(),
            adv.abs().sum(),
            torch.tensor(float(len(agree)), dtype=torch.float64),
            agree.double().sum(),
            lengths.double().sum(),
            (~stopped).double().sum(),
        ]
    )
    reduced = runtime.all_reduce_sum(sums.to(runtime.device)).tolist()
    n, k = reduced[0], len(columns)
    means, squares = reduced[1 : 1 + k], reduced[1 + k : 1 + 2 * k]
    a_sum, a2_sum, a_abs, groups, agreeing, length_sum, truncated = reduced[1 + 2 * k :]

    def std(mean: float, square: float) -> float:
        return math.sqrt(max(0.0, square / n - mean * mean) * n / max(n - 1, 1))

    metrics = {"reward_mean": means[0] / n, "reward_std": std(means[0] / n, squares[0])}
    for reward, total_k, square_k in zip(rewards, means[1:], squares[1:], strict=True):
        metrics[f"reward_{reward.label}_mean"] = total_k / n
        metrics[f"reward_{reward.label}_std"] = std(total_k / n, square_k)
    metrics.update(
        advantage_std=std(a_sum / n, a2_sum),
        advantage_abs_mean=a_abs / n,
        zero_std_fraction=agreeing / groups,
        completion_length=length_sum / n,
        truncated_fraction=truncated / n,
    )
    return metrics


def _shows_samples(options: GRPOOptions, step: int) -> bool:
    """Whether one of the steps this generation batch serves (step … step + μ − 1) is a multiple
    of ``log_samples_every`` (counting steps from 1)."""
    every = options.log_samples_every
    return bool(every) and (step + options.num_iterations) // every > step // every


def _samples(step, prompt, texts, values, total, rewards) -> str:
    """The report of `Prepared`: the window's first prompt and its completions with their rewards."""
    lines = [
        f"step {step + 1} samples: prompt {prompt.text[-300:]!r}"
        + (f", answer {prompt.answer!r}" if prompt.answer is not None else "")
    ]
    for text, row, value in zip(texts, values.tolist(), total.tolist(), strict=True):
        parts = ", ".join(f"{r.label} {v:.2f}" for r, v in zip(rewards, row, strict=True))
        lines.append(f"  reward {value:.2f} ({parts}): {text[:300]!r}")
    return "\n".join(lines)
