"""The one seam between the training loop and the multi-process strategies.

The loop in `ligertune.train` never asks which strategy is running: it talks to a `Runtime`,
which knows the process's place in the job (rank, world size, device) and does the few things
that differ between strategies — wrapping the model and building the optimizer, backward,
gradient clipping and the optimizer step, collective sums, checkpoint state and the full
state dict of the final export. `create_runtime` picks the class from ``parallel.strategy``:

    none       `Runtime`          one process, one device
    ddp        `DDPRuntime`       torch DistributedDataParallel: every rank holds the whole model
    fsdp       `FSDPRuntime`      FSDP2 ``fully_shard`` per decoder layer and on the root
    deepspeed  `DeepSpeedRuntime` DeepSpeed ZeRO stage 1/2/3 with our torch AdamW

The engines are PyTorch's and DeepSpeed's own; nothing here communicates by itself beyond
``torch.distributed`` collectives. Processes are started by torchrun (``ligertune train
--nproc-per-node G`` runs it, see `ligertune.launch`), which sets RANK, LOCAL_RANK and
WORLD_SIZE; a multi-process strategy started without it runs as a job of one process (useful
for FSDP's CPU offload on one GPU). NCCL joins the GPUs, gloo the CPU processes of tests.

Gradient accumulation contract (every strategy keeps it): the loop divides each micro-batch's
*summed* token loss by the label-token count of the whole optimizer step, summed over the
accumulation window **and over all ranks** (`all_reduce_sum`). The loss a rank hands to
`backward` is therefore its share of the global token mean, and the gradient the optimizer
needs is the plain *sum* of the ranks' gradients. DDP, FSDP and DeepSpeed all *average*
gradients over ranks (divide by the world size), so they multiply the loss by the world size
in `backward` to undo that division. Then 2 ranks × 2 sequences give the loss and gradients of
1 rank × 4 sequences, whatever the label counts of each rank's rows.

Collective calls: every method that talks to other ranks (marked *collective* below) must be
called by every rank, in the same order, or the job hangs. The loop guarantees it by making
every decision that leads to one (stop, save, skip) from values all ranks share.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ligertune.checkpoint import FULL_FORMAT, Checkpoint, write_full_state
from ligertune.recipe import Recipe, RecipeError

# (module, where its parameters live) -> the optimizer over them; see `Runtime.wrap`.
OptimizerFactory = Callable[[nn.Module, torch.device], torch.optim.Optimizer]


class Runtime:
    """One process of a training job: where it runs and how it syncs with the others.

    This base class is the single-process implementation (strategy ``none``); multi-process
    strategies subclass it and override what differs.
    """

    strategy = "none"
    checkpoint_format = FULL_FORMAT
    # A line for the run log about how this strategy trains this recipe, or None.
    notice: str | None = None

    def __init__(self, device: torch.device, rank: int = 0, local_rank: int = 0, world_size: int = 1):
        self.device = device
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size

    @property
    def is_main(self) -> bool:
        """Whether this process prints, logs metrics and writes files shared by the job."""
        return self.rank == 0

    @property
    def init_device(self) -> torch.device:
        """Where to materialise the model's weights before `wrap`."""
        return self.device

    @property
    def param_device(self) -> torch.device:
        """Where the parameters the optimizer updates live (the CPU when they are offloaded)."""
        return self.device

    # -- collectives ---------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over all ranks (in one process: the tensor itself). *Collective.*"""
        return tensor

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise maximum of small integers over all ranks (a host sync). *Collective.*
        A signal reaches the ranks at slightly different times: deciding to stop from the
        maximum keeps them in step."""
        return list(values)

    def barrier(self) -> None:
        """Wait until every rank reaches this point. *Collective.*"""

    # -- model and optimisation ----------------------------------------------------------

    def wrap(
        self, model: nn.Module, make_optimizer: OptimizerFactory
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to its device, wrap it for the strategy and build the optimizer over
        the parameters the strategy trains. Returns (what to call, the optimizer whose
        ``param_groups`` carry the lr the schedule sets). The model must already be patched
        and checkpoint-wrapped (`ligertune.models.prepare_for_training`)."""
        model = model.to(self.device)
        return model, make_optimizer(model, self.param_device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside whatever `wrap` returned."""
        return model

    def accumulation_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward. `sync` is False for every
        micro-batch but the last of an optimizer step, so strategies that all-reduce
        gradients in backward can skip the reduction until the window is complete."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's share of the step loss (see the module docstring)."""
        loss.backward()

    def clip_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Global gradient 2-norm before clipping (a 0-d tensor on `device`, no host sync);
        scales the gradients down to `max_norm` when it is set and exceeded."""
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the update; the loop calls it only when the loss and the norm are finite."""
        optimizer.step()

    # -- checkpoints and export ----------------------------------------------------------

    def full_model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole (unsharded) model state dict, named as the Hugging Face model names it, on
        the main rank; other ranks may get an empty dict. *Collective.*"""
        return self.unwrap(model).state_dict() if self.is_main else {}

    def save_state(self, directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Write the model and optimizer state into a checkpoint directory, in
        `checkpoint_format` (`ligertune.checkpoint` owns the rest). *Collective.*"""
        state = self.full_model_state_dict(model)
        if self.is_main:
            write_full_state(directory, state, optimizer.state_dict())

    def load_state(self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Restore what `save_state` wrote. *Collective.*"""
        self._check_format(checkpoint)
        self.unwrap(model).load_state_dict(checkpoint.model)
        optimizer.load_state_dict(checkpoint.optimizer)

    def _check_format(self, checkpoint: Checkpoint) -> None:
        if checkpoint.format != self.checkpoint_format:
            saved_by = {FULL_FORMAT: "none or ddp", "dcp": "fsdp", "deepspeed": "deepspeed"}.get(
                checkpoint.format, "?"
            )
            raise RecipeError(
                [
                    f"checkpoint.resume: {checkpoint.path} holds a {checkpoint.format!r} checkpoint (parallel.strategy "
                    f"{saved_by}); this run's strategy {self.strategy} reads {self.checkpoint_format!r} ones. Resume "
                    f"with parallel.strategy={saved_by.split()[0]}, or start over with checkpoint.resume=none"
                ]
            )

    def shutdown(self) -> None:
        """Release the process group (nothing to do in one process)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy}, rank={self.rank}/{self.world_size}, device={self.device})"


