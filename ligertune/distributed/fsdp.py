"""FSDP2: ``fully_shard`` per decoder layer and on the root; parameters, gradients and optimizer state sharded."""

from __future__ import annotations

from typing import Any

import torch

from ligertune.config import Recipe
from ligertune.distributed.runtime import ProcessGroupRuntime
from ligertune.models.build import decoder_layers


class FSDPRuntime(ProcessGroupRuntime):
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
        if max_norm:  # None or 0: no clipping, as in `Runtime.clip_grad_norm`
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
