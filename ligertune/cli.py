"""The `ligertune` command line: a thin Typer shell over the modules that do the work.

Every command that reads a recipe validates it first; recipe problems print one line each
(no traceback) and exit with status 2.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from enum import Enum
from pathlib import Path

import typer
from rich.markup import escape

from ligertune import __version__
from ligertune.config import load_recipe, recipe_to_yaml, shipped_recipes
from ligertune.config.loading import resolve_recipe_path
from ligertune.config.rules import model_problems
from ligertune.errors import RecipeError
from ligertune.run.loggers import configure_logging, make_console

app = typer.Typer(
    name="ligertune",
    help="Fine-tune LLMs from YAML recipes with fused Triton kernels.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
recipes_app = typer.Typer(invoke_without_command=True)
app.add_typer(recipes_app, name="recipes")

# Wide when the output is not a terminal (a pipe, a log): rich would wrap and cut at 80 columns.
console = make_console()
err_console = make_console(stderr=True)
# --quiet / --verbose, as the global options set it; `train` reapplies it on ranks other than 0.
verbosity = "normal"


def _print_version(value: bool) -> None:
    if value:
        console.print(f"ligertune {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def global_options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
    quiet: bool = typer.Option(
        False,
        "--quiet",
        "-q",
        envvar="LIGERTUNE_QUIET",
        help="Warnings, errors and the final summary only (train.log still gets everything).",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", envvar="LIGERTUNE_VERBOSE", help="Also the debug lines."
    ),
) -> None:
    global verbosity
    if quiet and verbose:
        _print_error("--quiet and --verbose contradict each other; give one")
        raise typer.Exit(2)
    verbosity = "quiet" if quiet else "verbose" if verbose else "normal"
    configure_logging(verbosity, console)
    # Processes started from here (torchrun's ranks run `ligertune train`) inherit the choice.
    if quiet:
        os.environ["LIGERTUNE_QUIET"] = "1"
    if verbose:
        os.environ["LIGERTUNE_VERBOSE"] = "1"


def fail(error: RecipeError, who: str = "") -> None:
    """Print a recipe error (`who`: the rank that hit it, in a multi-process run) and exit 2."""
    source = escape(error.source + ": ") if error.source else ""
    err_console.print(f"[bold red]error:[/] {escape(who)}{source}invalid recipe", soft_wrap=True)
    for problem in error.problems:
        err_console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


class Format(str, Enum):
    """How `validate` prints a resolved recipe (a choice, so a typo is an error, not silence)."""

    table = "table"
    yaml = "yaml"
    none = "none"


def _print_error(message: str) -> None:
    """One error line, never wrapped (a path stays whole) and never read as markup."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _print_problems(header: str, problems: list[str]) -> None:
    err_console.print(f"[bold red]✗[/] {escape(header)}", highlight=False, soft_wrap=True)
    for problem in problems:
        err_console.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def validate(
    recipes: list[str] = typer.Argument(
        ..., help="Recipe files, optionally followed by key=value overrides."
    ),
    fmt: Format = typer.Option(
        Format.table, "--format", "-f", help="How to print the resolved recipe: table, yaml or none."
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Also build the model and compare it patched vs unpatched on one random batch "
        "(loss, logits, every gradient). Shrink big models with model.config_overrides.",
    ),
) -> None:
    """Validate recipes and print each one fully resolved (defaults filled in).

    With --check, also run the kernel parity self-check on the recipe's model; exit status 1 when
    it fails.

    [bold]Examples[/]

      ligertune validate recipes/quickstart.yaml

      ligertune validate recipes/llama3-8b-alpaca.yaml training.lr=1e-5 kernels.rope=false -f yaml

      ligertune validate recipes/llama3-8b-alpaca.yaml --check -f none model.config_overrides.num_hidden_layers=2
    """
    files = [p for p in recipes if "=" not in p]
    overrides = [p for p in recipes if "=" in p]
    if not files:
        _print_error(
            "name a recipe file before the key=value overrides, "
            "e.g. ligertune validate recipes/quickstart.yaml training.lr=1e-4"
        )
        raise typer.Exit(2)
    failed = parity_failed = False
    for file in files:
        try:
            recipe = load_recipe(file, overrides)
        except RecipeError as e:
            failed = True
            _print_problems(file, e.problems)
            continue
        # Everything train refuses before building the model, validate refuses too.
        problems = model_problems(recipe)
        if problems:
            failed = True
            _print_problems(file, problems)
            continue
        if fmt is Format.yaml:
            console.print(recipe_to_yaml(recipe), markup=False, highlight=False)
        elif fmt is Format.table:
            _print_recipe_table(file, recipe)
        console.print(f"[green]✓[/] {escape(file)}", highlight=False, soft_wrap=True)
        if check:
            from ligertune.tools.check import check_recipe

            try:
                result = check_recipe(recipe)
            except RecipeError as e:
                failed = True
                _print_problems(f"{file} (--check)", e.problems)
                continue
            console.print(str(result.report), markup=False, highlight=False, soft_wrap=True)
            console.print(str(result), markup=False, highlight=False, soft_wrap=True)
            parity_failed |= not result.ok
    if failed:
        raise typer.Exit(2)
    if parity_failed:
        raise typer.Exit(1)


