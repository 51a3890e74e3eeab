"""FSDP2: ``fully_shard`` per decoder layer and on the root; parameters, gradients and optimizer state sharded."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ligertune.catalog.strategies import FSDPParallel
from ligertune.config import Recipe
from ligertune.distributed.runtime import ProcessGroupRuntime, StateTransforms, has_frozen_parameters
from ligertune.models.build import build_model, decoder_layers, vision_blocks
from ligertune.run.safe_load import dcp_load


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

    Sharded initialisation (``parallel.sharded_init``, on by default): `build_model` returns
    the model on the meta device (shapes only), `wrap` shards that empty model, allocates only
    this rank's shards (``to_empty``) and fills them from rank 0, which builds the model whole
    by the plain path (`ProcessGroupRuntime.whole_model_on_rank0`: pretrained weights in CPU
    memory) and sends one tensor at a time with ``set_model_state_dict(...,
    broadcast_from_rank0=True)``, every rank keeping its slice. So no GPU holds the whole model,
    and the weights are exactly those of a plain build. The price: one copy of the model in
    rank 0's host memory (a 70B model in bf16: 140 GB, which an 8-GPU host has) and a broadcast
    of every weight at start. Buffers are broadcast from rank 0's model as well: the
    non-persistent ones (rotary ``inv_freq``) are in no state dict, and copying them needs no
    knowledge of how a family computes them. With LoRA the empty model is the peft model the
    transforms made of it, and rank 0's whole build goes through the same transforms that change
    parameters (`wrap`'s `transforms`), from the RNG state of the empty build: its state dict has
    peft's names and the adapters the plain run initialises (see
    `ProcessGroupRuntime.whole_model_on_rank0`). Not with ``cpu_offload`` yet (the recipe rules
    turn it off): the shards would be allocated in CPU memory, which NCCL cannot broadcast into.
    """

    options_model = FSDPParallel

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.recipe = recipe
        self.options = recipe.parallel.fsdp
        self.precision = recipe.training.precision
        self.sharded_init = recipe.parallel.shards_at_init
        # Each FSDP unit's reshard_after_forward, as `_shard` set it (restored after `gathered`).
        self._reshards: dict[nn.Module, bool] = {}

    @property
    def param_device(self) -> torch.device:
        return torch.device("cpu") if self.options.cpu_offload else self.device

    def _shard_options(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        policy = MixedPrecisionPolicy()
        reduce = torch.bfloat16 if self.options.reduce_dtype == "bf16" else torch.float32
        if self.options.mixed_precision and self.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        elif self.options.mixed_precision and self.precision == "bf16":
            policy = MixedPrecisionPolicy(reduce_dtype=reduce)
        return dict(
            mesh=self.mesh,
            reshard_after_forward=self.options.reshard_after_forward,
            mp_policy=policy,
            offload_policy=CPUOffloadPolicy() if self.options.cpu_offload else OffloadPolicy(),
        )

    def build_model(self, recipe):
        if not self.sharded_init:
            return super().build_model(recipe)
        self.remember_build_rng_state()
        return build_model(recipe, self.device, empty=True)

    def wrap(self, model, make_optimizer, transforms):
        model = self._shard(model, self.recipe, self._shard_options(), trains=True, transforms=transforms)
        return model, make_optimizer(model, self.param_device)

    @contextlib.contextmanager
    def gathered(self, model):
        """Every FSDP unit of the policy all-gathered once (``unshard``), kept gathered through
        any number of forwards (``reshard_after_forward`` off meanwhile), then resharded and
        given back its setting: a generation of N tokens costs one all-gather of the model
        instead of N. The price is the whole model's weights in the compute dtype on every
        rank while it runs (the memory plan counts it in the generation phase). *Collective.*"""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            for unit in units:
                unit.unshard()
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(self._reshards.get(unit, True), recurse=False)

    def wrap_frozen(self, model, recipe):
        """The policy's layout (each decoder layer, then the root; the same mixed precision and
        offload; filled from rank 0 when built empty), so a reference or teacher costs each rank
        1/N of its weights. Always resharded after forward, whatever
        ``parallel.fsdp.reshard_after_forward`` says: keeping the gathered weights for backward
        is the point of turning it off, and a frozen model has no backward, so they would stay
        gathered for good."""
        return self._shard(
            model, recipe, {**self._shard_options(), "reshard_after_forward": True}, trains=False
        )

    def _shard(
        self,
        model: nn.Module,
        recipe: Recipe,
        options: dict[str, Any],
        trains: bool,
        transforms: StateTransforms | None = None,
    ) -> nn.Module:
        """``fully_shard`` on every vision block (a vision-language model), every decoder layer and
        then the root; a model built empty (sharded init) gets its shards filled from rank 0's
        build of `recipe`, put through `transforms` (a frozen model has none that change its
        parameters). *Collective.*

        For a model that trains, the last decoder layer is never resharded after forward: its
        backward is the first, right after the forward ends, so freeing its weights would only
        gather them again at once. With ``parallel.fsdp.prefetch`` above 1 each layer names the
        layers whose all-gathers to issue when it starts, in forward the next ones and in backward
        the previous ones (FSDP2 on its own gathers one ahead)."""
        from torch.distributed.fsdp import fully_shard

        empty = any(p.is_meta for p in model.parameters())
        if not empty:
            model = model.to(self.device)
        # The vision tower runs once, before the decoder: each block gathered for its forward (and
        # its backward when the tower trains) and freed after, as the decoder layers are.
        for block in vision_blocks(model):
            fully_shard(block, **options)
            self._reshards[block] = options["reshard_after_forward"]
        layers = decoder_layers(model)
        for index, layer in enumerate(layers):
            last = trains and index == len(layers) - 1
            reshards = options["reshard_after_forward"] and not last
            fully_shard(layer, **{**options, "reshard_after_forward": reshards})
            self._reshards[layer] = reshards
        fully_shard(model, **options)
        self._reshards[model] = options["reshard_after_forward"]
        depth = self.options.prefetch
        if depth > 1:
            for index, layer in enumerate(layers):
                layer.set_modules_to_forward_prefetch(layers[index + 1 : index + 1 + depth])
                layer.set_modules_to_backward_prefetch(layers[max(0, index - depth) : index][::-1])
        if empty:
            self._fill_shards(model, recipe, transforms)
        return model

    # -- sharded initialisation -----------------------------------------------------------

    def _fill_shards(self, model: nn.Module, recipe: Recipe, transforms: StateTransforms | None) -> None:
        """Allocate this rank's shards of the sharded meta model and fill them with the weights
        of rank 0's plain build of `recipe`, put through `transforms`. *Collective.*"""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=self.device)  # this rank's shards and the (unsharded) buffers
        source = self.whole_model_on_rank0(recipe, model, transforms) if self.is_main else None
        full_state = source.state_dict() if source is not None else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
        set_model_state_dict(model, full_state, options=options)
        # Buffers, persistent or not (these are in no state dict): rank 0's values to all.
        source_buffers = dict(source.named_buffers()) if source is not None else {}
        for name, buffer in model.named_buffers():
            if source is not None:
                buffer.copy_(source_buffers[name])
            dist.broadcast(buffer, src=0)
        del full_state, source_buffers, source
        self.share_init_rng_state()

    @classmethod
    def read_weights(cls, checkpoint, model):
        """The model part of a "dcp" checkpoint, read in one process (DCP needs no process group to
        read: it loads in place into tensors of the requested shapes, whatever the saving
        sharding), without unpickling (`ligertune.run.safe_load`)."""
        state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
        dcp_load(state, checkpoint.path / "dcp")
        return state["model"]

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

        model_state, optimizer_state = get_state_dict(model, optimizer, options=_state_options(model))
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / "dcp")

    def load_state(self, checkpoint, model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self._check_format(checkpoint)
        # Load in place into state dicts of this run's sharding (the saved one may differ).
        options = _state_options(model)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optimizer": optimizer_state}
        # Without unpickling: DCP's own reader would run code planted in a copied checkpoint.
        dcp_load(state, checkpoint.path / "dcp")
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )


def _state_options(model: nn.Module):
    """Checkpoint state options: with frozen parameters (LoRA), the trained ones only (the frozen
    ones come back from the recipe; see `ligertune.distributed.runtime.trainable_state`), loaded
    non-strictly since the frozen keys are absent; DCP's load still fails on any key of this
    run's trained parameters the checkpoint lacks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = has_frozen_parameters(model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
