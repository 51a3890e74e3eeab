"""What a run is made of, built once from the recipe: `Components` and its `build`.

    build(recipe, runtime, log)
        tokenizer → datasets → loaders → model (built whole, or empty for a sharded init)
        → transforms (kernels, plugins, lora, fp8, checkpointing, compile) → wrap + optimizer
        → schedule → objective (with its frozen reference or teacher, placed like the policy)

Everything here is made before the first step and then only used: what changes while the run
goes is the `ligertune.training.state.TrainState`, which checkpoints restore.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ligertune.config import Recipe
from ligertune.data import build_datasets, load_tokenizer
from ligertune.data.loader import loader_class
from ligertune.data.vision import build_vision_datasets, load_processor
from ligertune.distributed import Runtime
from ligertune.models.build import build_model, check_vocab, tokens_per_image, vision_tower
from ligertune.models.config import build_config
from ligertune.models.shape import model_shape
from ligertune.objectives import Objective, build_objective
from ligertune.run.metrics import count_label
from ligertune.training.optim import autocast_for, build_optimizer, build_scheduler
from ligertune.training.transforms import apply_transforms, state_transforms


@dataclass
class Data:
    """The tokenizer, the datasets and this rank's loaders, and the run's length in steps."""

    tokenizer: Any
    datasets: Any  # `ligertune.data.Datasets`: train, validation, and the report for the log
    loader: Any  # this rank's micro-batches of the training split
    eval_loader: Any | None  # of the validation split; None without one (or too small for the ranks)
    total_steps: int
    eval_skipped: str | None = None  # why a validation split is not evaluated, for the summary
    # A vision-language model's tokenizer and image processor (`ligertune.data.vision`), exported together.
    processor: Any | None = None


@dataclass
class Components:
    """The model as the strategy wraps it (`model`, what to call) and as Hugging Face built it
    (`hf_model`, what to export), the optimizer and schedule, the objective, the data, and what
    the start log says of them."""

    runtime: Runtime
    data: Data
    model: nn.Module
    hf_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    objective: Objective
    autocast: Callable[[], contextlib.AbstractContextManager]
    model_class: str
    parameters: int
    flops_per_token: float  # model FLOPs per token at the recipe's sequence length (MFU)
    transform_reports: dict[str, object]  # per transform that ran, its line for the log


def build(recipe: Recipe, runtime: Runtime, log: Callable[[str], None]) -> Components:
    """Everything the run needs, in the order of the module docstring."""
    data = build_data(recipe, runtime, log)
    training = recipe.training
    # Whole on this device, or empty (meta) when the strategy shards it first (sharded init).
    started = time.perf_counter()
    model = runtime.build_model(recipe)
    check_vocab(model, data.tokenizer)
    # Counted before wrapping: sharded strategies (ZeRO-3) leave empty parameters behind, and a
    # model built inside zero.Init has them from the start: count on its empty twin then.
    counted = model
    if any(p.numel() == 0 for p in model.parameters()):
        counted = build_model(recipe, runtime.device, empty=True)
    shape = model_shape(counted)
    active = f", {count_label(shape.active_params)} active" if shape.experts else ""
    log(
        f"built {type(model).__name__} ({count_label(shape.params)} parameters{active}) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    hf_model, reports = apply_transforms(model, recipe)
    split = runtime.split_attention(hf_model)
    if split is not None:
        reports["context parallel"] = split
    started = time.perf_counter()
    wrapped, optimizer = runtime.wrap(
        hf_model, lambda module, where: build_optimizer(module, training, where), state_transforms(recipe)
    )
    wrapped_for = f"wrapped the model for {runtime.strategy}, " if recipe.parallel.multi_process else ""
    log(f"{wrapped_for}built the optimizer in {time.perf_counter() - started:.1f} s")
    return Components(
        runtime=runtime,
        data=data,
        model=wrapped,
        hf_model=hf_model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, training, data.total_steps),
        # A frozen reference or teacher is built and placed by the runtime like the policy.
        objective=build_objective(
            recipe.objective, recipe=recipe, policy=hf_model, runtime=runtime, tokenizer=data.tokenizer
        ),
        autocast=partial(autocast_for, training.precision, runtime.device),
        model_class=type(model).__name__,
        parameters=shape.params,
        flops_per_token=shape.flops_per_token(recipe.data.max_seq_len),
        transform_reports=reports,
    )


def build_data(recipe: Recipe, runtime: Runtime, log: Callable[[str], None]) -> Data:
    """Tokenizer, datasets, and the train and validation loaders of this rank."""
    tokenizer = load_tokenizer(recipe)
    vision, processor = vision_tower(recipe), None
    if vision is not None:  # images through the model's image processor (ligertune.data.vision)
        fixed = tokens_per_image(build_config(recipe), vision)  # Gemma 3's image tokens per image
        processor = load_processor(recipe, vision, tokenizer, fixed)
        datasets = build_vision_datasets(
            recipe, processor, is_main=runtime.is_main, barrier=runtime.barrier, log=log
        )
    else:
        datasets = build_datasets(
            recipe, tokenizer, is_main=runtime.is_main, barrier=runtime.barrier, log=log
        )
    loader_args = dict(
        seed=recipe.seed,
        pad_token_id=tokenizer.pad_token_id,
        packing=recipe.data.packing,
        # The ranks of a context-parallel group load the same rows (`Runtime.data_rank`).
        rank=runtime.data_rank,
        world_size=runtime.data_world_size,
    )
    training = recipe.training
    # Preference/kto pairs collate into [2B, S] micro-batches (ligertune.data.preference), prompts
    # into left-padded [B, P] ones (ligertune.data.prompts).
    MicroBatchLoader = loader_class(datasets.train)  # noqa: N806
    loader = MicroBatchLoader(
        datasets.train, training.micro_batch_size, shuffle=recipe.data.shuffle, **loader_args
    )
    eval_loader, eval_skipped = None, None
    if datasets.validation is not None:
        # A validation split smaller than a micro-batch per rank is still evaluated, in smaller
        # batches. The loader leaves out rows that do not fill a last batch on every rank
        # (fewer than batch × world size rows).
        rows = len(datasets.validation)
        eval_batch = min(training.micro_batch_size, rows // runtime.data_world_size)
        if eval_batch > 0:
            eval_loader = MicroBatchLoader(datasets.validation, eval_batch, shuffle=False, **loader_args)
        else:  # every rank must evaluate a batch; said at the start and in the summary
            eval_skipped = (
                f"the validation split has {rows} row(s), fewer than the {runtime.data_world_size} "
                f"{'processes' if runtime.sequence_shards == 1 else 'data-parallel groups'}; "
                "raise data.validation_fraction or use a larger data.validation_split"
            )
            if runtime.is_main:
                logging.getLogger("ligertune").warning(f"warning: no evaluation: {eval_skipped}")
    # An objective that trains several steps on each window (grpo's num_iterations) takes that many.
    total_steps = (
        training.max_steps
        or math.ceil(training.epochs * loader.batches_per_epoch / training.gradient_accumulation_steps)
        * recipe.objective.updates_per_window()
    )
    return Data(tokenizer, datasets, loader, eval_loader, total_steps, eval_skipped, processor)