def _print_recipe_table(title: str, recipe) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("key")
    table.add_column("value", overflow="fold")

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            table.add_row(prefix, repr(value) if isinstance(value, str) else str(value))

    walk("", recipe.model_dump(mode="json"))
    console.print(table)


@recipes_app.callback()
def recipes_list(ctx: typer.Context) -> None:
    """List the shipped recipes with their one-line descriptions.

    [bold]Examples[/]

      ligertune recipes

      ligertune recipes cp llama3-8b-alpaca my-run.yaml
    """
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("recipe")
    table.add_column("description")
    for name, path in shipped_recipes().items():
        try:
            description = escape(load_recipe(path).description)
        except RecipeError as e:
            extras = _missing_extras(e.problems)
            if extras:
                needs = ", ".join(f"the {x} extra: pip install 'ligertune[{x}]'" for x in extras)
                description = f"{escape(_raw_description(path))} [yellow]{escape('(needs ' + needs + ')')}[/]"
            else:
                description = f"[red]invalid: {escape(e.problems[0])}[/]"
        table.add_row(escape(name), description)
    console.print(table)


# "install it with: pip install 'ligertune[deepspeed]'" in a packages.installed problem.
_EXTRA_HINT = re.compile(r"not installed; install it with: pip install 'ligertune\[([\w-]+)\]'")


def _missing_extras(problems: list[str]) -> list[str]:
    """The extras that would make a recipe valid, when a missing extra is its only problem (a
    deepspeed recipe on a machine without deepspeed is fine, not broken); else []."""
    extras = [m.group(1) if (m := _EXTRA_HINT.search(p)) else None for p in problems]
    return [] if None in extras else list(dict.fromkeys(extras))


def _raw_description(path: Path) -> str:
    """The description as written, for a recipe that does not validate here."""
    from ligertune.config.loading import load_yaml

    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except Exception:
        return ""
    return str(raw.get("description", "")) if isinstance(raw, dict) else ""


