"""The decoder MLP run over the tokens in tiles, recomputed tile by tile in backward
(``training.tiled_mlp``).

Why. A gated MLP ``down(act(gate(x)) · up(x))`` keeps ``[tokens × intermediate]`` tensors for its
backward: gate and up (and act(gate) without our swiglu/geglu kernel) and the product that
down_proj saves, 3-4 of them at ``intermediate`` ≈ 3.5 × hidden. At 100k+ tokens a layer (under
context parallelism, a rank's S/N of them) these are the largest activations of the layer, and
with full checkpointing they are what the recomputed layer holds at the start of its backward.
The MLP treats every token on its own, so it can run on T tokens at a time.

How. `TiledMLP`, an autograd Function, takes the MLP's input ``x`` (flattened to
``[tokens, hidden]``) and the MLP's trainable parameters. Its forward runs the MLP's own
forward (the patched one with our kernels, LoRA layers included: whatever ``mlp.forward`` was)
on tiles of T tokens without building a graph and writes each tile's output into one
``[tokens, hidden]`` tensor; it keeps only ``x``. Its backward, for each tile in turn: runs that
tile's forward again with grad enabled, ``torch.autograd.grad`` of it against the tile's output
gradient for the tile's input and the parameters, writes the input gradient into its rows and
adds the parameters' gradients into one sum per parameter. The sums are returned as the
parameters' gradients, so autograd accumulates them into ``.grad`` once per backward, as for any
other use of the weights (DDP's reducer and FSDP2's reduce-scatter, which hook that
accumulation, see one gradient per parameter). The peak of the MLP's own tensors is then
``[T × intermediate]`` (one tile's saved tensors and gradients) instead of ``[S × intermediate]``.

The math is exact: the tiles partition the tokens, each output row depends on its own input
row, and the weight gradient ``Σ_tokens`` splits into a sum over tiles (fp32 sums in a
different order: equal up to rounding).

Cost: one more forward of every MLP per layer in backward (2 FLOPs per MLP weight and token on
top of 6: ~27% more matmul work in a Llama-3-8B layer, whose MLP holds 81% of its weights; a
smaller share of the step at long rows, where attention's S² work dominates), and a few smaller
matmuls instead of one large one (T ≥ a few thousand tokens keeps them efficient). Under full activation checkpointing the layer's
forward runs twice already; the tiled MLP adds its third forward, as without checkpointing it
adds a second: tiling never gets the extra forward for free, it trades it for memory.

What goes with it:

- RNG: the random state is taken at the start of the forward and restored (in a forked RNG) for
  the backward's tiles, which run in the same order, so dropout inside the MLP (peft's
  ``lora_dropout``) draws the forward's masks again. They are drawn tile by tile, so they are
  not the masks the untiled MLP would have drawn (a valid dropout all the same).
- Autocast: the forward's autocast state is restored for the backward's tiles.
- Activation checkpointing: under whole-layer checkpointing the layer's recompute runs the
  Function's forward again (tiled, keeping ``x``), then its backward recomputes each tile once:
  no tile is recomputed twice, and the recompute's MLP peak is a tile's. Checkpointing the mlp
  sub-module as well is refused (it would only add a forward: the tiled MLP keeps its input alone).
- FSDP2: the decoder layer is the unit; its weights are gathered in the layer's forward and
  again before its backward, so the MLP's parameters, taken from the module at each call, are
  the gathered ones, and the forward called inside this backward uses them; their gradients go
  to the gathered parameters before the layer's reduce-scatter (tests/test_tiled_mlp.py runs two
  gloo ranks against one process).
- Without grad (evaluation, generation) the tiles run as plain forwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ligertune.catalog.families import FAMILIES
from ligertune.errors import RecipeError
from ligertune.models.build import decoder_layers

KEY = "training.tiled_mlp"
GATED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def tile_tokens(setting: bool | int, hidden: int) -> int:
    """Tokens per tile for the recipe's value: the integer it gives, or for ``true`` the hidden
    size (a tile's ``[T × intermediate]`` tensors are then each the size of one MLP weight)."""
    return hidden if setting is True else int(setting)


def _tiled_forward(forward: Callable, flat: torch.Tensor, tile: int) -> torch.Tensor:
    """`forward` over `flat`'s rows tile by tile, the tiles' outputs written into one tensor."""
    out = None
    for start in range(0, flat.shape[0], tile):
        y = forward(flat[start : start + tile])
        if out is None:
            out = y.new_empty(flat.shape[0], y.shape[-1])
        out[start : start + tile] = y
    return out


class TiledMLP(torch.autograd.Function):
    """``forward(x)`` over the rows of ``x`` in tiles of ``tile``, keeping only ``x``; ``params``
    are the trainable parameters `forward` uses (the module docstring explains the backward)."""

    @staticmethod
    def forward(ctx, forward: Callable, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        ctx.forward, ctx.tile, ctx.params = forward, tile, params
        ctx.autocast = (
            device,
            torch.get_autocast_dtype(device),
            torch.is_autocast_enabled(device),
            torch.is_autocast_cache_enabled(),
        )
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if device == "cuda" else None)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        out = _tiled_forward(forward, flat, tile)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[2]
        wanted = [i for i, needed in enumerate(ctx.needs_input_grad[3:]) if needed]
        flat = x.reshape(-1, x.shape[-1]).detach()
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if needs_x else None
        sums: dict[int, torch.Tensor] = {}
        device, dtype, autocast, cache = ctx.autocast
        cpu_rng, device_rng = ctx.rng
        devices = [x.device] if device_rng is not None else []

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device))
            torch.set_rng_state(cpu_rng)
            if device_rng is not None:
                torch.cuda.set_rng_state(device_rng, x.device)
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=autocast, cache_enabled=cache))
            for start in range(0, flat.shape[0], ctx.tile):
                stop = min(start + ctx.tile, flat.shape[0])
                rows = flat[start:stop].detach().requires_grad_(needs_x)
                y = ctx.forward(rows)
                inputs = ([rows] if needs_x else []) + [ctx.params[i] for i in wanted]
                grads = torch.autograd.grad(y, inputs, grad_flat[start:stop], allow_unused=True)
                if needs_x:
                    grad_x[start:stop] = grads[0]
                    grads = grads[1:]
                for i, g in zip(wanted, grads, strict=True):
                    if g is not None:
                        sums[i] = g if i not in sums else sums[i].add_(g)
        grad_params = [sums.get(i) for i in range(len(ctx.params))]
        return None, None, grad_x.view_as(x) if needs_x else None, *grad_params