# --------------------------------------------------------------------------------------------
# Multi-process strategies
# --------------------------------------------------------------------------------------------


class _ProcessGroupRuntime(Runtime):
    """A rank of a torch.distributed job: joins the process group, provides the collectives,
    and undoes the gradient averaging of the engines (see the module docstring)."""

    def __init__(self, recipe: Recipe):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = resolve_device(recipe.training.device, local_rank)
        if device.type == "cuda":
            visible = torch.cuda.device_count()
            if local_rank >= visible:
                raise RecipeError(
                    [
                        f"parallel.strategy: {self.strategy}: this process has LOCAL_RANK {local_rank} but only "
                        f"{visible} GPU(s) are visible on this node; use --nproc-per-node {visible} or fewer"
                    ]
                )
            torch.cuda.set_device(device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if "WORLD_SIZE" in os.environ:  # started by torchrun: its env:// rendezvous
                dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
            else:  # a job of one process, without a launcher
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        super().__init__(device, dist.get_rank(), local_rank, dist.get_world_size())

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max_over_ranks(self, values: list[int]) -> list[int]:
        votes = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return votes.tolist()

    def barrier(self) -> None:
        dist.barrier()

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.world_size).backward()

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


class DDPRuntime(_ProcessGroupRuntime):
    """DistributedDataParallel: every rank holds the whole model, optimizer and gradients;
    backward all-reduces the gradients in buckets while it runs (skipped with ``no_sync`` for
    all micro-batches but the last of a window). The simplest and, when the model fits, the
    fastest strategy; it needs ~16 bytes per parameter per GPU with ``bf16-mixed`` AdamW, so an
    8B model does not fit a 141 GB GPU. Checkpoints are "full", like a single process's (rank
    0 writes them, every rank reads them), so none and ddp runs resume each other."""

    strategy = "ddp"

    def wrap(self, model, make_optimizer):
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        # gradient_as_bucket_view: the gradients live in the communication buckets, no second copy.
        wrapped = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
        return wrapped, make_optimizer(wrapped, self.param_device)

    def unwrap(self, model):
        return model.module

    def accumulation_context(self, model, sync):
        return contextlib.nullcontext() if sync else model.no_sync()