@recipes_app.command("cp")
def recipes_cp(
    name: str = typer.Argument(..., help="Shipped recipe name (see `ligertune recipes`)."),
    dest: Path = typer.Argument(..., help="Where to write the copy."),
) -> None:
    """Copy a shipped recipe to edit.

    [bold]Example[/]

      ligertune recipes cp quickstart my-recipe.yaml
    """
    available = shipped_recipes()
    source = available.get(name.removesuffix(".yaml"))
    if source is None:
        import difflib

        close = difflib.get_close_matches(name, list(available), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        _print_error(f"no shipped recipe named {name!r}{hint}")
        raise typer.Exit(2)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists():
        _print_error(f"{dest} exists; not overwriting it")
        raise typer.Exit(2)
    if not dest.parent.is_dir():
        what = "is a file" if dest.parent.exists() else "does not exist"
        _print_error(f"cannot write {dest}: the folder {dest.parent} {what}; create the folder first")
        raise typer.Exit(2)
    try:
        shutil.copyfile(source, dest)
    except OSError as e:
        _print_error(f"cannot write {dest}: {e.strerror}")
        raise typer.Exit(2) from None
    console.print(f"wrote {dest}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def env() -> None:
    """Versions of the stack, the GPUs seen, and how the kernels will run.

    [bold]Example[/]

      ligertune env
    """
    from rich.table import Table

    from ligertune.tools.env import describe_environment

    table = Table(show_header=False)
    for key, value in describe_environment().items():
        table.add_row(key, str(value))
    console.print(table)


@app.command()
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
    from rich.markup import escape

    from ligertune.distributed.env import launched_as, rank_label
    from ligertune.distributed.launch import LaunchError, LaunchOptions, check_options, launch, record_errors
    from ligertune.errors import DataError, TrainingError
    from ligertune.training import train as run_training

    recipe = resolve_recipe_path(recipe)
    options = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    if options.requested:
        try:
            check_options(options, load_recipe(recipe, overrides or []))
        except RecipeError as e:
            fail(e)
        except LaunchError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        raise typer.Exit(launch(recipe, overrides or [], options))

    who = rank_label()  # "rank 1/4: " under torchrun, so every rank's error names it
    if who:  # one copy of each line: the other ranks show warnings and errors only
        configure_logging(verbosity, console, main=launched_as().rank == 0)
    try:
        result = record_errors(run_training)(load_recipe(recipe, overrides or []))
    except RecipeError as e:
        fail(e, who)
    except DataError as e:
        err_console.print(f"[bold red]error:[/] {who}{escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except TrainingError as e:
        err_console.print(f"[bold red]error:[/] {who}{escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if result.signal is not None:
        raise typer.Exit(128 + result.signal)


@app.command()
def preprocess(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(
        None, help="key=value overrides, e.g. data.max_seq_len=4096."
    ),
) -> None:
    """Tokenise the recipe's data into the cache ahead of training, and say where it is.

    Runs of the same data, tokenizer and data settings (resumes, every arm of a compare, other
    ranks) then load the cache instead of tokenising. Exit status: 0 done, 2 bad recipe or data.

    [bold]Example[/]

      ligertune preprocess recipes/llama3-8b-alpaca.yaml data.max_seq_len=4096
    """
    from ligertune.data import cache_entry, load_tokenizer
    from ligertune.errors import DataError

    try:
        loaded = load_recipe(recipe, overrides or [])
        if loaded.data.streaming:
            _print_error(
                "data.streaming: streamed data is tokenised while training; there is nothing to preprocess"
            )
            raise typer.Exit(2)
        if not loaded.data.cache:
            _print_error("data.cache is false: set it to true (the default) to keep the tokenised samples")
            raise typer.Exit(2)
        directory, existed = cache_entry(loaded, load_tokenizer(loaded), log=_print_line)
    except RecipeError as e:
        fail(e)
    except DataError as e:
        _print_error(str(e))
        raise typer.Exit(2) from None
    _print_line(f"{'already cached' if existed else 'cached'}: {directory}")


def _print_line(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command()
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
    from rich.markup import escape

    from ligertune.tools.bench import BenchError, BenchOptions, run_command

    opts = BenchOptions(
        kernels, providers, dtype, shape, passes, out, quick, warmup, rep, time_budget, from_json
    )
    try:
        run_command(opts, console)
    except BenchError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
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
    from rich.markup import escape

    from ligertune.tools.compare import CompareError, compare_command

    try:
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
    except RecipeError as e:
        fail(e)
    except CompareError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if status:
        raise typer.Exit(status)


@app.command()
def generate(
    run_or_model: str = typer.Argument(..., help="Run directory, Hugging Face model directory, or hub id."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt to complete."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(
        0.0, "--temperature", "-t", help="0: greedy (reproducible); > 0: sampling."
    ),
    chat: bool = typer.Option(
        True,
        "--chat/--no-chat",
        help="Send the prompt through the tokenizer's chat template (when it has one).",
    ),
) -> None:
    """Complete a prompt with a trained model: a quick sanity check of a run.

    A run directory uses its final/ export, or without one its newest checkpoint (the model rebuilt
    from the checkpoint's recipe). Runs on the GPU when there is one, else on the CPU. Prints the
    completion only. Exit status 2 when the model cannot be found or loaded.

    [bold]Examples[/]

      ligertune generate runs/quickstart --prompt "Give three tips for staying healthy."

      ligertune generate runs/quickstart/final --prompt "Once upon a time" --no-chat -n 40

      ligertune generate meta-llama/Llama-3.2-1B-Instruct --prompt "Hi" --temperature 0.7
    """
    from ligertune.tools.generate import GenerateError
    from ligertune.tools.generate import generate as run_generate

    try:
        result = run_generate(
            run_or_model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, chat=chat
        )
    except GenerateError as e:
        _print_error(str(e))
        raise typer.Exit(2) from None
    how = "chat template" if result.chat else "plain prompt"
    err_console.print(
        f"[dim]{escape(result.source.describe())} on {result.device}, {how}[/]",
        highlight=False,
        soft_wrap=True,
    )
    console.print(result.completion, markup=False, highlight=False, soft_wrap=True)


@app.command()
def download(
    recipe: Path = typer.Argument(..., help="Recipe file."),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides, e.g. model.revision=main."),
) -> None:
    """Download what a recipe takes from the Hugging Face Hub into the HF cache: the model (weights,
    config, tokenizer), a separate tokenizer, hub datasets. Then `train` runs without network
    (HF_HUB_OFFLINE=1). Prints where each went.

    Exit status: 0 done (or nothing to download), 1 a download failed (offline, no access, no such
    repository), 2 bad recipe.

    [bold]Example[/]

      ligertune download recipes/llama3-8b-alpaca.yaml
    """
    from ligertune.tools.hub import HubError
    from ligertune.tools.hub import download as run_download

    loaded = load_recipe(recipe, overrides or [])
    try:
        done = run_download(loaded, report=_print_line)
    except HubError as e:
        _print_error(str(e))
        raise typer.Exit(1) from None
    if not done:
        console.print(
            "nothing to download: the recipe's model, tokenizer and data are local", highlight=False
        )


def main() -> None:
    try:
        app()
    except RecipeError as e:
        fail(e)


if __name__ == "__main__":
    sys.exit(main())
