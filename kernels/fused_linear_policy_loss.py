"""The clipped policy-gradient losses of online RL (GRPO and its variants), fused with the lm_head:
per-token log-probs, importance ratios, clipping and the KL penalty computed chunk by chunk inside
the log-prob kernel's loop, the gradient in the same pass, and no [tokens × vocab] logits.

The losses (completions i = 1..R of the generation batch, grouped G per prompt; tokens t of
completion i with mask m_it; A_i its advantage, computed beforehand from the rewards; log-probs
ℓ_it under the policy π_θ, ℓ^old_it under the policy that sampled it, ℓ^ref_it under a frozen
reference):

    r_it = exp(ℓ_it − ℓ^old_it)                                         token importance ratio
    c_it = −min(r_it · A_i, clip(r_it, 1 − ε, 1 + ε_high) · A_i)        clipped surrogate (PPO)
    k_it = exp(ℓ^ref_it − ℓ_it) − (ℓ^ref_it − ℓ_it) − 1                  KL(π_θ ‖ π_ref), k3 estimator
    x_it = c_it + β · k_it

    grpo     L = 1/R · Σ_i 1/|o_i| Σ_t m_it x_it        Shao et al. 2024, "DeepSeekMath: Pushing the
                                                       Limits of Mathematical Reasoning in Open
                                                       Language Models", eq. 3 (ε_high = ε there)
    dr_grpo  L = 1/(R · L_max) · Σ_i Σ_t m_it x_it      Liu et al. 2025, "Understanding R1-Zero-Like
                                                       Training: A Critical Perspective": the
                                                       1/|o_i| length bias removed (a constant L_max,
                                                       the generation's max_new_tokens, instead)
    dapo     L = 1/Σ_i |o_i| · Σ_i Σ_t m_it x_it        Yu et al. 2025, "DAPO: An Open-Source LLM
                                                       Reinforcement Learning System at Scale":
                                                       token-level normalisation, and clip-higher
                                                       (ε_high > ε, 0.28 against 0.2 in the paper)
    gspo     s_i = exp(1/|o_i| Σ_t m_it (ℓ_it − ℓ^old_it))              sequence importance ratio
             L = 1/R · Σ_i [−min(s_i A_i, clip(s_i, 1 − ε, 1 + ε_high) A_i) + β/|o_i| Σ_t m_it k_it]
                                                       Zheng et al. 2025, "Group Sequence Policy
                                                       Optimization" (the paper uses ε of order
                                                       3e-4 and 4e-4: its ratio is a geometric mean)

The k3 estimator (Schulman 2020, "Approximating KL Divergence") is unbiased for KL(π_θ ‖ π_ref)
on samples of π_θ and never negative. With one policy update per generation batch the old
policy *is* the current one: ℓ^old = ℓ detached, r = 1 and the gradient is A·∇ℓ (a plain policy
gradient); with several, ℓ^old was computed when the batch was generated.

Clip edges: the surrogate is clipped when r > 1 + ε_high with A > 0, or r < 1 − ε with A < 0;
at r exactly on an edge both branches of the minimum are equal and the gradient flows (as
``torch.minimum`` and ``torch.clamp`` differentiate: a tie splits the gradient, clamp passes it
at its bounds), which is the formula's one-sided limit from inside the trust region.

How each term is split over the rows, so that the loss of a micro-batch is a sum of per-row
terms divided by one count N known before the forward (`ligertune.objectives.base`): the *items*
are completions for grpo, dr_grpo and gspo (N = R over the whole window and every rank) and
tokens for dapo (N = Σ|o_i|); `policy_items` counts them. The reported metrics are divided by
the same N, so each row reports its token mean (sequence items) or its token sum (token items).

The chunk loop is `fused_linear_logprobs`' one-pass mode with a per-token group loss
(``GroupLoss(per_token=True)``, groups of one row): per chunk of whole completions the logits
(one matmul), their log-probs (the CE kernel), `policy_losses` and its per-token gradient by
autograd on the chunk's [rows, T] scalars, then the CE kernel again scaling each token's
``softmax − onehot`` by that gradient, and dh, dW, db. Three lm_head matmuls per step; the
reference's and the old policy's log-probs are inputs (computed under ``no_grad`` beforehand,
through `fused_linear_logprobs`). A chunk holds at least one whole completion (gspo needs the
row's sum; the others could be split, which buys nothing below a few thousand completion
tokens per row): T × V logits in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .fused_linear_logprobs import GroupLoss, fused_linear_logprobs, fused_linear_logprobs_reference

__all__ = [
    "LOSS_TYPES",
    "PolicyLoss",
    "PolicyLossOutput",
    "fused_linear_policy_loss",
    "fused_linear_policy_loss_reference",
    "policy_items",
    "policy_losses",
]

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo")
TOKEN_ITEMS = ("dapo",)  # the loss types that average over tokens; the others over completions


@dataclass(frozen=True)
class PolicyLoss:
    """Which loss (module docstring) and its constants."""

    loss_type: str = "grpo"
    epsilon: float = 0.2  # the lower clip: r ≥ 1 − ε
    epsilon_high: float | None = None  # the upper clip: r ≤ 1 + ε_high (None: ε)
    beta: float = 0.0  # the KL penalty's weight; 0: no reference needed
    max_completion_length: int | None = None  # dr_grpo's L_max (None: the rows' length T)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: use one of {LOSS_TYPES}")
        if self.epsilon < 0 or self.high < 0 or self.beta < 0:
            raise ValueError(f"epsilon, epsilon_high and beta must be ≥ 0, got {self}")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # 0-d: Σ_rows loss / num_items, differentiable in hidden, weight, bias
    metrics: dict[str, torch.Tensor]  # 0-d each, Σ_rows / num_items, detached


def policy_items(mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """What the loss averages over (module docstring), from the [R, T] completion mask: its
    tokens for dapo, its rows for the others. A 0-d int64 tensor on the mask's device."""
    if loss_type in TOKEN_ITEMS:
        return mask.sum()
    return torch.tensor(mask.shape[0], device=mask.device)