class FSDPRuntime(_ProcessGroupRuntime):
    """FSDP2: ``fully_shard`` on every decoder layer, then on the root (embeddings, final norm,
    lm_head). Each rank stores 1/N of every parameter, gradient and optimizer state (DTensors);
    a layer's full weights are all-gathered just before its forward and backward and freed
    after (``parallel.fsdp.reshard_after_forward``; off keeps them from forward to backward:
    less communication, more memory), and gradients are reduce-scattered after each
    micro-batch's backward (memory stays sharded; accumulation costs one reduce-scatter per
    micro-batch).

    The kernels see the gathered weights: our patches run inside the modules' forwards, where
    FSDP has swapped the full parameters in; the fused linear cross entropy calls the lm_head
    *module*, inside the root's forward, so its weight is the gathered one too. Patching and
    activation checkpointing happen before `wrap` (hooks of the checkpointed layers then run
    inside the recomputation, which re-gathers the weights).

    Precision (``parallel.fsdp.mixed_precision``): with ``training.precision: bf16-mixed``,
    fp32 master parameters stay sharded and the gathered compute copies are bf16, gradients are
    reduced in fp32; with ``bf16``, parameters are bf16 and gradients are reduced in fp32 then
    stored in bf16; with ``fp32`` the option has no effect. ``parallel.fsdp.cpu_offload`` keeps
    the shards, gradients and optimizer state in CPU memory and runs AdamW on the CPU.

    Checkpoints ("dcp"): every rank writes its shards with torch.distributed.checkpoint; a
    resume may use another number of ranks (DCP reshards on load). The export gathers the full
    state dict onto rank 0's CPU.
    """

    strategy = "fsdp"
    checkpoint_format = "dcp"

    def __init__(self, recipe: Recipe):
        if recipe.parallel.fsdp.cpu_offload and resolve_device(recipe.training.device).type != "cuda":
            raise RecipeError(
                [
                    "parallel.fsdp.cpu_offload: offloading moves the shards off the GPU and needs "
                    "training.device cuda; set parallel.fsdp.cpu_offload=false on the CPU"
                ]
            )
        super().__init__(recipe)
        self.options = recipe.parallel.fsdp
        self.precision = recipe.training.precision

    @property
    def param_device(self) -> torch.device:
        return torch.device("cpu") if self.options.cpu_offload else self.device

    def _shard_options(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policy = MixedPrecisionPolicy()
        if self.options.mixed_precision and self.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif self.options.mixed_precision and self.precision == "bf16":
            policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        return dict(
            reshard_after_forward=self.options.reshard_after_forward,
            mp_policy=policy,
            offload_policy=CPUOffloadPolicy() if self.options.cpu_offload else OffloadPolicy(),
        )

    def wrap(self, model, make_optimizer):
        from torch.distributed.fsdp import fully_shard

        from ligertune.models import decoder_layers

        model = model.to(self.device)
        options = self._shard_options()
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        return model, make_optimizer(model, self.param_device)

    def clip_grad_norm(self, model, max_norm):
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        # Each rank's norm covers its shards only; full_tensor() sums the squares over ranks.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.to(self.device)

    def full_model_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_state(self, directory, model, optimizer):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / "dcp")

    def load_state(self, checkpoint, model, optimizer):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._check_format(checkpoint)
        # Load in place into state dicts of this run's sharding (the saved one may differ).
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=checkpoint.path / "dcp")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class DeepSpeedRuntime(_ProcessGroupRuntime):
    """DeepSpeed ZeRO (``parallel.deepspeed``), configured from the recipe by
    `deepspeed_config` and handed our torch AdamW (DeepSpeed's own fused optimizers are built
    at run time and need a matching CUDA toolchain; torch's needs nothing). Stage 1 shards the
    optimizer state, 2 also the gradients, 3 also the parameters (gathered per module around
    its forward and backward by hooks, which the fused linear cross entropy's lm_head call
    triggers too). ``bf16-mixed`` is DeepSpeed's bf16 mode: bf16 weights and compute, fp32
    master weights and optimizer state inside the ZeRO optimizer; ``bf16`` (bf16 master
    weights) has no DeepSpeed equivalent and is refused. DeepSpeed casts the module to bf16
    before it copies the fp32 master weights out of it, so a random fp32 init is rounded to
    bf16 first. Every master weight then sits on the bf16 grid, and an update smaller than half
    a bf16 step leaves the bf16 compute weights unchanged until the updates add up. FSDP2 and
    DDP keep the unrounded init, whose rounding to bf16 for compute moves with any update. From
    a random init at warm-up learning rates ZeRO's loss therefore falls a few steps later;
    from saved bf16 weights (on the grid for every strategy) the strategies agree. The run log
    says so (`notice`).

    Accumulation: the loop tells the engine which micro-batch closes the window
    (``set_gradient_accumulation_boundary``), so gradients are reduced once per window.
    Optimizer step: after backward the gradients belong to the ZeRO optimizer, which computes
    the global norm, clips and updates in one call (``engine.step``) and itself skips the
    update when the norm is not finite. So `clip_grad_norm` runs that whole step and returns
    DeepSpeed's norm, and `optimizer_step` has nothing left to do. The loop's non-finite
    handling then holds as for the other strategies (a non-finite loss has non-finite
    gradients, so DeepSpeed skipped the update too).

    Checkpoints ("deepspeed"): DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` under
    ``deepspeed/`` in the checkpoint directory; a resume needs the same number of ranks. The
    export is DeepSpeed's consolidated 16-bit state dict under ZeRO-3 (the module's own state
    dict below it), gathered on rank 0.
    """

    strategy = "deepspeed"
    checkpoint_format = "deepspeed"
    _TAG = "deepspeed"

    def __init__(self, recipe: Recipe):
        if recipe.training.precision == "bf16":
            raise RecipeError(
                [
                    "training.precision: bf16 with parallel.strategy deepspeed: DeepSpeed's bf16 mode keeps fp32 "
                    "master weights in its ZeRO optimizer; set training.precision=bf16-mixed"
                ]
            )
        super().__init__(recipe)
        self.options = recipe.parallel.deepspeed
        self.config = deepspeed_config(recipe)
        self.engine = None
        if recipe.model.config is not None and recipe.training.precision == "bf16-mixed":
            self.notice = (
                "DeepSpeed's bf16 mode starts its fp32 master weights from the bf16-rounded random init, so "
                "updates below bf16's resolution (small warm-up learning rates) change nothing for the first "
                "steps: the loss falls later than under ddp or fsdp. Runs from saved bf16 weights are not "
                "affected (docs/distributed.md#deepspeed-and-a-random-init)"
            )

    @property
    def param_device(self) -> torch.device:
        return torch.device("cpu") if self.options.offload_optimizer else self.device

    def wrap(self, model, make_optimizer):
        import deepspeed

        # DeepSpeed logs its whole config and every step at INFO on every rank.
        deepspeed.utils.logger.setLevel(logging.WARNING)
        optimizer = make_optimizer(model, self.param_device)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=copy.deepcopy(self.config), dist_init_required=False
        )
        # The torch optimizer stays the one the schedule drives: ZeRO steps it with its
        # param_groups (lr included), over the flat fp32 partitions it put there.
        return self.engine, optimizer

    def unwrap(self, model):
        return model.module

    def accumulation_context(self, model, sync):
        model.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss):
        # The loss is already normalised over the window: no division by the accumulation steps.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def clip_grad_norm(self, model, max_norm):
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float64).to(self.device)

    def optimizer_step(self, optimizer):
        pass  # done by engine.step() in clip_grad_norm

    def full_model_state_dict(self, model):
        if self.options.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict() or {}
        return super().full_model_state_dict(model)

    def save_state(self, directory, model, optimizer):
        self.engine.save_checkpoint(str(directory), tag=self._TAG, save_latest=False)

    def load_state(self, checkpoint, model, optimizer):
        self._check_format(checkpoint)
        if checkpoint.world_size != self.world_size:
            raise RecipeError(
                [
                    f"checkpoint.resume: {checkpoint.path} was saved by {checkpoint.world_size} DeepSpeed ranks and "
                    f"this run has {self.world_size}; ZeRO checkpoints resume on the same number of ranks. Launch "
                    f"{checkpoint.world_size} processes, or start over with checkpoint.resume=none"
                ]
            )
        loaded, _ = self.engine.load_checkpoint(
            str(checkpoint.path), tag=self._TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise RecipeError(
                [f"checkpoint.resume: DeepSpeed found no checkpoint under {checkpoint.path / self._TAG}"]
            )


# --------------------------------------------------------------------------------------------
# DeepSpeed configuration
# --------------------------------------------------------------------------------------------

# Keys of the DeepSpeed config that the recipe decides, with the recipe key to change instead.
_RECIPE_OWNED = {
    ("train_micro_batch_size_per_gpu",): "training.micro_batch_size",
    ("gradient_accumulation_steps",): "training.gradient_accumulation_steps",
    ("gradient_clipping",): "training.max_grad_norm",
    ("bf16", "enabled"): "training.precision",
    ("fp16", "enabled"): "training.precision",
    ("zero_optimization", "stage"): "parallel.deepspeed.zero_stage",
}


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
    """The DeepSpeed config of a recipe, with ``parallel.deepspeed.config`` (a JSON file)
    merged over it key by key. The recipe stays the one source of the batch shape, clipping,
    precision and ZeRO stage: the file may repeat them with the same value but not change
    them, and may not name an optimizer or scheduler (the recipe's AdamW and schedule are
    handed to DeepSpeed). Everything else in the file (bucket sizes, overlap_comm, offload
    details, ...) wins."""
    training, options = recipe.training, recipe.parallel.deepspeed
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if options.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    generated = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "gradient_clipping": training.max_grad_norm or 0.0,
        "bf16": {"enabled": training.precision == "bf16-mixed"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        # torch's AdamW is not on DeepSpeed's list of ZeRO-tested optimizers, and with an
        # offloaded optimizer DeepSpeed would insist on its own (JIT-compiled) CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,  # our own metrics report the steps
        "wall_clock_breakdown": False,
    }
    if options.config is None:
        return generated
    path = recipe.resolve(options.config)
    try:
        user = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecipeError([f"parallel.deepspeed.config: cannot read {path} as JSON: {e}"]) from None
    if not isinstance(user, dict):
        raise RecipeError(
            [f"parallel.deepspeed.config: {path} must hold a JSON object, got {type(user).__name__}"]
        )
    problems = [
        f"parallel.deepspeed.config: {path} sets {key!r}; ligertune hands DeepSpeed the recipe's AdamW and LR "
        "schedule (training.*), remove it from the file"
        for key in ("optimizer", "scheduler")
        if key in user
    ]
    if "train_batch_size" in user:
        problems.append(
            f"parallel.deepspeed.config: {path} sets 'train_batch_size'; it follows from training.micro_batch_size × "
            "training.gradient_accumulation_steps × the number of processes: remove it from the file"
        )
    for keys, recipe_key in _RECIPE_OWNED.items():
        ours, theirs = _lookup(generated, keys), _lookup(user, keys)
        if theirs is not _MISSING and theirs != ours:
            problems.append(
                f"parallel.deepspeed.config: {path} sets {'.'.join(keys)}={theirs!r} but the recipe gives {ours!r}; "
                f"change {recipe_key} in the recipe instead and remove it from the file"
            )
    if problems:
        raise RecipeError(problems)
    return _merge(generated, user)


_MISSING = object()


def _lookup(mapping: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(mapping, dict) or key not in mapping:
            return _MISSING
        mapping = mapping[key]
    return mapping


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# --------------------------------------------------------------------------------------------
# Choosing the runtime
# --------------------------------------------------------------------------------------------


def resolve_device(choice: str, local_rank: int = 0) -> torch.device:
    """`training.device` → a torch device; `auto` picks CUDA when present."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError(
                [
                    "training.device: cuda was asked for but torch sees no CUDA GPU; use training.device=cpu "
                    "(slow, for testing) or check the driver and the torch build (`ligertune env`)"
                ]
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_STRATEGIES: dict[str, type[_ProcessGroupRuntime]] = {
    "ddp": DDPRuntime,
    "fsdp": FSDPRuntime,
    "deepspeed": DeepSpeedRuntime,
}


def create_runtime(recipe: Recipe) -> Runtime:
    """The runtime for this process, from the recipe and the launcher's environment. A
    multi-process strategy joins the process group here."""
    strategy = recipe.parallel.strategy
    launched_world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "none":
        if launched_world > 1:
            raise RecipeError(
                [
                    f"parallel.strategy: none, but this process was launched as one of {launched_world} "
                    "(WORLD_SIZE is set, e.g. by torchrun); every process would train the same model into "
                    "the same output directory. Set parallel.strategy to ddp, fsdp or deepspeed, or launch one process"
                ]
            )
        return Runtime(resolve_device(recipe.training.device))
    return _STRATEGIES[strategy](recipe)


def rank_label() -> str:
    """``"rank 2/4: "`` in a process of a multi-process launch, else ``""``: prefixes this
    process's error messages so that a failing rank names itself in the job's output."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"rank {os.environ.get('RANK', '0')}/{world}: " if world > 1 else ""
