"""``ligertune validate --check``: a patched and an unpatched copy of a model on one batch.

`parity_check` compares the training loss (the fused path when that kernel is on), every
parameter gradient and the eval-mode logits of the two copies; `check_recipe` runs it on a
recipe's own model (shrunk with ``model.config_overrides`` when it is large).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ligertune.config import Recipe
from ligertune.errors import RecipeError
from ligertune.kernels._utils import INTERPRET
from ligertune.models.build import build_config, build_model, param_dtype
from ligertune.patching.apply import KernelSelection, patch_model
from ligertune.patching.report import PatchReport

# fp32: patched and unpatched run the same math with different summation orders and fusion;
# measured differences are ~1e-7 relative, 1e-5 leaves room for depth and vocabulary size.
FP32_TOL = 1e-5
# 16-bit: the two models round at different places (the kernels keep fp32 intermediates that
# HF rounds to bf16), so they are compared through an fp32 run of the same weights: the patched
# model's error must be at most `LOW_PRECISION_FACTOR` times HF's own, plus 2⁻⁸ (one bf16
# rounding) of slack for quantities where HF happens to land very close. The factor is 3, not 2:
# on a tiny Qwen3 the small q_norm/k_norm weight gradients are noisy (sums over few rows with
# cancellation), and over 80 random batches the worst tensor's error reached 2.08× HF's
# (median 1.16×), so 2× failed a correct model about one time in forty. An error of a few
# percent, a wrong kernel in 16-bit, is still far outside it.
LOW_PRECISION_FACTOR = 3.0
LOW_PRECISION_SLACK = 2.0**-8


@dataclass
class ParityCheck:
    name: str
    error: float  # relative error of the patched model (vs HF, or vs the fp32 run in 16-bit)
    tolerance: float
    hf_error: float | None = None  # 16-bit only: HF's own relative error vs the fp32 run

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance

    def __str__(self) -> str:
        hf = f", HF {self.hf_error:.2e}" if self.hf_error is not None else ""
        return f"{self.name}: {self.error:.2e} (tol {self.tolerance:.2e}{hf}) {'ok' if self.ok else 'FAIL'}"


@dataclass
class ParityResult:
    dtype: torch.dtype
    report: PatchReport
    checks: list[ParityCheck]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[ParityCheck]:
        return [c for c in self.checks if not c.ok]

    def __str__(self) -> str:
        against = "HF" if self.dtype == torch.float32 else "an fp32 run (HF's error shown)"
        lines = [
            f"parity {str(self.dtype).removeprefix('torch.')}, patched vs {against}: "
            f"{'PASS' if self.ok else 'FAIL'}"
        ]
        grads = [c for c in self.checks if c.name.startswith("grad ")]
        lines += [f"  {c}" for c in self.checks if not c.name.startswith("grad ")]
        if grads:
            worst = max(grads, key=lambda c: c.error / c.tolerance if c.tolerance else math.inf)
            lines.append(f"  grads: {len(grads)} tensors, worst {worst}")
            lines += [f"  {c}" for c in grads if not c.ok and c is not worst]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def _run(model: nn.Module, batch: dict, seed: int) -> dict[str, torch.Tensor]:
    """Loss and gradients in train mode (with labels: the fused path), logits in eval mode."""
    model.zero_grad(set_to_none=True)
    model.train()
    devices = [model.device] if getattr(model, "device", torch.device("cpu")).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # same dropout masks in every run
        torch.manual_seed(seed)
        loss = model(**batch).loss
    loss.backward()
    results = {"loss": loss.detach()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            results[f"grad {name}"] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    model.eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        results["logits (eval)"] = model(**inputs).logits
    return results


def _as_model(source, device, dtype) -> nn.Module:
    if isinstance(source, nn.Module):
        model = copy.deepcopy(source)
    elif callable(source):
        model = source()
    else:  # a transformers config
        model = AutoModelForCausalLM.from_config(source)
    return model.to(device=device, dtype=dtype)


def parity_check(
    model_factory_or_config,
    batch: Mapping[str, torch.Tensor],
    kernels: KernelSelection = None,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> ParityResult:
    """Compare a patched and an unpatched copy of one model on one batch.

    ``model_factory_or_config``: a model (deep-copied, left untouched), a callable returning one,
    or a transformers config (random init). ``batch``: ``input_ids`` (``attention_mask``
    optional); ``labels`` default to ``input_ids``. Checked, as relative norms of the difference:
    the training loss (the fused path when that kernel is on), every parameter gradient, and the
    eval-mode logits (HF's path: no labels). Tolerances: `FP32_TOL` in fp32; in bf16/fp16 both
    models are compared with an fp32 run of the same weights (see `LOW_PRECISION_FACTOR`).
    """
    if "input_ids" not in batch:
        raise ValueError("batch needs input_ids (and optionally attention_mask and labels)")
    device = torch.device(device) if device is not None else batch["input_ids"].device
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.setdefault("labels", batch["input_ids"].clone())
    reference = _as_model(model_factory_or_config, device, dtype)
    patched = copy.deepcopy(reference)
    report = patch_model(patched, kernels)
    hf, ours = _run(reference, batch, seed), _run(patched, batch, seed)
    checks = []
    if dtype == torch.float32:
        for name, ref in hf.items():
            checks.append(
                ParityCheck(name, _rel_err(ours[name], ref) if name in ours else math.inf, FP32_TOL)
            )
    else:
        truth = _run(reference.float(), batch, seed)
        for name, ref in truth.items():
            hf_err = _rel_err(hf[name], ref)
            err = _rel_err(ours[name], ref) if name in ours else math.inf
            checks.append(ParityCheck(name, err, LOW_PRECISION_FACTOR * hf_err + LOW_PRECISION_SLACK, hf_err))
    checks += [ParityCheck(name, math.inf, 0.0) for name in ours.keys() - hf.keys()]
    return ParityResult(dtype, report, checks)


# Largest model `check_recipe` builds: it holds two (in 16-bit three) copies with gradients.
CHECK_MAX_PARAMS = {"cpu": 300_000_000, "cuda": 3_000_000_000}


def check_recipe(recipe: Recipe, device: torch.device | str | None = None) -> ParityResult:
    """`parity_check` on the recipe's own model (``ligertune validate --check``).

    The model comes from `ligertune.models.build.build_model`, so ``model.config_overrides`` apply:
    that is how a big architecture is shrunk for the check (``num_hidden_layers=2``, ...). The
    batch is two random rows of ``min(data.max_seq_len, 128)`` tokens (32 on CPU) whose first
    quarter is masked with -100 like a prompt; the dtype is the precision's parameter dtype.
    """
    if device is None:
        wanted = recipe.training.device
        device = "cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu"
    device = torch.device(device)
    config = build_config(recipe)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=recipe.model.trust_remote_code
        )
        n_params = sum(p.numel() for p in meta_model.parameters())
    limit = CHECK_MAX_PARAMS[device.type]
    if n_params > limit:
        raise RecipeError(
            [
                f"validate --check: the model has {n_params / 1e9:.1f}B parameters, more than the check builds on "
                f"{device.type} ({limit / 1e9:.1f}B); shrink it for the check with model.config_overrides, e.g. "
                "model.config_overrides.num_hidden_layers=2 (on CPU also smaller hidden_size, "
                "intermediate_size and vocab_size)"
            ]
        )
    generator = torch.Generator().manual_seed(recipe.seed)
    seq_len = min(recipe.data.max_seq_len, 128 if device.type == "cuda" else 32)
    input_ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, : seq_len // 4] = -100
    batch = {"input_ids": input_ids, "labels": labels}
    dtype = param_dtype(recipe.training.precision)
    result = parity_check(
        lambda: build_model(recipe, device), batch, recipe.kernels, dtype, device=device, seed=recipe.seed
    )
    if device.type == "cpu" and not INTERPRET:
        result.notes.append(
            "no GPU: the kernels ran their PyTorch references; set TRITON_INTERPRET=1 to run the Triton code "
            "in its CPU interpreter (slow)"
        )
    return result