def policy_losses(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    spec: PolicyLoss,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(each row's term of Σ_i, [g]; per-row metrics, [g] each) from the rows' per-token
    log-probs [g, T] (differentiable), their mask [g, T], advantages [g] and the old policy's and
    the reference's log-probs [g, T] (None: the current log-probs detached, i.e. ratio 1, and no
    KL). Computed in the log-probs' dtype (fp32 from the kernel, fp64 in the oracle's checks)."""
    dtype = logps.dtype
    m = mask.to(dtype)
    lengths = m.sum(-1)
    old = logps.detach() if old_logps is None else old_logps.to(dtype)
    a = advantages.to(dtype)[:, None]
    low, high = 1 - spec.epsilon, 1 + spec.high
    # Per item: completions weigh each token 1/|o_i| in the metrics, tokens weigh 1.
    sequence_items = spec.loss_type not in TOKEN_ITEMS
    weight = 1 / lengths.clamp_min(1) if sequence_items else torch.ones_like(lengths)
    if spec.loss_type == "gspo":
        ratio = torch.exp(((logps - old) * m).sum(-1, keepdim=True) / lengths.clamp_min(1)[:, None])
    else:
        ratio = torch.exp(logps - old)
    surrogate = -torch.minimum(ratio * a, ratio.clamp(low, high) * a)
    clipped_low = (ratio < low) & (a < 0)
    clipped_high = (ratio > high) & (a > 0)
    kl = None
    if ref_logps is not None:
        delta = ref_logps.to(dtype) - logps
        kl = torch.exp(delta) - delta - 1
    if spec.loss_type == "gspo":  # one surrogate per sequence, then the KL's token mean
        row = surrogate[:, 0] * (lengths > 0)
        if kl is not None and spec.beta:
            row = row + spec.beta * (kl * m).sum(-1) / lengths.clamp_min(1)
    else:
        token = surrogate + spec.beta * kl if kl is not None and spec.beta else surrogate
        row = (token * m).sum(-1)
        if spec.loss_type == "grpo":
            row = row / lengths.clamp_min(1)
        elif spec.loss_type == "dr_grpo":
            row = row / (spec.max_completion_length or logps.shape[-1])

    def per_row(x: torch.Tensor) -> torch.Tensor:  # Σ_t over the mask, weighted per item
        return (x.to(dtype).expand_as(m) * m).sum(-1) * weight

    metrics = {
        "clip_fraction": per_row(clipped_low | clipped_high),
        "clip_low_fraction": per_row(clipped_low),
        "clip_high_fraction": per_row(clipped_high),
    }
    if kl is not None:
        metrics["kl"] = per_row(kl.detach())
    return row, {k: v.detach() for k, v in metrics.items()}


def _group_loss(target, advantages, old_logps, ref_logps, spec, num_items, ignore_index) -> GroupLoss:
    """`policy_losses` as the per-token `GroupLoss` of `fused_linear_logprobs` (groups of one
    row): each chunk's Σ of row terms over N, with the per-row metrics as its extras."""
    rows = advantages.shape[0]
    mask = (target != ignore_index).view(rows, -1)
    n = num_items.to(torch.float32)

    def fn(token_logps: torch.Tensor, chunk: slice):
        def part(x):
            return None if x is None else x[chunk]

        losses, metrics = policy_losses(
            token_logps[0], mask[chunk], advantages[chunk], part(old_logps), part(ref_logps), spec
        )
        return losses.sum() / n.to(losses.dtype), metrics

    return GroupLoss(fn, rows=rows, size=1, per_token=True)