def tiled(module: nn.Module, setting: bool | int) -> Callable:
    """The module's current ``forward`` (the kernels' patched one, if any), tiled as the recipe's
    value `setting` says (`tile_tokens`)."""
    forward = module.forward

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        tile = tile_tokens(setting, x.shape[-1])
        if not torch.is_grad_enabled():
            flat = x.reshape(-1, x.shape[-1])
            out = _tiled_forward(forward, flat, tile)
            return out.view(*x.shape[:-1], out.shape[-1])
        # Taken at each call: under FSDP2 these are the gathered parameters of this forward.
        params = [p for p in module.parameters() if p.requires_grad]
        return TiledMLP.apply(forward, tile, x, *params)

    return tiled_forward


def install_tiled_mlp(model: nn.Module, setting: bool | int) -> str:
    """Tile the dense gated MLP of every decoder layer (the family table's MLP class, or for a
    family the table does not know an ``mlp`` with gate/up/down projections); a routed-experts
    block is left as it is (the router's outputs are per forward). RecipeError naming the key
    when no layer has one. Returns the run log's line."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    dense = family.resolve(family.mlp) if family is not None and family.mlp is not None else None
    layers = decoder_layers(model)
    count = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        if isinstance(mlp, dense) if dense is not None else all(hasattr(mlp, n) for n in GATED_PROJECTIONS):
            mlp.forward = tiled(mlp, setting)
            count += 1
    if not count:
        raise RecipeError(
            [
                f"{KEY}: {type(model).__name__} has no dense gated MLP in its decoder layers to tile; set it to false"
            ]
        )
    per_tile = "the hidden size in" if setting is True else setting
    return f"tiled MLP: {count} of {len(layers)} decoder layers, {per_tile} tokens per tile"
