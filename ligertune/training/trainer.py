"""The training loop, split like a torchtune recipe: `Trainer.setup`, `Trainer.train`, `Trainer.cleanup`.

    setup:   machine rules → runtime → auto settings → run lock → components (`build`: data,
             model, transforms, wrap + optimizer, schedule, objective) → resume → metrics
    train:   [ step → log → evaluate → checkpoint → stop? ]* → final checkpoint, evaluation,
             Hugging Face export, summary
    cleanup: metrics files closed, process group released

What the run is made of is built once (`ligertune.training.components.Components`); what changes
as it runs and a checkpoint restores is one `ligertune.training.state.TrainState`; what the loop
tracks between log lines (`Progress`) is neither. One optimizer step is
`ligertune.training.step.forward_backward` over the window's micro-batches with the objective's
normalisation, then clipping, the finiteness check (the step's one host synchronisation) and
the update.

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
    the failing step, so a resume with a lower lr replays it: a resume applies the recipe's
    new lr, see `ligertune.training.resume`), and `TrainingError` names the step. ``skip``: the
    gradients are dropped and the optimizer step is skipped; the step still counts (the
    schedule and the data move on). Skipping has limits (``training.max_skipped_steps`` in the
    run, resumes included, ``max_consecutive_skipped_steps`` in a row): a run that keeps
    failing would otherwise finish and export a model trained on a fraction of its steps, so
    the step over a limit stops the run as ``stop`` does.

Stopping early
    SIGTERM/SIGINT (`ligertune.training.signals`) or the `on_step_end` hook returning True:
    every rank stops after the same step, saves a checkpoint and returns.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ligertune.config import Recipe, machine_problems, recipe_to_yaml
from ligertune.config.environment_rules import machine_warnings
from ligertune.distributed import Runtime, create_runtime
from ligertune.errors import OutOfMemoryError, RecipeError, TrainingError
from ligertune.run.checkpoint import CheckpointManager
from ligertune.run.lock import RunLock
from ligertune.run.metrics import (
    MetricsLogger,
    RunSummary,
    Throughput,
    peak_bf16_flops,
    peak_memory_gib,
    reset_peak_memory,
)
from ligertune.training.auto import memory_budget, oom_suggestion, resolve_auto
from ligertune.training.components import Components, build
from ligertune.training.export import export_run
from ligertune.training.harness import score_run
from ligertune.training.resume import data_order, resume, resume_path
from ligertune.training.signals import StopSignal
from ligertune.training.state import Progress, StepRecord, TrainResult, TrainState
from ligertune.training.step import evaluate, forward_backward, micro_batch_stream
from ligertune.training.windows import Windows


class Trainer:
    """One run of a recipe. `setup` builds everything and may raise RecipeError/DataError;
    `train` runs the loop and may raise TrainingError; `cleanup` always runs after them."""

    def __init__(self, recipe: Recipe, on_step_end: Callable[[StepRecord], bool | None] | None = None):
        self.recipe, self.on_step_end = recipe, on_step_end
        self.runtime: Runtime | None = None
        self.parts: Components | None = None
        self.state = TrainState()
        self.progress = Progress()
        self.metrics: MetricsLogger | None = None
        self.lock: RunLock | None = None
        self.log: Callable[[str], None] = lambda message: None  # other ranks stay quiet

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        recipe = self.recipe
        problems = machine_problems(recipe)
        if problems:
            raise RecipeError(problems)
        self.runtime = runtime = create_runtime(recipe)
        self.log = logging.getLogger("ligertune").info if runtime.is_main else self.log
        if runtime.is_main:
            for line in machine_warnings(recipe):  # slow here and for nothing: said before the wait
                logging.getLogger("ligertune").warning(f"warning: {line}")
        # auto checkpointing / micro-batch size, planned against this GPU (ligertune.training.auto)
        resolved = resolve_auto(recipe, runtime.world_size, runtime.device)
        self.recipe = recipe = resolved.recipe
        # Before anything is written: a second run on this output_dir stops here (ligertune.run.lock).
        self.lock = RunLock.acquire(recipe.run_dir) if runtime.is_main else None
        torch.manual_seed(recipe.seed)
        self.parts = parts = build(recipe, runtime, self.log)
        self.checkpoints = CheckpointManager(recipe.run_dir / "checkpoints", recipe.checkpoint.keep_last)
        self.order = data_order(recipe, runtime.data_world_size, parts.data.datasets.fingerprint)
        self.windows = Windows.of(parts, recipe, runtime.rank)
        resumed_message = self._resume()
        if runtime.is_main:
            self._start_log(resolved.message, resumed_message)
        self.throughput = Throughput(
            recipe.logging.throughput_warmup_steps,
            runtime.world_size,
            parts.flops_per_token,
            peak_bf16_flops(runtime.device),
        )

    def _resume(self) -> str | None:
        """Restore the newest intact checkpoint (``checkpoint.resume``) into the components and
        the state; what the log says of it, or None when the run starts afresh."""
        recipe, parts = self.recipe, self.parts
        path, passed_over = resume_path(recipe, self.checkpoints)  # damaged ones passed over
        if path is None:
            return None
        resumed = resume(
            path,
            self.runtime,
            parts.model,
            parts.optimizer,
            parts.scheduler,
            recipe,
            parts.data.total_steps,
            parts.data.datasets.fingerprint,
        )
        self.state = resumed.state
        self.windows.restore(path, self.state.step)
        if self.state.step == 0:
            self.state.last_saved = None
        return "\n".join([*passed_over, resumed.message])

    def _start_log(self, auto_message: str | None, resumed_message: str | None) -> None:
        """The run's opening lines and the start record of metrics.jsonl (main rank)."""
        recipe, parts, runtime = self.recipe, self.parts, self.runtime
        training = recipe.training
        self.metrics = MetricsLogger(
            recipe.run_dir,
            parts.data.total_steps,
            self.state.step,
            progress=recipe.logging.progress,
            loggers=recipe.logging.selected_loggers(),
            options=recipe.logging.model_dump(),
            config=recipe.model_dump(mode="json"),
        )
        self.log = self.metrics.info
        self.log(parts.data.datasets.report())
        self.log(
            f"model {parts.model_class}, {parts.parameters / 1e6:.1f}M parameters, {training.precision} on "
            f"{runtime.device} ({runtime.strategy}, {runtime.world_size} process(es)); {parts.data.total_steps} "
            f"steps of {training.micro_batch_size} × {training.gradient_accumulation_steps} × {runtime.data_world_size} "
            f"sequences of ≤ {recipe.data.max_seq_len} tokens"
            + (f", each split over {runtime.sequence_shards} ranks" if runtime.sequence_shards > 1 else "")
        )
        for message in (auto_message, *parts.transform_reports.values(), runtime.notice, resumed_message):
            if message:
                self.log(str(message))
        patch_report = parts.transform_reports.get("kernels")
        self.metrics.write(
            {
                "event": "start",
                "step": self.state.step,
                "total_steps": parts.data.total_steps,
                "world_size": runtime.world_size,
                "strategy": runtime.strategy,
                "device": str(runtime.device),
                "parameters": parts.parameters,
                "flops_per_token": parts.flops_per_token,
                "kernels_patched": {k: n for k, n in patch_report.patched.items() if n}
                if patch_report
                else {},
            }
        )

    # -- train -------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """The loop, then the end of the run. Returns normally after a stop signal."""
        training, state, total = self.recipe.training, self.state, self.parts.data.total_steps
        stream = micro_batch_stream(
            self.parts.data.loader,
            state.epoch,
            state.batch_index,
            None if training.max_steps else training.epochs,
        )
        self.progress = Progress(epoch_saved=state.epoch)
        stop_signal = None
        reset_peak_memory(self.runtime.device)
        started = time.perf_counter()
        with StopSignal(self.log) as stop:
            while state.step < total:
                record = self._step(stream)
                if record is None:
                    break
                stop_requested = bool(self.on_step_end(record)) if self.on_step_end is not None else False
                self._after_step(record)
                # Every rank stops at the same step (the save is collective), with the same reason.
                signum, requested = self.runtime.max_over_ranks([stop.signum or 0, int(stop_requested)])
                if signum or requested:
                    stop_signal = signum or None
                    break
            # The end, or a stop: save (unless this step is saved already) so the job can resume.
            # A stop by signal always saves; the end of the run only when checkpoint.save_final.
            if self.recipe.checkpoint.save_final or stop_signal is not None:
                self._save_unless_saved()
        return self._finish(stop_signal, time.perf_counter() - started)

    def _step(self, stream: Iterator) -> StepRecord | None:
        """One optimizer step over the next window of micro-batches; None when the data ends."""
        parts, state, training = self.parts, self.state, self.recipe.training
        t0 = time.perf_counter()
        position_before = state.position
        lr = parts.optimizer.param_groups[0]["lr"]
        try:
            # The micro-batches to train on: the next window, as the objective prepares it.
            prepared = self.windows.take(state, stream)
            if prepared is None:
                return None
            if prepared.report:
                self.log(prepared.report)
            outcome = forward_backward(
                parts.model, parts.objective, prepared.batches, self.runtime, parts.autocast
            )
            grad_norm = self.runtime.clip_grad_norm(parts.model, training.max_grad_norm)
            # The step's one host synchronisation: the finiteness check needs the values.
            loss, norm, items, label_tokens, tokens, *metric_values = torch.stack(
                [
                    outcome.loss,
                    grad_norm.double(),
                    *(x.double() for x in (outcome.items, outcome.label_tokens)),
                    outcome.tokens,
                    *outcome.metrics.values(),
                ]
            ).tolist()
            finite = math.isfinite(loss) and math.isfinite(norm)
            if finite:
                self.runtime.optimizer_step(parts.optimizer)
        except torch.OutOfMemoryError:
            self._out_of_memory()
        parts.optimizer.zero_grad(set_to_none=True)
        if not finite:
            self._nonfinite(loss, norm, position_before)
        parts.scheduler.step()
        state.step += 1
        seconds = time.perf_counter() - t0
        self.throughput.add_step(seconds, int(label_tokens), int(tokens))
        if finite:
            self.progress.last_loss = loss
            self.progress.window_losses.append(loss)
            self.progress.consecutive_skipped = 0
        epoch_progress = state.epoch + state.batch_index / parts.data.loader.batches_per_epoch
        return StepRecord(
            state.step,
            epoch_progress,
            loss,
            norm,
            lr,
            int(items),
            int(label_tokens),
            int(tokens),
            seconds,
            not finite,
            metrics={**prepared.metrics, **dict(zip(outcome.metrics, metric_values, strict=True))},
        )

    def _out_of_memory(self) -> None:
        """A CUDA out-of-memory in the step: TrainingError with the peak and the plan's suggestion.
        Nothing is saved (the step's state is half done); the last checkpoint stays as it was."""
        self.parts.optimizer.zero_grad(set_to_none=True)
        device = self.runtime.device
        allocated, _ = peak_memory_gib(device)
        budget = memory_budget(self.recipe, device) or 0
        try:
            suggestion = oom_suggestion(self.recipe, self.runtime.world_size, budget)
        except Exception as e:  # the message must still come out
            suggestion = f"(no suggestion: {type(e).__name__}: {e})"
        last = self.state.last_saved
        kept = f"the last checkpoint, {last}, is kept" if last else "no checkpoint was saved yet"
        of = f" of {budget / 2**30:.1f}" if budget else ""
        raise OutOfMemoryError(
            f"out of memory at step {self.state.step + 1} (peak {allocated or 0:.1f} GiB{of}): "
            f"ligertune plan suggests: {suggestion}; {kept}"
        ) from None

    def _nonfinite(self, loss: float, norm: float, position_before: tuple[int, int]) -> None:
        """A step whose loss or gradient norm is NaN/inf: stop with the last good state saved, or
        skip it, within the skip limits. Every rank sees the same loss and norm (reduced), so
        every rank decides the same and takes part in the save."""
        what = f"loss {loss} and grad norm {norm}" if not math.isfinite(loss) else f"grad norm {norm}"
        at = self.state.step + 1
        training = self.recipe.training
        if training.on_nonfinite == "stop":
            self._stop_nonfinite(
                f"non-finite {what} at step {at}; stopped",
                "Lower training.lr (a resume applies it), check the data, or set training.on_nonfinite=skip "
                "to skip such steps",
                position_before,
            )
        total, in_a_row = self.state.skipped + 1, self.progress.consecutive_skipped + 1
        for key, count, limit, counted in (
            ("max_skipped_steps", total, training.max_skipped_steps, "in the run"),
            ("max_consecutive_skipped_steps", in_a_row, training.max_consecutive_skipped_steps, "in a row"),
        ):
            if limit is not None and count > limit:
                self._stop_nonfinite(
                    f"non-finite {what} at step {at}: {count} steps skipped {counted} ({total} in the run, "
                    f"{in_a_row} in a row), more than training.{key}={limit}; stopped",
                    f"Lower training.lr (a resume applies it) or check the data; raise training.{key} to "
                    "tolerate more skipped steps",
                    position_before,
                )
        self.state.skipped, self.progress.consecutive_skipped = total, in_a_row
        self.log(f"step {at}: non-finite {what}; skipped the optimizer step ({self.state.skipped} so far)")

    def _stop_nonfinite(self, what: str, advice: str, position_before: tuple[int, int]) -> None:
        """Save the state from before the failing step (weights and optimizer untouched by it and
        by any skipped step; the data position of the failing step, so a resume replays it) and
        raise TrainingError."""
        step, last = self.state.step, self.state.last_saved
        path = last if last == self.checkpoints.path_for(step) else None
        path = path or self._save(position_before)
        raise TrainingError(f"{what}. The last good state (step {step}) is saved in {path}. {advice}")

    def _after_step(self, record: StepRecord) -> None:
        """Metrics, periodic evaluation and periodic checkpoint after step `record.step`."""
        step, progress, recipe = record.step, self.progress, self.recipe
        logged = step % recipe.logging.log_every == 0 or step == self.parts.data.total_steps
        if not record.skipped:
            for name, value in record.metrics.items():
                progress.window_metrics.setdefault(name, []).append(value)
        if self.metrics is not None:
            self.metrics.step_done(step, None if record.skipped else record.loss)
            if logged:
                self._log_window(record)
        if logged:
            progress.window_losses, progress.window_metrics = [], {}
        eval_every = recipe.training.eval_every
        if self.parts.data.eval_loader is not None and eval_every and step % eval_every == 0:
            progress.eval_loss = self._evaluate()
        every = recipe.checkpoint.every_steps
        if every and step % every == 0:
            self.state.last_saved = self._save(self.state.position)
        # An epoch of the data ended in this step (the next micro-batch is in a later epoch).
        if recipe.checkpoint.save_every_epoch and self.state.epoch > progress.epoch_saved:
            progress.epoch_saved = self.state.epoch
            self._save_unless_saved()

    def _log_window(self, record: StepRecord) -> None:
        """The train record of the logging window that ends at this step (main rank)."""
        progress = self.progress
        allocated, reserved = peak_memory_gib(self.runtime.device)
        means = {k: sum(v) / len(v) for k, v in progress.window_metrics.items()}
        self.metrics.train(
            {
                "step": record.step,
                "epoch": record.epoch,
                # The mean of the window's step losses (skipped steps left out).
                "loss": sum(progress.window_losses) / len(progress.window_losses)
                if progress.window_losses
                else None,
                "loss_steps": len(progress.window_losses),
                "lr": record.lr,
                "grad_norm": record.grad_norm,
                **self.throughput.take_window(),
                "peak_mem_allocated_gib": allocated,
                "peak_mem_reserved_gib": reserved,
                "skipped_steps": self.state.skipped,
                # The objective's metrics (rewards, margins, KL ...), means over the window.
                **means,
            }
        )
        if means:
            self.log(
                f"step {record.step} {self.parts.objective.name} | "
                + " | ".join(f"{k} {v:.4f}" for k, v in means.items())
            )

    def _evaluate(self) -> float | None:
        parts = self.parts
        loss, items = evaluate(
            parts.model,
            parts.objective,
            parts.data.eval_loader,
            self.runtime,
            parts.autocast,
            self.recipe.training.eval_max_batches,
        )
        step = self.state.step
        if items == 0:
            self.log(f"eval step {step}: the validation split has no label tokens; nothing to evaluate")
            return None
        if self.metrics is not None:
            self.metrics.eval(
                {
                    "step": step,
                    "eval_loss": loss,
                    "eval_ppl": math.exp(min(loss, 700.0)),
                    "eval_label_tokens": items,
                }
            )
        return loss

    def _score_tasks(self) -> dict[str, float]:
        """eval.tasks (`ligertune.training.harness`): a record in metrics.jsonl and a log line."""
        started, step = time.perf_counter(), self.state.step
        scores = score_run(self.recipe, self.parts.hf_model, self.parts.data.tokenizer, self.state.last_saved)
        self.metrics.write({"event": "eval_tasks", "step": step, **scores})
        shown = " | ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in scores.items())
        self.log(f"eval tasks step {step} | {shown} ({time.perf_counter() - started:.1f} s)")
        return scores

    def _save(self, position: tuple[int, int]) -> Path:
        """A checkpoint of the current step at data `position`. Every rank takes part: each
        writes its share of the state (sharded strategies)."""
        started, step, parts = time.perf_counter(), self.state.step, self.parts
        path = self.checkpoints.save_from(
            self.runtime,
            step,
            write_state=lambda directory: self._write_state(directory, step),
            format=self.runtime.checkpoint_format,
            scheduler=parts.scheduler.state_dict(),
            state=self.state.checkpoint_record(
                position, self.order, self.recipe._source_file, parts.data.total_steps
            ),
            recipe_yaml=recipe_to_yaml(self.recipe),
        )
        self.log(f"saved step-{step} to {path} in {time.perf_counter() - started:.1f} s")
        return path

    def _write_state(self, directory: Path, step: int) -> None:
        """This rank's part of a checkpoint: model, optimizer, the micro-batches still in use."""
        self.runtime.save_state(directory, self.parts.model, self.parts.optimizer)
        self.windows.save(directory, step)

    def _save_unless_saved(self) -> None:
        if self.state.last_saved != self.checkpoints.path_for(self.state.step):
            self.state.last_saved = self._save(self.state.position)

    def _finish(self, stop_signal: int | None, seconds: float) -> TrainResult:
        """After the loop: the final evaluation and export (a completed run only), the summary."""
        parts, state, progress, recipe = self.parts, self.state, self.progress, self.recipe
        export_dir, task_scores = None, {}
        if state.step >= parts.data.total_steps and stop_signal is None:
            eval_every = recipe.training.eval_every
            if parts.data.eval_loader is not None and not (eval_every and state.step % eval_every == 0):
                progress.eval_loss = self._evaluate()
            if recipe.checkpoint.export_hf:
                export_dir = export_run(
                    parts.model, parts.data.processor or parts.data.tokenizer, self.runtime, recipe, self.log
                )  # a VLM's image processor goes along
            if recipe.eval.tasks and self.metrics is not None:  # the main rank scores its whole model
                task_scores = self._score_tasks()
        if self.metrics is not None:
            allocated, reserved = peak_memory_gib(self.runtime.device)
            extra = {"skipped_steps": state.skipped, "checkpoint": str(state.last_saved)}
            if stop_signal is not None:
                extra["stopped_by"] = signal.Signals(stop_signal).name
            if parts.data.eval_skipped:
                extra["eval_skipped"] = parts.data.eval_skipped
            extra.update(task_scores)
            self.metrics.summary(
                RunSummary(
                    steps=state.step,
                    seconds=seconds,
                    rates=self.throughput.rates(self.throughput.run),
                    peak_mem_allocated_gib=allocated,
                    peak_mem_reserved_gib=reserved,
                    final_loss=progress.last_loss,
                    eval_loss=progress.eval_loss,
                    extra=extra,
                )
            )
        return TrainResult(
            steps=state.step,
            final_loss=progress.last_loss,
            eval_loss=progress.eval_loss,
            run_dir=recipe.run_dir,
            checkpoint=state.last_saved,
            export_dir=export_dir,
            signal=stop_signal,
            model=parts.hf_model,
        )

    # -- cleanup -----------------------------------------------------------------------------

    def cleanup(self, finished: bool = False) -> None:
        """Close the metrics, release the process group and the run lock. `finished`: every rank
        got to the end of `train` (the group may then be synchronised once more on the way out)."""
        if self.metrics is not None:
            self.metrics.close()
        # The strategy's wrapper (DDP's reducer) holds the process group: let it go while the
        # group is still registered, so the group is torn down by `shutdown`, not by the garbage
        # collector wherever the wrapper happens to be freed.
        if self.parts is not None:
            self.parts.model = self.parts.optimizer = None
        if self.runtime is not None:
            self.runtime.shutdown(finished)
        if self.lock is not None:
            self.lock.release()


def train(recipe: Recipe, *, on_step_end: Callable[[StepRecord], bool | None] | None = None) -> TrainResult:
    """Train as the recipe says. Raises RecipeError / DataError for bad input and
    TrainingError when the run cannot go on; returns normally after a stop signal."""
    trainer = Trainer(recipe, on_step_end)
    finished = False
    try:
        trainer.setup()
        result = trainer.train()
        finished = True
        return result
    finally:
        trainer.cleanup(finished)
