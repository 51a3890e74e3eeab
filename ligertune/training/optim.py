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


def build_optimizer(model: nn.Module, training: TrainingSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW with two parameter groups: weight decay on matrices (linear layers,
    embeddings), none on vectors (norm weights, biases), where shrinking towards zero only
    changes the model's scale or offset. Fused (one kernel for all parameters) on CUDA."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=training.lr, betas=training.adam_betas, eps=training.adam_eps, fused=device.type == "cuda"
    )


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingSection, total_steps: int):
    schedule = partial(
        lr_factor,
        warmup=training.warmup_steps,
        total=total_steps,
        schedule=training.lr_schedule,
        min_ratio=training.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16-mixed``; nothing for ``fp32`` and ``bf16`` (already bf16)."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
