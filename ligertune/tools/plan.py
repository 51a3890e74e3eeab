"""``ligertune plan``: will the recipe fit, and what is the fastest setting that does?

Builds the recipe's model empty (meta device: no GPU memory, no weights read), prints the per-GPU
breakdown of the recipe's own setting (`ligertune.plan.estimate` explains the model
and its assumptions), then a table over micro-batch size × activation checkpointing (none,
selective every 2nd layer or the recipe's own selective setting, selective attention in every
layer, full) × activation offload, each marked fits / does not fit on the
target GPU, fastest first by the estimate's throughput order. With a CPU offload it also
says what the offloaded states take of the host's memory. Exit status 2 when no setting
fits, with the cheapest change that would make it fit, or when the offloaded states do not
fit the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from ligertune.config import Recipe
from ligertune.errors import UsageError
from ligertune.models.shape import frozen_shape, recipe_shape
from ligertune.plan.choose import candidates, cheapest_fix, choose, gib, rank_choices
from ligertune.plan.estimate import estimate
from ligertune.plan.recipe import base_setting, micro_batch_choices, recipe_checkpointing
from ligertune.plan.setting import CHECKPOINTING, GIB, HEADROOM_FRACTION, Breakdown
from ligertune.plan.vision import assumption
from ligertune.run.metrics import count_label


@dataclass(frozen=True)
class PlanResult:
    fits: bool  # some setting fits
    recipe_fits: bool  # the recipe's own setting fits
    breakdown: Breakdown  # the recipe's own setting
    suggestion: str | None  # the cheapest fix when nothing fits
    host_fits: bool  # the offloaded states fit the host's memory (nothing offloaded: true)


# The target without a GPU to read it from: the 80 GB class (H100, A100-80GB) most fine-tunes
# are planned for. The header says it was assumed, and --gpu-memory changes it.
DEFAULT_GPU_MEMORY = "80GiB"


# The share of a host's memory the plan leaves to everything but the offloaded states: the
# operating system, the data loader's workers, CUDA's and NCCL's host-side buffers.
HOST_RESERVE_FRACTION = 0.10


def size_bytes(option: str, flag: str) -> int:
    """A size as the options take it (``80GiB``, ``80``, ``81920MiB``, ``80GB``, ``1TiB``; a bare
    number is GiB)."""
    text = option.strip().lower().replace(" ", "")
    suffix, scale = next(
        (
            (s, n)
            for s, n in (("tib", 2**40), ("gib", GIB), ("gb", 10**9), ("mib", 2**20), ("g", GIB))
            if text.endswith(s)
        ),
        ("", GIB),
    )
    try:
        return int(float(text.removesuffix(suffix)) * scale)
    except ValueError:
        raise UsageError(
            f"{flag} {option!r}: give a size such as 80GiB, 81920MiB, 80GB or a number of GiB"
        ) from None


def host_bytes(option: str | None) -> tuple[int, str]:
    """``--host-memory``, else this machine's physical memory; with where it came from."""
    if option:
        return size_bytes(option, "--host-memory"), "--host-memory"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical, "this machine's; --host-memory sets another"


def gpu_bytes(option: str | None) -> tuple[int, str]:
    """``--gpu-memory`` (a size as `size_bytes` reads it), else the visible CUDA device's memory,
    else (no GPU here, as on a laptop planning for a server) `DEFAULT_GPU_MEMORY`; with a note
    for the header saying where the target came from."""
    if option:
        return size_bytes(option, "--gpu-memory"), ""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f" ({torch.cuda.get_device_name(0)})"
    default, _ = gpu_bytes(DEFAULT_GPU_MEMORY)
    return default, " (no GPU here: the default target; --gpu-memory sets another)"


def _breakdown_table(b: Breakdown, budget: int) -> Table:
    table = Table(title=f"per-GPU memory: {b.setting.label()}", show_header=True)
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for group, items in (
        ("model states", b.states),
        ("activations", b.activations),
        ("temporaries", b.temporaries),
    ):
        table.add_row(f"[bold]{group}[/]", "")
        for name, n in items.items():
            table.add_row(f"  {name}", f"{n / GIB:.2f}")
    table.add_row("[bold]peak moments[/]", "")
    for name, n in b.moments.items():
        table.add_row(f"  {name}" + (" ← peak" if name == b.peak_moment else ""), f"{n / GIB:.2f}")
    table.add_row("allocator headroom kept free", f"{budget * HEADROOM_FRACTION / GIB:.2f}")
    table.add_row("[bold]predicted peak allocated[/]", f"[bold]{b.peak / GIB:.2f}[/]")
    return table


