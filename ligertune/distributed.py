"""The one seam between the training loop and the multi-process strategies.

The loop in `ligertune.train` never asks which strategy is running: it talks to a `Runtime`,
which knows the process's place in the job (rank, world size, device) and does the few things
that differ between strategies — wrapping the model, backward, gradient clipping, the
optimizer step, collective sums and checkpoint state dicts.

Gradient accumulation contract (every strategy must keep it): the loop divides each
micro-batch's *summed* token loss by the label-token count of the whole optimizer step,
summed over the accumulation window **and over all ranks** (`all_reduce_sum`). The loss a
rank hands to `backward` is therefore its share of the global token mean, and the gradient
the optimizer needs is the plain *sum* of the ranks' gradients. DDP and FSDP average
gradients over ranks (divide by the world size), so those strategies multiply the loss by the
world size in `backward` to undo that division.

Only the single-process strategy ``none`` exists today; ``ddp``, ``fsdp`` and ``deepspeed``
raise a clear error until they are implemented behind this same interface.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ligertune.recipe import Recipe, RecipeError


class Runtime:
    """One process of a training job: where it runs and how it syncs with the others.

    This base class is the single-process implementation (strategy ``none``); multi-process
    strategies subclass it and override what differs.
    """

    strategy = "none"

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
        """Where to materialise the model's weights before `wrap_model` (sharded strategies
        may prefer the CPU or the meta device)."""
        return self.device

    # -- collectives ---------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over all ranks (in one process: the tensor itself)."""
        return tensor

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    # -- model and optimisation ----------------------------------------------------------

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move the model to its device and wrap it for the strategy; returns what to call."""
        return model.to(self.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside whatever `wrap_model` returned."""
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
        """Global gradient 2-norm before clipping (a 0-d tensor, no host sync); scales the
        gradients down to `max_norm` when it is set and exceeded."""
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm is None:
            return torch.nn.utils.get_total_norm([p.grad for p in params])
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    # -- checkpoint state ----------------------------------------------------------------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state dict, as the Hugging Face model names it."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        optimizer.load_state_dict(state)

    def shutdown(self) -> None:
        """Release the process group (nothing to do in one process)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy}, rank={self.rank}/{self.world_size}, device={self.device})"


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


def create_runtime(recipe: Recipe) -> Runtime:
    """The runtime for this process, from the recipe and the launcher's environment."""
    strategy = recipe.parallel.strategy
    launched_world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "none":
        if launched_world > 1:
            raise RecipeError(
                [
                    f"parallel.strategy: none, but this process was launched as one of {launched_world} "
                    "(WORLD_SIZE is set, e.g. by torchrun); every process would train the same model into "
                    "the same output directory. Set parallel.strategy to ddp or fsdp, or launch one process"
                ]
            )
        return Runtime(resolve_device(recipe.training.device))
    raise RecipeError(
        [f"parallel.strategy: {strategy} is not implemented yet; use parallel.strategy=none (one device)"]
    )