def _check(hidden, target, advantages, old_logps, ref_logps, spec) -> None:
    rows = advantages.shape[0] if advantages.dim() == 1 else -1
    if rows < 1 or target.shape != (hidden.shape[0],) or hidden.shape[0] % rows:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, target {tuple(target.shape)}, advantages {tuple(advantages.shape)}: "
            "expected [R·T, H], [R·T] and [R] (the completions' tokens, row by row)"
        )
    shape = (rows, hidden.shape[0] // rows)
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; expected {shape} (rows × completion tokens)"
            )
    if spec.beta and ref_logps is None:
        raise ValueError(f"beta={spec.beta} needs ref_logps (the reference's per-token log-probs)")


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    spec: PolicyLoss = PolicyLoss(),
    num_items: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    memory_budget_bytes: int | None = None,
    reference: bool = False,
) -> PolicyLossOutput:
    """The policy loss of the module docstring over R completions of T tokens each (padded):
    hidden [R·T, H] (the hidden states *predicting* each completion token, row by row), weight
    [V, H], target [R·T] (the completion tokens, `ignore_index` on padding), advantages [R],
    old_logps and ref_logps [R, T] (or None). Returns Σ_rows loss / `num_items` (default: this
    batch's `policy_items`) and the metrics likewise; gradients reach hidden, weight and bias.
    `reference`: the materialised oracle (`fused_linear_policy_loss_reference`)."""
    _check(hidden, target, advantages, old_logps, ref_logps, spec)
    rows = advantages.shape[0]
    if num_items is None:
        num_items = policy_items((target != ignore_index).view(rows, -1), spec.loss_type)
    num_items = torch.as_tensor(num_items, device=hidden.device).clamp_min(1)
    group = _group_loss(target, advantages, old_logps, ref_logps, spec, num_items, ignore_index)
    run = fused_linear_logprobs_reference if reference else fused_linear_logprobs
    options = {} if reference else {"memory_budget_bytes": memory_budget_bytes}
    out = run(
        hidden, weight, target, bias, ignore_index=ignore_index, softcap=softcap, group_loss=group, **options
    )
    n = num_items.to(torch.float32)
    return PolicyLossOutput(out.loss, {k: v.float().sum() / n for k, v in sorted(out.extras.items())})


def fused_linear_policy_loss_reference(*args, **kwargs) -> PolicyLossOutput:
    """Plain PyTorch: the logits materialised, ``log_softmax`` in fp32 (fp64 for fp64 inputs),
    `policy_losses` on all rows at once (autograd does the rest). The CPU fallback's math and
    what a TRL-style loss computes."""
    return fused_linear_policy_loss(*args, **kwargs, reference=True)
