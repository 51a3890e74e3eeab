"""The one seam between the training loop and the multi-process strategies.

The loop in `ligertune.training` never asks which strategy is running: it talks to a `Runtime`,
which knows the process's place in the job (rank, world size, device) and does the few things
that differ between strategies — wrapping the model and building the optimizer, placing the
frozen models of the preference and distillation objectives (reference, teacher), backward,
gradient clipping and the optimizer step, collective sums, checkpoint state and the full
state dict of the final export. Each class names the catalog's options model of the strategy it
runs (``options_model``, `ligertune.catalog.strategies`), and `ligertune.distributed.create_runtime`
picks the class whose options the recipe's ``parallel`` section is:

    `Runtime`           one process, one device
    `DDPRuntime`        torch DistributedDataParallel: every rank holds the whole model
    `FSDPRuntime`       FSDP2 ``fully_shard`` per decoder layer and on the root
    `DeepSpeedRuntime`  DeepSpeed ZeRO stage 1/2/3 with our torch AdamW

The engines are PyTorch's and DeepSpeed's own; nothing here communicates by itself beyond
``torch.distributed`` collectives. Processes are started by torchrun (``ligertune train
--nproc-per-node G`` runs it, see `ligertune.distributed.launch`), which sets RANK, LOCAL_RANK and
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
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ligertune.catalog.implements import Implements
from ligertune.catalog.strategies import STRATEGIES, ParallelOptions, SingleProcess, writers
from ligertune.config import Recipe
from ligertune.distributed.context import context_split, shard_rows
from ligertune.distributed.env import has_rendezvous, launched_as
from ligertune.errors import RecipeError
from ligertune.models.attention import ContextSplit, install_context_parallel
from ligertune.models.build import build_model
from ligertune.run.checkpoint import Checkpoint, write_full_state

# (module, where its parameters live) -> the optimizer over them; see `Runtime.wrap`.
OptimizerFactory = Callable[[nn.Module, torch.device], torch.optim.Optimizer]
# What the training loop did to the model between `Runtime.build_model` and `Runtime.wrap` that
# changes its parameters (LoRA's adapters), as one call returning the model to go on with; a
# sharded init repeats it on the whole model rank 0 fills the shards from (see `Runtime.wrap`).
StateTransforms = Callable[[nn.Module], nn.Module]


class Runtime(Implements):
    """One process of a training job: where it runs and how it syncs with the others.

    This base class is the single-process implementation (`SingleProcess` options); multi-process
    strategies subclass it, name their options model and override what differs. A subclass that
    names ``options_model`` is registered: `implementation` finds it.
    """

    options_model: type[ParallelOptions] = SingleProcess
    # A line for the run log about how this strategy trains this recipe, or None.
    notice: str | None = None
    # Whether `build_model` returns an empty (meta) model that `wrap` shards and then fills
    # (``parallel.sharded_init``; see `ligertune.distributed.fsdp`).
    sharded_init: bool = False
    # The context-parallel group of this rank (``parallel.context_parallel`` > 1), else None:
    # `ligertune.distributed.context`.
    context: ContextSplit | None = None

    @classmethod
    def reading(cls, checkpoint_format: str) -> type[Runtime] | None:
        """A runtime class that reads checkpoints of `checkpoint_format`, or None for a format
        none writes."""
        readers = [r for r in cls.implementations() if r.options_model.checkpoint_format == checkpoint_format]
        return readers[0] if readers else None

    @classmethod
    def read_weights(cls, checkpoint: Checkpoint, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model state dict a checkpoint of this strategy's format holds, read in one
        process without a process group (for `ligertune generate`); `model` is the model the
        checkpoint's recipe builds, whose shapes a sharded format is read into."""
        return checkpoint.model

    @property
    def strategy(self) -> str:
        return STRATEGIES.name_of(self.options_model)

    @property
    def checkpoint_format(self) -> str:
        return self.options_model.checkpoint_format

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
    def param_device(self) -> torch.device:
        """Where the parameters the optimizer updates live (the CPU when they are offloaded)."""
        return self.device

    # -- the data's shards (context parallelism: `ligertune.distributed.context`) ----------

    @property
    def sequence_shards(self) -> int:
        """Ranks each row is split over (``parallel.context_parallel``)."""
        return self.context.shards if self.context is not None else 1

    @property
    def data_rank(self) -> int:
        """Which shard of the data this rank loads: the ranks of a context-parallel group load
        the same rows."""
        return self.rank // self.sequence_shards

    @property
    def data_world_size(self) -> int:
        """How many shards the data is cut into: one per context-parallel group."""
        return self.world_size // self.sequence_shards

    def split_attention(self, model: nn.Module) -> str | None:
        """Route the model's attention through the context-parallel form over this rank's group
        (`ligertune.models.attention.install_context_parallel`); the run log's line, or None
        without context parallelism."""
        return install_context_parallel(model, self.context) if self.context is not None else None

    def shard_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a micro-batch of the data (every row whole, or this rank's
        context-parallel shard of each)."""
        return shard_rows(batch, self.context) if self.context is not None else batch

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

    def build_model(self, recipe: Recipe) -> nn.Module:
        """The model the transforms and then `wrap` get (or `wrap_frozen`, for a frozen model's
        recipe). Here it is built whole, its weights on this process's device; a strategy with
        `sharded_init` returns it on the meta device instead and materialises only its shards
        in `wrap`."""
        return build_model(recipe, self.device)

    def wrap(
        self, model: nn.Module, make_optimizer: OptimizerFactory, transforms: StateTransforms
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to its device, wrap it for the strategy and build the optimizer over
        the parameters the strategy trains. Returns (what to call, the optimizer whose
        ``param_groups`` carry the lr the schedule sets). The model must already be patched
        and checkpoint-wrapped (`ligertune.training.transforms`). `transforms` is what of that
        changed its parameters (`ligertune.training.transforms.state_transforms`): fsdp's sharded
        init applies it to rank 0's whole build, whose state then has the transformed model's
        names and values (peft's adapters included). The others ignore it: their model is whole
        already, or built inside ZeRO-3's ``zero.Init`` (DeepSpeed, which trains no LoRA)."""
        model = model.to(self.device)
        return model, make_optimizer(model, self.param_device)

    def wrap_frozen(self, model: nn.Module, recipe: Recipe) -> nn.Module:
        """Place a model that only runs forward (a DPO/KTO reference, a distillation teacher:
        no gradients, no optimizer) the way this strategy places the policy, and return what to
        call. `model` comes from `build_model` of `recipe` (the frozen model's own section),
        already patched and frozen. Here, and under DDP, a plain replica on this device: DDP's
        wrapper exists to all-reduce gradients, which a frozen model has none of. The sharded
        strategies shard it as they shard the policy. *Collective* for them."""
        return model.to(self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside whatever `wrap` returned."""
        return model

    def gathered(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which `model` (the policy as `wrap` built it, not the wrapper) runs many
        forwards under ``no_grad`` with its whole weights in place, gathered once for all of
        them: an objective that generates its completions (one forward per token) runs inside
        it. Here, and for every strategy that keeps whole parameters, there is nothing to do.
        *Collective* for the sharded strategies."""
        return contextlib.nullcontext()

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
        scales the gradients down to `max_norm` when it is set and exceeded. None or 0 means no
        clipping (``training.max_grad_norm``): clipping to 0 would zero every gradient."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not max_norm:
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
        `checkpoint_format` (`ligertune.run.checkpoint` owns the rest). *Collective.*"""
        state = trainable_state(self.unwrap(model), self.full_model_state_dict(model))
        if self.is_main:
            write_full_state(directory, state, optimizer.state_dict())

    def load_state(self, checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Restore what `save_state` wrote. *Collective.*"""
        self._check_format(checkpoint)
        load_trainable_state(self.unwrap(model), checkpoint.model, checkpoint.path)
        optimizer.load_state_dict(checkpoint.optimizer)

    def _check_format(self, checkpoint: Checkpoint) -> None:
        if checkpoint.format != self.checkpoint_format:
            saved_by = writers(checkpoint.format) or ["?"]
            raise RecipeError(
                [
                    f"checkpoint.resume: {checkpoint.path} holds a {checkpoint.format!r} checkpoint (parallel.strategy "
                    f"{' or '.join(saved_by)}); this run's strategy {self.strategy} reads {self.checkpoint_format!r} "
                    f"ones. Resume with parallel.strategy={saved_by[0]}, or start over with checkpoint.resume=none"
                ]
            )

    def shutdown(self, finished: bool = False) -> None:
        """Release the process group (nothing to do in one process)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy}, rank={self.rank}/{self.world_size}, device={self.device})"


# --------------------------------------------------------------------------------------------
# Adapter-only checkpoints (LoRA): the state of the parameters that train
# --------------------------------------------------------------------------------------------


def has_frozen_parameters(module: nn.Module) -> bool:
    """Whether some parameters do not train (LoRA freezes the base model): checkpoints then hold
    only the trained ones, since the frozen ones are rebuilt from the recipe at resume."""
    return any(not p.requires_grad for p in module.parameters())


def trainable_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the module's state dict) restricted to the parameters that require grad, when
    some do not; unchanged otherwise (full fine-tuning). For an 8B model with r=16 adapters
    this is ~170 MB instead of 16 GB per checkpoint."""
    if not has_frozen_parameters(module):
        return state
    trained = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in state.items() if k in trained}


