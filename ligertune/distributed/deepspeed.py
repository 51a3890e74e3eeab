"""DeepSpeed ZeRO stage 1/2/3 with our torch AdamW, configured from the recipe."""

from __future__ import annotations

import contextlib
import copy
import logging
import os

import torch

from ligertune.catalog.strategies import DeepSpeedParallel
from ligertune.catalog.strategies.deepspeed import deepspeed_config
from ligertune.config import Recipe
from ligertune.distributed.runtime import ProcessGroupRuntime
from ligertune.errors import RecipeError
from ligertune.models.build import build_model
from ligertune.run.safe_load import check_deepspeed_files


class DeepSpeedRuntime(ProcessGroupRuntime):
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

    Sharded initialisation (``parallel.sharded_init``, on by default at stage 3): the model is
    built inside ``deepspeed.zero.Init``, which partitions each module's parameters as soon as
    the module is constructed, so a rank holds one module's full weights at most, never the
    model's. transformers does it for us while an ``HfDeepSpeedConfig`` of our config is alive
    (`build_model` keeps one for the duration of the build only: it switches transformers'
    ZeRO-3 code paths on process-wide): ``from_pretrained`` then loads the checkpoint into the
    partitions, module by module. A random init is not left to transformers' ZeRO-3 variant,
    which draws its random numbers in another order than the plain build and so gives other
    weights for the same seed: rank 0 makes the plain seeded init (as under fsdp, see
    `ProcessGroupRuntime.whole_model_on_rank0`) and copies it into the partitions, each
    module's gathered with ``GatheredParameters(modifier_rank=0)``, which scatters rank 0's
    values. The weights then equal the unsharded ZeRO-3 run's bit for bit.
    """

    options_model = DeepSpeedParallel
    _TAG = "deepspeed"

    def __init__(self, recipe: Recipe):
        super().__init__(recipe)
        self.options = recipe.parallel.deepspeed
        self.config = deepspeed_config(recipe)
        # DeepSpeed reads LOCAL_RANK (zero.Init, initialize); a job of one process started
        # without a launcher has none: the value a launcher would set.
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        self.sharded_init = recipe.parallel.shards_at_init
        self.recipe = recipe
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

    def build_model(self, recipe):
        if not self.sharded_init:
            return super().build_model(recipe)
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.utils.logger.setLevel(logging.WARNING)
        source = None
        if recipe.model.config is not None:  # random init: rank 0's plain seeded one, copied in below
            if self.is_main:
                source = self.whole_model_on_rank0(recipe, build_model(recipe, self.device, empty=True))
        # transformers builds under zero.Init while this lives.
        zero3 = HfDeepSpeedConfig(copy.deepcopy(self.config))
        try:
            model = build_model(recipe, self.device)
        finally:
            del zero3
        if recipe.model.config is not None:
            with torch.no_grad():
                for name, module in model.named_modules():
                    params = list(module.parameters(recurse=False))
                    if not params:
                        continue
                    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                        if source is not None:
                            own = source.get_submodule(name)
                            for key, param in module.named_parameters(recurse=False):
                                param.copy_(getattr(own, key))
            del source
            self.share_init_rng_state()
        return model

    def wrap(self, model, make_optimizer, transforms):
        import deepspeed

        # DeepSpeed logs its whole config and every step at INFO on every rank.
        deepspeed.utils.logger.setLevel(logging.WARNING)
        if any(hasattr(p, "ds_shape") for p in model.parameters()):  # built inside zero.Init
            optimizer = self._optimizer_by_full_shapes(model, make_optimizer)
        else:
            optimizer = make_optimizer(model, self.param_device)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=copy.deepcopy(self.config), dist_init_required=False
        )
        # The torch optimizer stays the one the schedule drives: ZeRO steps it with its
        # param_groups (lr included), over the flat fp32 partitions it put there.
        return self.engine, optimizer

    def wrap_frozen(self, model, recipe):
        """ZeRO-3: an inference engine, ``deepspeed.initialize`` without an optimizer, over the
        model `build_model` made (inside ``zero.Init`` with sharded init, like the policy, so no
        rank ever holds it whole; else whole, and partitioned here). The partitions alone would
        not do: ``zero.Init`` leaves empty placeholders, and it is the engine (its
        ``DeepSpeedZeRoOffload``, what ZeRO-3 builds when it has no optimizer) that installs the
        hooks gathering each module's weights around its forward, the lm_head's included, as
        for the policy. It is also how practitioners run a ZeRO-3 reference model (TRL's
        ``prepare_deepspeed``). Its config is the policy's (precision, parameter offload, the
        user's JSON: bucket sizes and persistence thresholds apply to both) without the
        optimizer offload, as there is no optimizer. Stages 1 and 2 shard the optimizer state
        and gradients only, which a frozen model has none of: a plain replica, as under DDP."""
        if self.options.zero_stage != 3:
            return super().wrap_frozen(model, recipe)
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        config = copy.deepcopy(self.config)
        config["zero_optimization"].pop("offload_optimizer", None)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        return engine

    def _optimizer_by_full_shapes(self, model, make_optimizer):
        """The optimizer `make_optimizer` builds, over a model whose parameters zero.Init has
        already replaced by empty placeholders. The optimizer's parameter groups may depend on
        shapes (no weight decay on vectors: ``p.ndim < 2``), which the placeholders (all of
        shape (0,)) would get wrong. So the optimizer is built over the model's empty meta
        twin, whose parameters have the real shapes and cost nothing, and each twin parameter
        is then replaced by the real one of the same name; an optimizer keeps parameters in
        its ``param_groups`` only until its first step."""
        twin = build_model(self.recipe, self.device, empty=True)
        real = dict(model.named_parameters())
        names = {id(p): name for name, p in twin.named_parameters()}
        if set(real) != set(names.values()):  # a plugin added or renamed parameters
            raise RecipeError(
                [
                    "parallel.sharded_init: the transformed model's parameters are not the architecture's "
                    f"(e.g. {sorted(set(real) ^ set(names.values()))[:2]}); set parallel.sharded_init=false"
                ]
            )
        optimizer = make_optimizer(twin, self.param_device)
        for group in optimizer.param_groups:
            group["params"] = [real[names[id(p)]] for p in group["params"]]
        return optimizer

    @classmethod
    def read_weights(cls, checkpoint, model):
        """The fp32 master weights of a ZeRO checkpoint, gathered from its partitions in one
        process by DeepSpeed's own ``zero_to_fp32``, which unpickles in full: only after
        `check_deepspeed_files` found nothing but plain data in them."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        check_deepspeed_files(checkpoint.path, checkpoint.path / cls._TAG)
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.path), tag=cls._TAG)

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
        # DeepSpeed unpickles its files in full: only files that name nothing but plain data go to it.
        check_deepspeed_files(checkpoint.path, checkpoint.path / self._TAG)
        loaded, _ = self.engine.load_checkpoint(
            str(checkpoint.path), tag=self._TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise RecipeError(
                [f"checkpoint.resume: DeepSpeed found no checkpoint under {checkpoint.path / self._TAG}"]
            )
