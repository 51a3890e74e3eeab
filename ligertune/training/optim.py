"""The optimizer, the learning-rate schedule and the autocast context of a run."""

from __future__ import annotations

import contextlib
import math
from functools import partial

import torch
from torch import nn

from ligertune.config import TrainingSection


def lr_factor(steps_done: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step s = steps_done + 1 (1-based).

    Warmup: s/warmup for s ≤ warmup, so the first step already moves and step `warmup`
    reaches the peak. Decay over the remaining D = total − warmup steps, with progress
    p = (s − warmup − 1)/D ∈ [0, 1): the first step after warmup is at the peak and the last
    one just above min_ratio (the value reached "after" the last step).
    cosine: r + (1−r)·(1 + cos πp)/2; linear: r + (1−r)·(1 − p); constant: 1.
    """
    s = steps_done + 1
    if s <= warmup:
        return s / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, (s - warmup - 1) / max(1, total - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p
    return min_ratio + (1.0 - min_ratio) * decay


def group_hyperparameters(training: TrainingSection) -> list[dict]:
    """The AdamW hyper-parameters of each parameter group, in `build_optimizer`'s group order
    (decayed matrices, then vectors). One place, because a resume sets them again: the
    optimizer state it loads carries the saved run's values."""
    common = {"lr": training.lr, "betas": tuple(training.adam_betas), "eps": training.adam_eps}
    return [{**common, "weight_decay": training.weight_decay}, {**common, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, training: TrainingSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW with two parameter groups: weight decay on matrices (linear layers,
    embeddings), none on vectors (norm weights, biases), where shrinking towards zero only
    changes the model's scale or offset. Fused (one kernel for all parameters) on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": params, **hyper}
        for params, hyper in zip((decay, no_decay), group_hyperparameters(training), strict=True)
    ]
    return torch.optim.AdamW(groups, fused=device.type == "cuda")


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingSection, total_steps: int):
    """LambdaLR over `lr_factor`. The factor is a function of the step alone (the recipe's
    warmup, schedule, min ratio and this run's `total_steps` are bound in), so after a resume
    the schedule already follows the current recipe; only the peak lr (``base_lrs``), which
    the scheduler's saved state brings back, needs `apply_hyperparameters`."""
    schedule = partial(
        lr_factor,
        warmup=training.warmup_steps,
        total=total_steps,
        schedule=training.lr_schedule,
        min_ratio=training.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, training: TrainingSection) -> None:
    """After a resume loaded the optimizer and scheduler state: make the current recipe's
    hyper-parameters the ones in force, and the lr the one its schedule gives at the resumed step.

    ``optimizer.load_state_dict`` replaces the param groups' hyper-parameters (lr, betas, eps,
    weight decay, ``initial_lr``) with the saved ones and ``LambdaLR.load_state_dict`` brings
    back the saved peak lr (``base_lrs``); left alone, a resume with a lower ``training.lr``
    would train at the old one. The schedule's steps done (``last_epoch``) stay the saved ones.
    """
    hyper = group_hyperparameters(training)
    if len(hyper) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer has {len(optimizer.param_groups)} parameter groups, the recipe describes {len(hyper)}"
        )
    for group, values in zip(optimizer.param_groups, hyper, strict=True):
        group.update(values)
        group["initial_lr"] = values["lr"]
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    steps_done = scheduler.last_epoch
    lrs = [
        base * factor(steps_done)
        for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16-mixed``; nothing for ``fp32`` and ``bf16`` (already bf16)."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
