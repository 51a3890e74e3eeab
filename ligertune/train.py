"""The training loop: `train(recipe)`, read top to bottom.

    runtime → tokenizer and data → model (patch, checkpointing, compile, wrap) → optimizer
    and schedule → resume → [ step → log → evaluate → checkpoint ]* → final checkpoint,
    evaluation, Hugging Face export, summary

One optimizer step
    Takes the next ``gradient_accumulation_steps`` micro-batches from a stream that runs
    across epoch boundaries (the data position is the epoch and the index of the next
    micro-batch in it, which is all a resume needs). The step's loss is the mean token loss
    over *every* label token of the window, on every rank:

        loss = Σ_micro Σ_tokens CE  /  N,   N = label tokens in the window, summed over ranks

    Each micro-batch's forward gets ``num_items_in_batch=N``; Hugging Face's causal-LM loss
    (and the patched fused linear cross entropy, which takes over the same forward) then
    returns that micro-batch's *summed* token loss divided by N, and the backward passes add
    up to the gradient of the window's mean. A mean of per-micro-batch means would weight a
    token in a short micro-batch more than one in a long one, so 4×1 and 1×4 micro-batches
    of the same rows would train differently; with this normalisation they give the same
    loss and gradients. Labels are counted the way the loss counts them: shifted by one
    (position t predicts token t+1) and without the ignore index -100.

Precision (``training.precision``)
    - ``fp32``: fp32 parameters, no autocast. The only choice on CPU (see below).
    - ``bf16-mixed``: fp32 master parameters, gradients and AdamW state, forward and backward
      under ``torch.autocast(bfloat16)``. Matmuls run on bf16 tensor cores; updates are
      exact in fp32. Costs 4+4+8 bytes per parameter (weights, grads, Adam moments) plus
      the bf16 activation copies.
    - ``bf16``: bf16 parameters, gradients and AdamW state; half the memory of the above.
      The risk: bf16 has 8 significant bits, so an update smaller than about 2⁻⁹ of a
      weight rounds away entirely (with lr 2e-5 and weights of size 0.02, Adam's ~lr-sized
      steps sit right at that edge). Fine-tuning usually tolerates it, long runs at low
      learning rates may stall; use ``bf16-mixed`` when in doubt and memory allows.
    CPU runs must use fp32: CPUs have no bf16 matrix units worth the accuracy loss, and
    Triton's CPU interpreter computes bf16 arithmetic wrongly, so a bf16 CPU run would be
    slow and would not test what the GPU runs. Asking for it is an error naming the fix.

Non-finite loss or gradient norm (``training.on_nonfinite``)
    ``stop``: the gradients are dropped, a checkpoint of the last good state is saved
    (weights, optimizer and schedule from before the failing step, and the data position of
    the failing step, so a resume with a lower lr replays it), and `TrainingError` names the
    step. ``skip``: the gradients are dropped and the optimizer step is skipped; the step
    still counts (the schedule and the data move on), so a run that keeps failing ends.

Stopping early
    SIGTERM or SIGINT (Kubernetes preemption, Ctrl-C) lets the current step finish, saves a
    checkpoint and returns with `TrainResult.signal` set; the CLI then exits with the
    conventional status 128 + signal number (143 for SIGTERM, 130 for SIGINT), so a job
    controller sees "terminated", not "succeeded", and restarts the job, which resumes from
    that checkpoint (``checkpoint.resume: auto``). A second Ctrl-C aborts at once. The
    `on_step_end` hook can request the same stop by returning True.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ligertune.checkpoint import CheckpointManager, atomic_directory, load_checkpoint, restore_rng_state
from ligertune.data import MicroBatchLoader, build_datasets, load_tokenizer
from ligertune.data.formats import IGNORE_INDEX
from ligertune.distributed import Runtime, create_runtime
from ligertune.metrics import (
    MetricsLogger,
    RunSummary,
    Throughput,
    flops_per_token,
    peak_bf16_flops,
    peak_memory_gib,
)
from ligertune.models import build_model, check_vocab, prepare_for_training
from ligertune.recipe import Recipe, RecipeError, TrainingSection, recipe_to_yaml


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says where and what to do."""


