"""DDP: every rank holds the whole model; gradients all-reduced in buckets during backward."""

from __future__ import annotations

import contextlib

from ligertune.catalog.strategies import DDPParallel
from ligertune.distributed.runtime import ProcessGroupRuntime


class DDPRuntime(ProcessGroupRuntime):
    """DistributedDataParallel: every rank holds the whole model, optimizer and gradients;
    backward all-reduces the gradients in buckets while it runs (skipped with ``no_sync`` for
    all micro-batches but the last of a window). The simplest and, when the model fits, the
    fastest strategy; it needs ~16 bytes per parameter per GPU with ``bf16-mixed`` AdamW, so an
    8B model does not fit a 141 GB GPU. Checkpoints are "full", like a single process's (rank
    0 writes them, every rank reads them), so none and ddp runs resume each other."""

    options_model = DDPParallel

    def wrap(self, model, make_optimizer, transforms):
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