def _host_memory(
    shape, base, world_size: int, ranks_per_host: int, host: tuple[int, str], console: Console
) -> bool:
    """Print what a CPU offload keeps in host memory (nothing offloaded: prints nothing) against
    the host's memory less `HOST_RESERVE_FRACTION`; whether it fits. Each of a host's
    `ranks_per_host` ranks holds its own shards there. The policy's states only: a frozen
    reference's or teacher's offloaded shards are not added."""
    parts = base.parallel.memory_host(shape, base.precision, world_size)
    if not parts:
        return True
    rank = sum(parts.values())
    need, (capacity, where) = rank * ranks_per_host, host
    listed = ", ".join(f"{name} {gib(n)}" for name, n in parts.items())
    fits = need <= capacity * (1 - HOST_RESERVE_FRACTION)
    ranks = f"{ranks_per_host} rank{'s' if ranks_per_host > 1 else ''}"
    console.print(
        f"host memory (CPU offload): {listed}: {gib(rank)} a rank, {gib(need)} for the {ranks} "
        f"of one host, against {gib(capacity)} ({where}) less {HOST_RESERVE_FRACTION:.0%} kept for "
        "the rest: " + ("[green]fits[/]" if fits else "[bold red]does not fit[/]"),
        soft_wrap=True,
    )
    return fits


def plan(
    recipe: Recipe,
    world_size: int,
    budget: int,
    console: Console,
    target: str,
    host: tuple[int, str],
    ranks_per_host: int,
) -> PlanResult:
    """Print the breakdown and the table of choices; the result says what fits. `host` is the
    memory of one host and where that figure came from (`host_bytes`), which the offloaded
    states of its `ranks_per_host` ranks are checked against."""
    shape = recipe_shape(recipe)
    base = base_setting(recipe, world_size, frozen_shape(recipe))
    own = estimate(shape, base)
    what = (
        f"completions per prompt, ≤ {base.generated_tokens} generated" if base.generated_tokens else "pairs"
    )
    pairs = f", {base.rows_per_sample} per sample ({what})" if base.rows_per_sample > 1 else ""
    frozen = (
        f", a frozen {base.frozen_role} of {count_label(base.frozen.params)} parameters"
        if base.frozen
        else ""
    )
    active = (
        f", {count_label(shape.active_params)} active ({shape.top_k} of {shape.experts} experts per token)"
        if shape.experts
        else ""
    )
    adapters = ""
    if shape.lora_params:
        on_experts = (
            f", {count_label(shape.expert_lora_params)} of them on the routed experts"
            if shape.expert_lora_params
            else ""
        )
        adapters = (
            f", LoRA r={recipe.lora.r}: {count_label(shape.lora_params)} adapter parameters{on_experts}"
        )
    if shape.frozen_params and not shape.lora_params:
        adapters += (
            f", {count_label(shape.frozen_params)} frozen (model.freeze: {', '.join(recipe.model.freeze)})"
        )
    console.print(
        f"{recipe.name}: {count_label(shape.params)} parameters{active}{adapters} ({shape.layers} layers, hidden {shape.hidden}, "
        f"vocab {shape.vocab}){frozen}, {base.precision}, {base.parallel.strategy} × {world_size}, rows of "
        f"{base.seq_len} tokens{pairs}, kernels: {', '.join(sorted(base.kernels)) or 'none'}; target "
        f"{gib(budget)} per GPU{target}",
        soft_wrap=True,
    )
    images = assumption(shape, base)
    if images:
        console.print(images, soft_wrap=True)
    console.print(_breakdown_table(own, budget))
    host_fits = _host_memory(shape, base, world_size, ranks_per_host, host, console)
    off = estimate(shape, replace(base, kernels=frozenset()))
    console.print(
        f"the same without our kernels: {gib(off.peak)} (activations {gib(sum(off.activations.values()))}, "
        f"loss head {gib(off.temporaries['loss head at its peak'])})"
    )
    settings = candidates(base, micro_batch_choices(recipe, world_size), CHECKPOINTING)
    table = Table(title="choices, fastest first (relative speed is an order, not a prediction)")
    for column in ("micro-batch", "checkpointing", "offload", "peak GiB", "fits", "relative speed"):
        table.add_column(column, justify="right" if column != "checkpointing" else "left")
    for c in rank_choices(shape, settings):
        s, fits = c.setting, c.breakdown.fits(budget)
        table.add_row(
            str(s.micro_batch_size),
            s.checkpointing_label(),
            "yes" if s.offload else "",
            f"{c.breakdown.peak / GIB:.1f}",
            "[green]fits[/]" if fits else "[red]does not fit[/]",
            f"{c.speed:.2f}",
        )
    console.print(table)
    best = choose(shape, settings, budget)
    recipe_fits = own.fits(budget)
    if best is None:
        fix = cheapest_fix(shape, base, budget)
        console.print(
            f"[bold red]nothing fits {gib(budget)} per GPU[/]; the cheapest change that fits: {fix}"
        )
        return PlanResult(False, False, own, fix, host_fits)
    auto = "auto" in (recipe_checkpointing(recipe), recipe.training.micro_batch_size)
    console.print(
        f"fastest that fits: {best.setting.label()} (peak {gib(best.breakdown.peak)})"
        + ("; this is what auto picks" if auto else "")
        + ("" if recipe_fits else f"; [bold red]the recipe as written does not fit[/] ({gib(own.peak)})")
    )
    if not host_fits:
        console.print(
            "[bold red]the offloaded states do not fit the host's memory[/]: spread the ranks over more "
            "hosts (each holds only its own ranks' shards), or shard over more GPUs without the offload"
        )
    return PlanResult(True, recipe_fits, own, None, host_fits)
