"""The building steps of `ligertune.training.trainer.Trainer.setup`, in the order it calls them:
the data and loaders, the model (build → transforms → wrap + optimizer → schedule → objective),
resume, and the metrics with the run log's opening lines. A mixin of `Trainer`: the steps fill
in its attributes; `Trainer` itself keeps `setup`, the loop and the end of the run.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial

from ligertune.data import build_datasets, load_tokenizer
from ligertune.data.preference import loader_class
from ligertune.models.build import build_model, check_vocab
from ligertune.objectives import build_objective
from ligertune.run.checkpoint import CheckpointManager
from ligertune.run.metrics import (
    MetricsLogger,
    Throughput,
    count_label,
    flops_per_token,
    peak_bf16_flops,
)
from ligertune.training.optim import autocast_for, build_optimizer, build_scheduler
from ligertune.training.resume import data_order, resume, resume_path
from ligertune.training.transforms import apply_transforms


class TrainerSetup:
    """`Trainer`'s setup steps (see the module docstring)."""

    def _setup_data(self) -> None:
        """Tokenizer, datasets, and the train and validation loaders of this rank."""
        recipe, runtime = self.recipe, self.runtime
        self.tokenizer = load_tokenizer(recipe)
        self.datasets = build_datasets(
            recipe,
            self.tokenizer,
            is_main=runtime.is_main,
            barrier=runtime.barrier,
            log=self.log,
        )
        loader_args = dict(
            seed=recipe.seed,
            pad_token_id=self.tokenizer.pad_token_id,
            packing=recipe.data.packing,
            rank=runtime.rank,
            world_size=runtime.world_size,
        )
        micro_batch_size = self.training.micro_batch_size
        # Preference/kto pairs collate into [2B, S] micro-batches (ligertune.data.preference).
        MicroBatchLoader = loader_class(self.datasets.train)  # noqa: N806
        self.loader = MicroBatchLoader(
            self.datasets.train, micro_batch_size, shuffle=recipe.data.shuffle, **loader_args
        )
        self.eval_loader, self.eval_skipped = None, None
        if self.datasets.validation is not None:
            # A validation split smaller than a micro-batch per rank is still evaluated, in
            # smaller batches. The loader leaves out rows that do not fill a last batch on every
            # rank (fewer than batch × world size rows).
            rows = len(self.datasets.validation)
            eval_batch = min(micro_batch_size, rows // runtime.world_size)
            if eval_batch > 0:
                self.eval_loader = MicroBatchLoader(
                    self.datasets.validation, eval_batch, shuffle=False, **loader_args
                )
            else:  # every rank must evaluate a batch; said at the start and in the summary
                self.eval_skipped = (
                    f"the validation split has {rows} row(s), fewer than the {runtime.world_size} processes; "
                    "raise data.validation_fraction or use a larger data.validation_split"
                )
                if runtime.is_main:
                    logging.getLogger("ligertune").warning(f"warning: no evaluation: {self.eval_skipped}")
        self.total_steps = self.training.max_steps or math.ceil(
            self.training.epochs * self.loader.batches_per_epoch / self.training.gradient_accumulation_steps
        )

    def _setup_model(self) -> None:
        recipe, training, runtime = self.recipe, self.training, self.runtime
        # Whole on this device, or empty (meta) when the strategy shards it first (sharded init).
        started = time.perf_counter()
        model = runtime.build_model(recipe)
        check_vocab(model, self.tokenizer)
        # Counted before wrapping: sharded strategies (ZeRO-3) leave empty parameters behind, and a
        # model built inside zero.Init has them from the start: count on its empty twin then.
        counted = model
        if any(p.numel() == 0 for p in model.parameters()):
            counted = build_model(recipe, runtime.device, empty=True)
        self.model_flops = flops_per_token(counted, recipe.data.max_seq_len)
        self.parameters, self.model_class = sum(p.numel() for p in counted.parameters()), type(model).__name__
        self.log(
            f"built {self.model_class} ({count_label(self.parameters)} parameters) in {time.perf_counter() - started:.1f} s"
        )
        self.hf_model, self.transform_reports = apply_transforms(model, recipe)
        started = time.perf_counter()
        self.model, self.optimizer = runtime.wrap(
            self.hf_model, lambda module, where: build_optimizer(module, training, where)
        )
        self.log(
            f"{'' if runtime.strategy == 'none' else f'wrapped the model for {runtime.strategy}, '}"
            f"built the optimizer in {time.perf_counter() - started:.1f} s"
        )
        self.scheduler = build_scheduler(self.optimizer, training, self.total_steps)
        self.autocast = partial(autocast_for, training.precision, self.device)
        # A frozen reference or teacher is built and placed by the runtime like the policy.
        self.objective = build_objective(
            recipe.objective, recipe=recipe, policy=self.hf_model, runtime=runtime
        )

    def _setup_resume(self) -> None:
        recipe, runtime = self.recipe, self.runtime
        self.checkpoints = CheckpointManager(recipe.run_dir / "checkpoints", recipe.checkpoint.keep_last)
        self.order = data_order(recipe, runtime.world_size)
        self.step, self.epoch, self.batch_index = 0, 0, 0
        self.skipped = 0  # steps skipped in the run (on_nonfinite=skip), carried over by a resume
        self.resume_from, passed_over = resume_path(recipe, self.checkpoints)  # damaged ones passed over
        self.resumed_message = None
        if self.resume_from is not None:
            resumed = resume(
                self.resume_from,
                runtime,
                self.model,
                self.optimizer,
                self.scheduler,
                recipe,
                self.total_steps,
            )
            self.step, self.epoch, self.batch_index = resumed.step, resumed.epoch, resumed.batch_index
            self.skipped = resumed.skipped_steps
            self.resumed_message = "\n".join([*passed_over, resumed.message])
        self.last_saved = self.resume_from if self.step > 0 else None

    def _setup_metrics(self) -> None:
        recipe, training, runtime = self.recipe, self.training, self.runtime
        if runtime.is_main:
            self.metrics = MetricsLogger(
                recipe.run_dir,
                self.total_steps,
                self.step,
                progress=recipe.logging.progress,
                loggers=recipe.logging.selected_loggers(),
                options=recipe.logging.model_dump(),
                config=recipe.model_dump(mode="json"),
            )
            self.log = self.metrics.info
            self.log(self.datasets.report())
            self.log(
                f"model {self.model_class}, {self.parameters / 1e6:.1f}M parameters, {training.precision} on "
                f"{self.device} ({runtime.strategy}, {runtime.world_size} process(es)); {self.total_steps} steps of "
                f"{training.micro_batch_size} × {training.gradient_accumulation_steps} × {runtime.world_size} "
                f"sequences of ≤ {recipe.data.max_seq_len} tokens"
            )
            for message in (
                self.auto_message,
                *self.transform_reports.values(),
                runtime.notice,
                self.resumed_message,
            ):
                if message:
                    self.log(str(message))
            self.metrics.write(self._start_record())
        self.throughput = Throughput(
            recipe.logging.throughput_warmup_steps,
            runtime.world_size,
            self.model_flops,
            peak_bf16_flops(self.device),
        )

    def _start_record(self) -> dict:
        patch_report = self.transform_reports.get("kernels")
        return {
            "event": "start",
            "step": self.step,
            "total_steps": self.total_steps,
            "world_size": self.runtime.world_size,
            "strategy": self.runtime.strategy,
            "device": str(self.device),
            "parameters": self.parameters,
            "flops_per_token": self.model_flops,
            "kernels_patched": {k: n for k, n in patch_report.patched.items() if n} if patch_report else {},
        }
