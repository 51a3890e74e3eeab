"""Commands that run a recipe: `train`, `plan`, `preprocess`, `bench` and `compare`."""

from __future__ import annotations

from pathlib import Path

import typer

from ligertune.cli import common
from ligertune.cli.common import command, console, print_line, usage
from ligertune.config import load_recipe
from ligertune.config.loading import resolve_recipe_path
from ligertune.config.rules import model_problems
from ligertune.errors import RecipeError
from ligertune.run.loggers import configure_logging


@command()
def train(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides, e.g. training.lr=1e-4."),
    nproc_per_node: int | None = typer.Option(
        None,
        "--nproc-per-node",
        help="Processes (one per GPU) on this node: launch the run through torchrun.",
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes of the job; run the same command on each."),
    node_rank: int | None = typer.Option(
        None, "--node-rank", help="This node's rank (static rendezvous; node 0 runs on the endpoint's host)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT every node reaches, for the rendezvous of several nodes."
    ),
) -> None:
    """Fine-tune a model as the recipe says: checkpoints, metrics and the export go to its output_dir.

    With --nproc-per-node (and --nnodes/--node-rank/--rdzv-endpoint for several nodes) the run is
    launched through torchrun, one process per GPU; the recipe's parallel.strategy (ddp, fsdp,
    deepspeed) says how they share the work. See docs/distributed.md.

    Exit status: 0 done, 1 training failed (e.g. non-finite loss; or any rank failed, under
    torchrun), 2 bad recipe or data, 128 + signal number after SIGTERM/SIGINT (a checkpoint was
    saved; rerun to resume).

    [bold]Examples[/]

      ligertune train recipes/quickstart.yaml

      ligertune train recipes/quickstart.yaml training.max_steps=20 output_dir=runs/try

      ligertune train recipes/llama3-8b-alpaca.yaml --nproc-per-node 4 parallel.strategy=fsdp

      ligertune train my.yaml --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29500
    """

    from ligertune.distributed.env import launched_as
    from ligertune.distributed.launch import LaunchOptions, check_options, launch, record_errors
    from ligertune.training import train as run_training

    recipe = resolve_recipe_path(recipe)
    options = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    if options.requested:
        check_options(options, load_recipe(recipe, overrides or []))
        raise typer.Exit(launch(recipe, overrides or [], options))

    launched = launched_as()
    if launched.multi_process:  # one copy of each line: the other ranks show warnings and errors only
        configure_logging(common.verbosity, console, main=launched.rank == 0)
    result = record_errors(run_training)(load_recipe(recipe, overrides or []))
    if result.signal is not None:
        raise typer.Exit(128 + result.signal)


@command()
def plan(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value overrides, e.g. training.micro_batch_size=8."
    ),
    nproc_per_node: int | None = typer.Option(
        None,
        "--nproc-per-node",
        "--world-size",
        help="GPUs the run uses on each host (default 1, or the strategy's 2).",
    ),
    nnodes: int = typer.Option(
        1,
        "--nnodes",
        min=1,
        help="Hosts the run spreads over, --nproc-per-node GPUs each (as train takes it).",
    ),
    gpu_memory: str | None = typer.Option(
        None,
        "--gpu-memory",
        help="Memory of one GPU, e.g. 80GiB (default: the visible GPU's; without one, 80GiB).",
    ),
    host_memory: str | None = typer.Option(
        None,
        "--host-memory",
        help="Memory of the host the ranks share, e.g. 512GiB, for a CPU offload's states (default: this machine's).",
    ),
) -> None:
    """Will the recipe fit? Per-GPU memory breakdown and the settings that fit, without a GPU.

    Builds the model empty (meta device), counts weights, gradients, optimizer state,
    activations per layer and the loss head (with and without our kernels) and the strategy's
    buffers, then tables micro-batch × activation checkpointing × offload, fastest first, each
    marked fits / does not fit. With a CPU offload (parallel.fsdp.cpu_offload, DeepSpeed's
    offload_optimizer/offload_params) it also checks the offloaded states against the host's
    memory. Exit status: 0 something fits, 2 nothing fits (the cheapest fix is printed), the
    offloaded states do not fit the host, or a bad recipe.

    [bold]Examples[/]

      ligertune plan recipes/llama3.2-1b-alpaca-bench.yaml --gpu-memory 80GiB

      ligertune plan recipes/llama3-8b-alpaca-bench.yaml --nproc-per-node 4 --gpu-memory 80GiB

      ligertune plan recipes/llama3-70b-alpaca-lora.yaml --nnodes 2 --nproc-per-node 8 --host-memory 1TiB
    """
    from ligertune.tools.plan import gpu_bytes, host_bytes
    from ligertune.tools.plan import plan as run_plan

    loaded = load_recipe(resolve_recipe_path(recipe), overrides or [])
    problems = model_problems(loaded)
    if problems:
        raise RecipeError(problems)
    per_host = nproc_per_node or (2 if loaded.parallel.multi_process else 1)
    world = per_host * nnodes
    shards = loaded.parallel.context_parallel
    if world % shards:
        raise RecipeError(
            [
                f"parallel.context_parallel: {shards} does not divide the run's {world} GPUs; plan for a "
                f"multiple of {shards} GPUs"
            ]
        )
    budget, target = gpu_bytes(gpu_memory)
    result = run_plan(loaded, world, budget, console, target, host_bytes(host_memory), per_host)
    if not (result.fits and result.host_fits):
        raise typer.Exit(2)