def load_trainable_state(module: nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Load a `trainable_state` checkpoint: strictly for full fine-tuning; with frozen
    parameters, every trained parameter must be in it and nothing else (the frozen ones keep the
    values the recipe built), else RecipeError naming the mismatch."""
    if not has_frozen_parameters(module):
        module.load_state_dict(state)
        return
    trained = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    missing, unexpected = sorted(trained - set(state)), sorted(set(state) - trained)
    if missing or unexpected:
        shown = (missing or unexpected)[:3]
        what = "lacks trained parameters" if missing else "holds parameters this run does not train"
        raise RecipeError(
            [
                f"checkpoint.resume: {where} {what} ({', '.join(shown)}, ...; {len(missing)} missing, "
                f"{len(unexpected)} unexpected): it was saved by a run with other lora settings (or without "
                "lora); resume with those, or start over with checkpoint.resume=none"
            ]
        )
    module.load_state_dict(state, strict=False)


# --------------------------------------------------------------------------------------------
# Multi-process strategies
# --------------------------------------------------------------------------------------------


class ProcessGroupRuntime(Runtime):
    """A rank of a torch.distributed job: joins the process group, provides the collectives,
    and undoes the gradient averaging of the engines (see the module docstring)."""

    def __init__(self, recipe: Recipe):
        local_rank = launched_as().local_rank
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
            if has_rendezvous():  # started by torchrun: its env:// rendezvous
                dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
            else:  # a job of one process, without a launcher
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        super().__init__(device, dist.get_rank(), local_rank, dist.get_world_size())
        # The job's ranks as a device mesh, which FSDP2 shards over: all of them, also with
        # context parallelism, whose groups (`ligertune.distributed.context`) are a second
        # dimension of consecutive ranks; reducing gradients over the whole world sums the
        # context-parallel ranks' shares too.
        self.mesh = init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("data",))
        if recipe.parallel.context_parallel > 1:
            self.context = context_split(recipe.parallel.context_parallel, self.world_size, self.rank)

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

    def shutdown(self, finished: bool = False) -> None:
        if self._owns_group and dist.is_initialized():
            # Synchronised only when every rank finished: after a failure the other ranks may be
            # in another collective, or gone.
            leave_process_groups(synchronised=finished)

    # -- sharded initialisation (fsdp, ZeRO-3) -----------------------------------------------

    _init_rng_state: list | None = None
    # The RNG state when `build_model` built the empty model, for `whole_model_on_rank0`.
    _build_rng_state: list | None = None

    def remember_build_rng_state(self) -> None:
        """Keep the RNG state as the plain build would find it, for `whole_model_on_rank0` to
        start from. Called where the empty model is built: the transforms that run on it before
        the shards are filled draw random numbers too (peft initialises each adapter on the CPU
        before moving it to the meta device), and the plain path draws them *after* the init."""
        self._build_rng_state = _rng_state(self.device)

    def whole_model_on_rank0(
        self, recipe: Recipe, empty: nn.Module, transforms: StateTransforms | None = None
    ) -> nn.Module:
        """Rank 0's whole model, the source of every rank's shards in a sharded init: the plain
        build, so its weights are exactly those of an unsharded run. Pretrained weights are
        loaded into CPU memory. A random init is made where the plain build makes it (this
        rank's device: CUDA and CPU draw different random numbers for the same seed) when it
        takes less than half of the GPU's free memory (`empty`, the meta model, says how
        much); else it is held in CPU memory with its numbers drawn on the GPU module by module
        (`draw_init_on`: the CPU's generator would take minutes at 70B), and the run log says
        the weights differ from a one-GPU run's.

        `transforms` (what the training loop did to `empty` that changes its parameters: LoRA)
        then runs on it, as it runs after the build in the plain path. That is how the whole
        model gets the empty one's names (peft's ``base_model.model.…base_layer.weight`` and
        its adapters) without a table mapping one onto the other, and how the adapters get the
        plain run's init: the build starts from the RNG state `remember_build_rng_state` kept,
        so the init and then the adapters draw the same numbers in the same order as there.
        The RNG state right after both is kept for `share_init_rng_state`."""
        if self._build_rng_state is not None:
            _set_rng_state(self._build_rng_state, self.device)
            self._build_rng_state = None
        device, draw_on = torch.device("cpu"), None
        if recipe.model.config is not None and self.device.type == "cuda":
            needed = sum(p.numel() * p.element_size() for p in empty.parameters())
            free, _ = torch.cuda.mem_get_info(self.device)
            if needed < free // 2:
                device = self.device
            else:
                draw_on = self.device
                self.notice = (
                    f"sharded init: the random init ({needed / 2**30:.1f} GiB) was held in rank 0's CPU memory and "
                    "drawn on its GPU one module at a time: same distribution, other random numbers than a "
                    "one-GPU run of this recipe"
                )
        model = build_model(recipe, device, draw_on=draw_on)
        if transforms is not None:
            model = transforms(model)
        self._init_rng_state = _rng_state(self.device)
        return model

    def share_init_rng_state(self) -> None:
        """Every rank continues from rank 0's RNG state right after its init, as after a plain
        build, where every rank drew the same init numbers from the same seed (rank 0 alone drew
        them here). *Collective.*"""
        states = self._init_rng_state or [None, None]
        dist.broadcast_object_list(states, src=0)
        self._init_rng_state = self._build_rng_state = None
        _set_rng_state(states, self.device)


def _rng_state(device: torch.device) -> list:
    """The CPU generator's state and, on a GPU, that device's (what a model build draws from)."""
    return [torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None]


def _set_rng_state(states: list, device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def leave_process_groups(synchronised: bool) -> None:
    """Destroy every process group of this process, at the end of a job.

    gloo's worker threads free each finished collective's work, and with it the work's tensors,
    which takes the GIL. Two ways that goes wrong right after the last collective, both seen on
    CPU: the teardown joins those threads while holding the GIL (a deadlock: rank 1 hung at
    exit, its agent at torchrun's exit barrier); or a group some object still holds outlives
    `destroy_process_group`, and its thread reaches the GIL while the interpreter is finalising,
    which ends the thread inside C++ (`terminate called without an active exception`, SIGABRT
    at exit, under CPU load). With `synchronised` (every rank is here) a barrier, then a wait
    that lets go of the GIL long enough for a starved thread to be scheduled, leaves the threads
    nothing to free."""
    if synchronised:
        dist.barrier()
        time.sleep(0.25)
    dist.destroy_process_group()


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