@dataclass
class StepRecord:
    """What one optimizer step did; handed to the `on_step_end` hook."""

    step: int
    epoch: float  # epochs completed, fractional (2.5: half way through the third)
    loss: float
    grad_norm: float
    lr: float
    label_tokens: int
    tokens: int
    seconds: float
    skipped: bool


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    eval_loss: float | None
    run_dir: Path
    checkpoint: Path | None
    export_dir: Path | None
    signal: int | None
    model: nn.Module


# --------------------------------------------------------------------------------------------
# Building blocks (each used by `train` below, and tested on its own)
# --------------------------------------------------------------------------------------------


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


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens the causal-LM loss is computed on: labels shifted by one, minus ignored ones."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Input tokens the model computes on: the attention mask's ones in padding mode; every
    position of a packed row (its short padded tail included, which the matmuls process too)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def _model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "labels", "position_ids", "attention_mask")
    return {k: batch[k].to(device, non_blocking=True) for k in keys if k in batch}


@dataclass
class StepOutcome:
    loss: torch.Tensor  # 0-d, the window's token-mean loss over all ranks (on the device)
    label_tokens: torch.Tensor  # 0-d, N: label tokens in the window over all ranks
    tokens: torch.Tensor  # 0-d, input tokens in the window over all ranks