@command()
def preprocess(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value overrides, e.g. data.max_seq_len=4096."
    ),
) -> None:
    """Tokenise the recipe's data (and process its images, for a vision-language model) into the
    cache ahead of training, and say where it is.

    Runs of the same data, tokenizer and data settings (resumes, every arm of a compare, other
    ranks) then load the cache instead of tokenising. Exit status: 0 done, 2 bad recipe or data.

    [bold]Example[/]

      ligertune preprocess recipes/llama3-8b-alpaca.yaml data.max_seq_len=4096
    """
    from ligertune.data import cache_entry, load_tokenizer

    loaded = load_recipe(recipe, overrides or [])
    if loaded.data.streaming:
        raise usage(
            "data.streaming: streamed data is tokenised while training; there is nothing to preprocess"
        )
    if not loaded.data.cache:
        raise usage("data.cache is false: set it to true (the default) to keep the tokenised samples")
    from ligertune.models.build import tokens_per_image, vision_tower

    vision = vision_tower(loaded)
    if vision is None:
        directory, existed = cache_entry(loaded, load_tokenizer(loaded), log=print_line)
    else:  # images through the model's image processor (ligertune.data.vision)
        from ligertune.data.vision import load_processor, vision_cache_entry
        from ligertune.models.config import build_config

        fixed = tokens_per_image(build_config(loaded), vision)
        processor = load_processor(loaded, vision, load_tokenizer(loaded), fixed)
        directory, existed = vision_cache_entry(loaded, processor, log=print_line)
    print_line(f"{'already cached' if existed else 'cached'}: {directory}")


