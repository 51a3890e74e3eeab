"""Selective activation checkpointing of decoder-layer sub-modules
(``training.activation_checkpointing: selective`` with ``activation_checkpointing_modules``).

Whole-layer checkpointing (``full``, and ``selective`` without modules) is transformers' own
``gradient_checkpointing_enable``: a chosen layer keeps its input only and runs its whole forward
again in backward. With modules, a chosen layer (layers 0, k, 2k, ... for
``activation_checkpointing_every: k``) keeps everything but what the named sub-module saves: the
sub-module's forward runs under ``torch.utils.checkpoint`` (non-reentrant), which keeps the
sub-module's inputs and recomputes its forward when backward first needs one of its tensors.
``[attention]`` drops q, k, v, the attention output and its log-sum-exp, and the projections'
copy of the normed input, for a second run of the q/k/v/o projections and the attention kernel;
``[mlp]`` drops gate, up, the activation and the product (three projections recomputed).
`ligertune.plan.estimate` counts both.

How it is wired, and why:

- The sub-module's ``forward`` is replaced on the instance, after the kernels' patches (which
  set instance forwards too): the recompute runs the patched forward, our norm/RoPE/SwiGLU
  custom ops included. peft's LoRA layers inside are called as modules, so adapters are
  recomputed with the projections they wrap. Hooks on the sub-module itself run once, outside
  the checkpoint.
- Every tensor argument reaches ``checkpoint`` positionally (the call's arguments flattened with
  torch's pytree). transformers calls attention with keywords only, and checkpoint treats
  keyword arguments as opaque: it would keep their tensors alive by reference, out of reach of
  ``saved_tensors_hooks`` (so activation offload could not move them, nor a measurement see
  them), and infer the device whose RNG state it restores from positional tensors alone.
- Non-reentrant checkpointing works with inputs that need no grad (a LoRA run's hidden states),
  with keyword arguments, and under torch.compile, which traces it as one higher-order op: a
  compiled layer stays one graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from ligertune.errors import RecipeError

# Recipe name → the decoder-layer attributes that may hold it, the same in every family we patch
# (transformers 5.17: Llama, Mistral, Qwen2, Qwen3, Gemma 1-3, Phi3 decoder layers; Mllama's
# cross-attention layers hold their attention as ``cross_attn``): a layer's first one present.
SUBMODULE_ATTRIBUTES = {"attention": ("self_attn", "cross_attn"), "mlp": ("mlp",)}


def checkpointed_forward(forward: Callable) -> Callable:
    """`forward` run under non-reentrant ``torch.utils.checkpoint``, its tensors passed positionally."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing saved, nothing to recompute (evaluation, generation)
            return forward(*args, **kwargs)
        if kwargs.get("past_key_values") is not None:
            # The recompute would append to the KV cache a second time. Training runs without one
            # (`build_model` turns use_cache off); a cache passed anyway is dropped, as
            # transformers' own checkpointed layers drop it.
            kwargs["past_key_values"] = None
        leaves, spec = tree_flatten((args, kwargs))

        def run(*flat):
            call_args, call_kwargs = tree_unflatten(list(flat), spec)
            return forward(*call_args, **call_kwargs)

        return checkpoint(run, *leaves, use_reentrant=False)

    return wrapped


def checkpoint_submodules(layers: list[nn.Module], modules: list[str], every: int) -> int:
    """Recompute the named sub-modules of layers 0, `every`, 2·`every`, ... in backward; returns
    how many layers. RecipeError when a layer has no such sub-module."""
    chosen = layers[::every]
    for layer in chosen:
        for name in modules:
            attributes = SUBMODULE_ATTRIBUTES[name]
            submodule = next((getattr(layer, a) for a in attributes if hasattr(layer, a)), None)
            if not isinstance(submodule, nn.Module):
                raise RecipeError(
                    [
                        f"training.activation_checkpointing_modules: {type(layer).__name__} has no "
                        f"{' or '.join(attributes)} "
                        f"(its {name}); leave the modules empty to checkpoint whole layers"
                    ]
                )
            submodule.forward = checkpointed_forward(submodule.forward)
    return len(chosen)