def forward_backward(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    runtime: Runtime,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> StepOutcome:
    """Forward and backward over one accumulation window; gradients accumulate in `.grad`.

    No host synchronisation: the token counts are taken from the CPU batches, and the
    results stay on the device until the caller reads them once.
    """
    device = runtime.device
    local_labels = sum(count_label_tokens(b["labels"]) for b in micro_batches)
    n = runtime.all_reduce_sum(torch.tensor(local_labels, device=device, dtype=torch.int64))
    # A window without a single label token contributes zero loss and zero gradient.
    num_items = n.clamp(min=1)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    for i, batch in enumerate(micro_batches):
        with runtime.accumulation_context(model, sync=i == len(micro_batches) - 1), autocast():
            out = model(**_model_inputs(batch, device), num_items_in_batch=num_items)
            runtime.backward(out.loss)
        loss_sum += out.loss.detach().double()
    local_tokens = sum(count_input_tokens(b) for b in micro_batches)
    totals = runtime.all_reduce_sum(
        torch.stack([loss_sum, torch.tensor(float(local_tokens), device=device, dtype=torch.float64)])
    )
    return StepOutcome(loss=totals[0], label_tokens=n, tokens=totals[1])


@torch.no_grad()
def evaluate(
    model: nn.Module, loader, runtime: Runtime, autocast, max_batches: int | None
) -> tuple[float, int]:
    """Token-weighted validation loss: Σ CE over every label token / their number, over all
    ranks (not a mean of batch means). Returns (loss, label tokens); loss is nan without
    label tokens."""
    model.eval()
    device = runtime.device
    # num_items_in_batch=1 makes the model's loss the *summed* token loss of the batch.
    one = torch.ones((), device=device, dtype=torch.int64)
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for index, batch in enumerate(loader.iter_epoch(0)):
        if max_batches is not None and index >= max_batches:
            break
        with autocast():
            out = model(**_model_inputs(batch, device), num_items_in_batch=one)
        count = torch.tensor(count_label_tokens(batch["labels"]), device=device, dtype=torch.float64)
        totals += torch.stack([out.loss.double(), count])
    model.train()
    loss_sum, tokens = runtime.all_reduce_sum(totals).tolist()
    return (loss_sum / tokens if tokens else math.nan), int(tokens)


def micro_batch_stream(
    loader, epoch: int, index: int, epochs: int | None
) -> Iterator[tuple[dict, tuple[int, int]]]:
    """Micro-batches from (epoch, index) on, each with the position of the *next* one;
    endless when `epochs` is None (max_steps runs), else ending after `epochs` passes."""
    per_epoch = loader.batches_per_epoch
    while epochs is None or epoch < epochs:
        for batch in loader.iter_epoch(epoch, start=index):
            index += 1
            yield batch, ((epoch, index) if index < per_epoch else (epoch + 1, 0))
        epoch, index = epoch + 1, 0


class StopSignal:
    """SIGTERM/SIGINT → finish the current step, save, stop. Installed for the duration of
    a `with` block (main thread only: Python delivers signals there)."""

    def __init__(self, log: Callable[[str], None]):
        self.signum: int | None = None
        self._log = log
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        self._log(
            f"received {signal.Signals(signum).name}: finishing this step, saving a checkpoint, then stopping"
            + (" (Ctrl-C again to abort now)" if signum == signal.SIGINT else "")
        )

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _check_precision(recipe: Recipe, device: torch.device) -> None:
    if device.type == "cpu" and recipe.training.precision != "fp32":
        raise RecipeError(
            [
                f"training.precision: {recipe.training.precision} on CPU is not supported (slow, and Triton's CPU "
                "interpreter gets bf16 arithmetic wrong); set training.precision=fp32"
            ]
        )


def _resume_path(recipe: Recipe, manager: CheckpointManager) -> Path | None:
    choice = recipe.checkpoint.resume
    if choice == "none":
        return None
    if choice == "auto":
        return manager.latest()
    return recipe.resolve(choice)


_ORDER_KEYS = ("seed", "micro_batch_size", "world_size", "data")


def _position_warning(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The data position of a checkpoint only means the same batches if the data order's
    inputs are unchanged."""
    changed = [k for k in _ORDER_KEYS if saved.get(k) != current.get(k)]
    if not changed:
        return None
    return (
        f"warning: {', '.join(changed)} changed since the checkpoint was saved; resuming at the same "
        "micro-batch index, but the batches from here on differ from the original run's"
    )


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def train(recipe: Recipe, *, on_step_end: Callable[[StepRecord], bool | None] | None = None) -> TrainResult:
    """Train as the recipe says. Raises RecipeError / DataError for bad input and
    TrainingError when the run cannot go on; returns normally after a stop signal."""
    runtime = create_runtime(recipe)
    try:
        return _train(recipe, runtime, on_step_end)
    finally:
        runtime.shutdown()


def _train(recipe: Recipe, runtime: Runtime, on_step_end) -> TrainResult:
    training, device, run_dir = recipe.training, runtime.device, recipe.run_dir
    _check_precision(recipe, device)

    # -- data, model, optimizer ------------------------------------------------------------
    torch.manual_seed(recipe.seed)
    tokenizer, datasets, loader, eval_loader = _data(recipe, runtime)
    total_steps = training.max_steps or math.ceil(
        training.epochs * loader.batches_per_epoch / training.gradient_accumulation_steps
    )
    model = build_model(recipe, runtime.init_device)
    check_vocab(model, tokenizer)
    hf_model = model  # `model` becomes the strategy's wrapper below
    # Counted before wrapping: sharded strategies (ZeRO-3) leave empty parameters behind.
    model_flops = flops_per_token(model, recipe.data.max_seq_len)
    parameters, model_class = sum(p.numel() for p in model.parameters()), type(model).__name__
    patch_report = prepare_for_training(model, recipe)
    model, optimizer = runtime.wrap(model, lambda module, where: build_optimizer(module, training, where))
    scheduler = build_scheduler(optimizer, training, total_steps)
    autocast = partial(autocast_for, training.precision, device)

    # -- checkpoints and resume --------------------------------------------------------------
    checkpoints = CheckpointManager(run_dir / "checkpoints", recipe.checkpoint.keep_last)
    # What fixes the data order; a resume with other values cannot replay the same batches.
    order = {
        "seed": recipe.seed,
        "micro_batch_size": training.micro_batch_size,
        "world_size": runtime.world_size,
        "data": recipe.data.model_dump(mode="json"),
    }
    step, epoch, batch_index = 0, 0, 0
    resume_from = _resume_path(recipe, checkpoints)
    resumed_message = None
    if resume_from is not None:
        try:
            saved = load_checkpoint(resume_from, runtime.rank)
        except ValueError as e:
            raise RecipeError([f"checkpoint.resume: {e}"]) from None
        runtime.load_state(saved, model, optimizer)
        scheduler.load_state_dict(saved.scheduler)
        if saved.rng is not None:  # None: this rank did not exist in the saving job
            restore_rng_state(saved.rng)
        step, epoch, batch_index = saved.step, saved.state["epoch"], saved.state["batch_index"]
        resumed_message = f"resumed from {saved.path} (step {step}, epoch {epoch}, micro-batch {batch_index})"
        warning = _position_warning(saved.state.get("order", {}), order)
        if warning:
            resumed_message += "\n" + warning
        if step >= total_steps:
            resumed_message += (
                f"\nthe run is already complete ({step} of {total_steps} steps); to train again, set a new "
                "output_dir or checkpoint.resume=none"
            )
        del saved  # the CPU copy of the weights and optimizer state

    def save_checkpoint(at_step: int, position: tuple[int, int]) -> Path:
        # Every rank takes part: each writes its share of the state (sharded strategies).
        return checkpoints.save_from(
            runtime,
            at_step,
            write_state=lambda directory: runtime.save_state(directory, model, optimizer),
            format=runtime.checkpoint_format,
            scheduler=scheduler.state_dict(),
            state={"epoch": position[0], "batch_index": position[1], "order": order},
            recipe_yaml=recipe_to_yaml(recipe),
        )

    # -- metrics ---------------------------------------------------------------------------
    metrics = None
    log = lambda message: None  # other ranks stay quiet
    if runtime.is_main:
        metrics = MetricsLogger(
            run_dir,
            total_steps,
            step,
            progress=recipe.logging.progress,
            tensorboard=recipe.logging.tensorboard,
        )
        log = metrics.info
        log(datasets.report())
        log(
            f"model {model_class}, {parameters / 1e6:.1f}M parameters, {training.precision} on "
            f"{device} ({runtime.strategy}, {runtime.world_size} process(es)); {total_steps} steps of "
            f"{training.micro_batch_size} × {training.gradient_accumulation_steps} × {runtime.world_size} "
            f"sequences of ≤ {recipe.data.max_seq_len} tokens"
        )
        for message in (patch_report, runtime.notice, resumed_message):
            if message:
                log(str(message))
        metrics.write(
            {
                "event": "start",
                "step": step,
                "total_steps": total_steps,
                "world_size": runtime.world_size,
                "strategy": runtime.strategy,
                "device": str(device),
                "parameters": parameters,
                "flops_per_token": model_flops,
                "kernels_patched": {k: n for k, n in patch_report.patched.items() if n}
                if patch_report
                else {},
            }
        )
    throughput = Throughput(
        recipe.logging.throughput_warmup_steps, runtime.world_size, model_flops, peak_bf16_flops(device)
    )

    # -- the loop --------------------------------------------------------------------------
    stream = micro_batch_stream(loader, epoch, batch_index, None if training.max_steps else training.epochs)
    window_losses: list[float] = []
    skipped = 0
    last_loss = eval_loss = export_dir = stop_signal = None
    last_saved = resume_from if step > 0 else None
    started = time.perf_counter()
    try:
        with StopSignal(log) as stop:
            while step < total_steps:
                t0 = time.perf_counter()
                position_before = (epoch, batch_index)
                window = list(itertools.islice(stream, training.gradient_accumulation_steps))
                if not window:
                    break
                batches = [batch for batch, _ in window]
                epoch, batch_index = window[-1][1]
                lr = optimizer.param_groups[0]["lr"]
                outcome = forward_backward(model, batches, runtime, autocast)
                grad_norm = runtime.clip_grad_norm(model, training.max_grad_norm)
                # The step's one host synchronisation: the finiteness check needs the values.
                loss, norm, label_tokens, tokens = torch.stack(
                    [outcome.loss, grad_norm.double(), outcome.label_tokens.double(), outcome.tokens]
                ).tolist()
                finite = math.isfinite(loss) and math.isfinite(norm)
                if finite:
                    runtime.optimizer_step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                if not finite:
                    what = (
                        f"loss {loss} and grad norm {norm}"
                        if not math.isfinite(loss)
                        else f"grad norm {norm}"
                    )
                    if training.on_nonfinite == "stop":
                        # Weights, optimizer and schedule are still those of the last good step.
                        path = last_saved if last_saved == checkpoints.path_for(step) else None
                        path = path or save_checkpoint(step, position_before)
                        raise TrainingError(
                            f"non-finite {what} at step {step + 1}; stopped. The last good state (step {step}) "
                            f"is saved in {path}. Lower training.lr, check the data, or set "
                            "training.on_nonfinite=skip to skip such steps"
                        )
                    skipped += 1
                    log(f"step {step + 1}: non-finite {what}; skipped the optimizer step ({skipped} so far)")
                scheduler.step()
                step += 1
                seconds = time.perf_counter() - t0
                throughput.add_step(seconds, int(label_tokens), int(tokens))
                if finite:
                    last_loss = loss
                    window_losses.append(loss)
                epoch_progress = epoch + batch_index / loader.batches_per_epoch

                record = StepRecord(
                    step, epoch_progress, loss, norm, lr, int(label_tokens), int(tokens), seconds, not finite
                )
                stop_requested = bool(on_step_end(record)) if on_step_end is not None else False
                if metrics is not None:
                    metrics.step_done(step, loss if finite else None)
                    if step % recipe.logging.log_every == 0 or step == total_steps:
                        allocated, reserved = peak_memory_gib(device)
                        metrics.train(
                            {
                                "step": step,
                                "epoch": epoch_progress,
                                # The mean of the window's step losses (skipped steps left out).
                                "loss": sum(window_losses) / len(window_losses) if window_losses else None,
                                "lr": lr,
                                "grad_norm": norm,
                                **throughput.take_window(),
                                "peak_mem_allocated_gib": allocated,
                                "peak_mem_reserved_gib": reserved,
                                "skipped_steps": skipped,
                            }
                        )
                        window_losses = []
                if eval_loader is not None and training.eval_every and step % training.eval_every == 0:
                    eval_loss = _run_eval(model, eval_loader, runtime, autocast, training, step, metrics, log)
                if recipe.checkpoint.every_steps and step % recipe.checkpoint.every_steps == 0:
                    last_saved = save_checkpoint(step, (epoch, batch_index))
                # Every rank stops at the same step (the save is collective), with the same reason.
                signum, requested = runtime.max_over_ranks([stop.signum or 0, int(stop_requested)])
                if signum or requested:
                    stop_signal = signum or None
                    break

            # The end, or a stop: save (unless this step is saved already) so the job can resume.
            # A stop by signal always saves; the end of the run only when checkpoint.save_final.
            if (
                recipe.checkpoint.save_final or stop_signal is not None
            ) and last_saved != checkpoints.path_for(step):
                last_saved = save_checkpoint(step, (epoch, batch_index))

        if step >= total_steps and stop_signal is None:
            if eval_loader is not None and not (training.eval_every and step % training.eval_every == 0):
                eval_loss = _run_eval(model, eval_loader, runtime, autocast, training, step, metrics, log)
            if recipe.checkpoint.export_hf:
                export_dir = export_hf(model, tokenizer, runtime, run_dir / "final")
                log(f"exported the model in Hugging Face format to {export_dir}")
        if metrics is not None:
            allocated, reserved = peak_memory_gib(device)
            extra = {"skipped steps": skipped, "checkpoint": str(last_saved)}
            if stop_signal is not None:
                extra["stopped by"] = signal.Signals(stop_signal).name
            metrics.summary(
                RunSummary(
                    steps=step,
                    seconds=time.perf_counter() - started,
                    rates=throughput.rates(throughput.run),
                    peak_mem_allocated_gib=allocated,
                    peak_mem_reserved_gib=reserved,
                    final_loss=last_loss,
                    eval_loss=eval_loss,
                    extra=extra,
                )
            )
    finally:
        if metrics is not None:
            metrics.close()
    return TrainResult(
        steps=step,
        final_loss=last_loss,
        eval_loss=eval_loss,
        run_dir=run_dir,
        checkpoint=last_saved,
        export_dir=export_dir,
        signal=stop_signal,
        model=hf_model,
    )


def _data(recipe: Recipe, runtime: Runtime):
    """Tokenizer, datasets, and the train and validation loaders of this rank."""
    tokenizer = load_tokenizer(recipe)
    datasets = build_datasets(recipe, tokenizer)
    loader_args = dict(
        seed=recipe.seed,
        pad_token_id=tokenizer.pad_token_id,
        packing=recipe.data.packing,
        rank=runtime.rank,
        world_size=runtime.world_size,
    )
    micro_batch_size = recipe.training.micro_batch_size
    loader = MicroBatchLoader(datasets.train, micro_batch_size, shuffle=recipe.data.shuffle, **loader_args)
    eval_loader = None
    if datasets.validation is not None:
        # A validation split smaller than a micro-batch per rank is still evaluated, in
        # smaller batches. The loader leaves out rows that do not fill a last batch on every
        # rank (fewer than batch × world size rows).
        eval_batch = min(micro_batch_size, len(datasets.validation) // runtime.world_size)
        if eval_batch > 0:
            eval_loader = MicroBatchLoader(datasets.validation, eval_batch, shuffle=False, **loader_args)
    return tokenizer, datasets, loader, eval_loader


def _run_eval(model, loader, runtime, autocast, training, step, metrics, log) -> float | None:
    loss, tokens = evaluate(model, loader, runtime, autocast, training.eval_max_batches)
    if tokens == 0:
        log(f"eval step {step}: the validation split has no label tokens; nothing to evaluate")
        return None
    if metrics is not None:
        metrics.eval(
            {
                "step": step,
                "eval_loss": loss,
                "eval_ppl": math.exp(min(loss, 700.0)),
                "eval_label_tokens": tokens,
            }
        )
    return loss


def export_hf(model: nn.Module, tokenizer, runtime: Runtime, directory: Path) -> Path:
    """Save weights (safetensors), config and tokenizer so that plain
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads the trained model. Weights are
    written in their training dtype (fp32 for ``bf16-mixed``), so the export is exact."""
    from transformers.utils import logging as hf_logging

    state = runtime.full_model_state_dict(model)
    if runtime.is_main:
        hf_model = runtime.unwrap(model)
        with atomic_directory(directory) as tmp:
            # Inference wants its KV cache back; training had it off. The shard progress bar
            # would only clutter the run log.
            hf_model.config.use_cache = True
            hf_logging.disable_progress_bar()
            try:
                hf_model.save_pretrained(tmp, state_dict=state)
            finally:
                hf_model.config.use_cache = False
                hf_logging.enable_progress_bar()
            tokenizer.save_pretrained(tmp)
    runtime.barrier()
    return directory