@command()
def bench(
    kernels: str = typer.Option(
        "all", "--kernels", "-k", help="Comma list of kernels (the recipe names, plus add_rms_norm), or all."
    ),
    providers: str = typer.Option(
        "", "--providers", "-p", help="eager,compile,liger,ligertune [GPU: all; CPU: eager,ligertune]"
    ),
    dtype: str = typer.Option("", "--dtype", help="bf16, fp16 or fp32 [GPU: bf16; CPU: fp32]"),
    shape: list[str] = typer.Option(
        [], "--shape", help="KERNEL=AxB[,AxB...] replaces that kernel's shapes; repeatable."
    ),
    passes: str = typer.Option("fwd,bwd,full", "--pass", help="fwd, bwd, full (forward + backward)"),
    out: Path = typer.Option(
        Path("bench-out"), "--out", "-o", help="Folder for bench.json/.csv/.md and the plots."
    ),
    quick: bool = typer.Option(False, "--quick", help="One headline shape per kernel, shorter timing."),
    warmup: float | None = typer.Option(None, "--warmup", help="do_bench warm-up, ms [10; quick 5]"),
    rep: float | None = typer.Option(None, "--rep", help="do_bench repetition time, ms [50; quick 25]"),
    time_budget: float = typer.Option(
        0, "--time-budget", help="Seconds; later cases are reported 'skipped'. 0: none."
    ),
    from_json: Path | None = typer.Option(
        None, "--from-json", help="Re-render tables and plots from a bench.json."
    ),
) -> None:
    """Time and memory of each kernel: eager PyTorch/HF, torch.compile, Liger-Kernel and ligertune.

    Forward, backward and both, on the shapes listed in docs/benchmarks.md; JSON, CSV, Markdown and 3
    plots go to --out.

    Without a GPU it runs tiny shapes (timings labelled not meaningful) to check the path.

    [bold]Examples[/]

      ligertune bench --quick

      ligertune bench --kernels rms_norm,rope --pass full --out runs/bench

      ligertune bench -k fused_linear_cross_entropy -p eager,ligertune \
        --shape fused_linear_cross_entropy=8192x4096x32000,8192x4096x128256

      ligertune bench --from-json runs/bench/bench.json --out runs/bench
    """

    from ligertune.tools.bench import BenchOptions, run_command

    run_command(
        BenchOptions(
            kernels, providers, dtype, shape, passes, out, quick, warmup, rep, time_budget, from_json
        ),
        console,
    )


@command()
def compare(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides applied to every arm."),
    steps: int = typer.Option(20, "--steps", "-n", help="Optimizer steps per arm."),
    kernels: str | None = typer.Option(
        None,
        "--kernels",
        "-k",
        help="Comma list of kernels for the 'on' arm, or all (default: the recipe's, all if it enables none).",
    ),
    ablate: bool = typer.Option(False, "--ablate", help="Also one arm per kernel, with only that kernel on."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: <run_dir>-compare)."),
    nproc_per_node: int | None = typer.Option(
        None,
        "--nproc-per-node",
        help="Processes (GPUs) per arm, launched with torchrun (default 1; under torchrun, its count).",
    ),
    rtol: float | None = typer.Option(
        None, "--rtol", help="Per-step relative loss tolerance (default: fp32 1e-4, bf16 2e-2)."
    ),
    also: list[str] = typer.Option(
        [],
        "--also",
        help="One more arm: the 'on' arm plus this key=value override (e.g. training.compile=true); repeatable.",
    ),
) -> None:
    """Run the recipe with kernels off and on (same seed, weights and data): speed, memory, loss parity.

    Each arm runs in its own process; writes compare.json, compare.md and compare.png into --out
    and prints a table. Exit status: 0 parity (or an arm out of memory), 1 the losses diverged or
    an arm failed, 2 bad recipe or options. See docs/compare.md.

    [bold]Examples[/]

      ligertune compare recipes/quickstart.yaml --steps 10

      ligertune compare recipes/llama3.2-1b-alpaca-bench.yaml --kernels rms_norm,rope,swiglu --ablate

      ligertune compare recipes/llama3.2-1b-alpaca-bench.yaml --also training.compile=true --also model.attn_implementation=sdpa

      ligertune compare recipes/llama3-8b-alpaca-bench.yaml --nproc-per-node 4 parallel.strategy=fsdp
    """

    from ligertune.tools.compare import compare_command

    status = compare_command(
        resolve_recipe_path(recipe),
        overrides or [],
        console,
        steps=steps,
        kernels=kernels,
        ablate=ablate,
        out=out,
        nproc_per_node=nproc_per_node,
        rtol=rtol,
        also=also,
    )
    if status:
        raise typer.Exit(status)
