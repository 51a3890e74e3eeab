"""Where a run's lines and numbers go: the console, ``train.log``, and the experiment trackers.

Lines
    Everything ligertune says while it works goes through the standard `logging` logger named
    ``ligertune`` (`LOGGER`). The CLI installs one console handler on it (`configure_logging`):
    ``--quiet`` shows warnings and errors only, ``--verbose`` adds the debug lines. A run adds
    a file handler for ``train.log`` in its run directory (`open_train_log`), on rank 0 only,
    with a timestamp on every line and the debug lines always (the file is where one looks
    afterwards, so it keeps the detail the console may leave out). Lines logged before the run
    directory is known (recipe checks, model build) wait in a bounded buffer and are written at
    the top of ``train.log`` when it opens, so the file tells the whole run.

    This module imports rich and the standard library only: the CLI imports it for
    ``ligertune --help`` and must not pay for torch. Known third-party warnings that say
    nothing about the run are filtered here too (`ligertune.run.noise`; ``-v`` shows them).

Consoles
    rich assumes 80 columns when the output is not a terminal (a pipe, a log file, CI), and
    would wrap every error line and squeeze every table there. `make_console` gives such
    outputs a wide width instead (unless ``COLUMNS`` says otherwise); on a terminal rich reads
    the terminal's width as usual.

Metric loggers (``logging.loggers`` in a recipe)
    ``tensorboard``, ``wandb`` and ``mlflow``, each an optional extra
    (``pip install 'ligertune[wandb]'``). A recipe that selects one that is not installed is
    refused when it is read (the ``packages.installed`` rule), so a run never trains for hours
    without the tracker its owner looks at. Each sink receives the same numeric fields as
    ``metrics.jsonl``, as ``<event>/<key>`` at the record's step.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from ligertune.files import open_nofollow, write_new
from ligertune.run.noise import install_noise_filters

LOGGER = logging.getLogger("ligertune")

# Width for output that is not a terminal: wide enough for the compare table of an ablation and
# the bench table, so a log holds them as the terminal would.
WIDE = 200

# Records kept for train.log until it opens (a run logs a few dozen lines before that).
BUFFERED_RECORDS = 10_000

# Metric logger name → the module it needs and the extra that installs it.
METRIC_LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(message)s"


def make_console(stderr: bool = False, **kwargs: Any) -> Console:
    """A rich Console that does not cut or wrap at 80 columns when its output is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    columns = os.environ.get("COLUMNS", "")
    # Read here rather than left to rich, whose own look-up goes through a copy of the
    # environment mapping taken when rich was imported.
    width = None if is_tty else int(columns) if columns.isdigit() else WIDE
    return Console(stderr=stderr, width=width, **kwargs)


class ConsoleHandler(logging.Handler):
    """Prints each record's message through a rich Console, as plain text (a path with brackets
    is not markup) and on one line however long (soft wrap: a log file keeps whole lines).
    A record logged with ``extra={"console": False}`` is for train.log only (the summary table,
    which the run prints itself in its rich form)."""

    def __init__(self, console: Console, level: int = logging.INFO):
        super().__init__(level)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True) is False:
            return
        try:
            self.console.print(record.getMessage(), markup=False, highlight=False, soft_wrap=True)
        except Exception:
            self.handleError(record)


class _StartupBuffer(logging.Handler):
    """Keeps the records logged before train.log opens (bounded; the oldest are dropped)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if len(self.records) > BUFFERED_RECORDS:
            del self.records[0]


def _ours(handler_type: type) -> list[logging.Handler]:
    return [h for h in LOGGER.handlers if isinstance(h, handler_type)]


def configure_logging(verbosity: str = "normal", console: Console | None = None, main: bool = True) -> None:
    """Set up the ``ligertune`` logger for a CLI process.

    `verbosity`: ``quiet`` (warnings and errors), ``normal`` (info) or ``verbose`` (debug).
    `main`: whether this is rank 0; the other ranks of a multi-process run show warnings and
    errors only (every rank runs the same loop, and one copy of each line is enough) and write
    no train.log. Calling it again replaces the previous set-up."""
    for handler in _ours(ConsoleHandler) + _ours(_StartupBuffer):
        LOGGER.removeHandler(handler)
    level = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}[verbosity]
    LOGGER.setLevel(logging.DEBUG)  # handlers filter; train.log keeps the debug lines
    LOGGER.propagate = False  # our handlers print it; the root logger would print it twice
    LOGGER.addHandler(ConsoleHandler(console or make_console(), level if main else logging.WARNING))
    if main:
        LOGGER.addHandler(_StartupBuffer())
    install_noise_filters(LOGGER, verbose=verbosity == "verbose")


def console_handler() -> ConsoleHandler | None:
    """The console handler the CLI (or a MetricsLogger, for library use) installed, if any."""
    handlers = _ours(ConsoleHandler)
    return handlers[0] if handlers else None


class _TrainLog(logging.FileHandler):
    """train.log's handler. A full disk must not add a logging traceback to the run's one clear
    line about it (`ligertune.run.metrics` and the checkpoint save say "no space left on ..."):
    a record or the final flush that cannot be written is dropped. The file is opened without
    following a symbolic link (`ligertune.files`): a link named train.log is refused, not
    appended through."""

    def _open(self):  # logging's hook for opening the file
        fd = open_nofollow(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            pass


def open_train_log(run_dir: Path) -> logging.FileHandler:
    """Start appending the ``ligertune`` logger's records to ``run_dir/train.log`` (appended across
    resumes), first the records buffered since the process started. Returns the handler, for
    `close_train_log`."""
    handler = _TrainLog(run_dir / "train.log", mode="a", encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for buffer in _ours(_StartupBuffer):
        for record in buffer.records:
            handler.handle(record)
        LOGGER.removeHandler(buffer)
    if LOGGER.level == logging.NOTSET or LOGGER.level > logging.DEBUG:
        LOGGER.setLevel(logging.DEBUG)
    LOGGER.addHandler(handler)
    return handler


def close_train_log(handler: logging.Handler) -> None:
    LOGGER.removeHandler(handler)
    handler.close()


def render_text(renderable: Any, width: int = 100) -> str:
    """A rich renderable (a table) as plain text, for train.log."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, highlight=False).print(renderable)
    return buffer.getvalue().rstrip("\n")


# --------------------------------------------------------------------------------------------
# Metric loggers
# --------------------------------------------------------------------------------------------


def missing_metric_loggers(names: Iterable[str]) -> list[str]:
    """The selected metric loggers whose package is not installed."""
    import importlib.util

    return [n for n in names if importlib.util.find_spec(METRIC_LOGGERS[n][0]) is None]


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics record, without its step and time (bools are not numbers)."""
    return {
        key: value
        for key, value in record.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "time")
    }


class TensorBoardLogger:
    """Event files in ``run_dir/tensorboard``. A resumed run purges the events of the steps it
    replays (after its start step), as ``metrics.jsonl`` marks them superseded."""

    def __init__(
        self, run_dir: Path, options: Mapping[str, Any], config: Mapping[str, Any], start_step: int = 0
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, prefix: str, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run. Its id is kept in ``run_dir/wandb-run-id``, so a resumed run
    continues the same W&B run instead of starting a second one. ``WANDB_MODE=offline`` works as
    usual (the run syncs later with ``wandb sync``)."""

    def __init__(
        self, run_dir: Path, options: Mapping[str, Any], config: Mapping[str, Any], start_step: int = 0
    ):
        import wandb

        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        if not run_id:
            run_id = uuid.uuid4().hex[:12]  # wandb ids are short [a-z0-9] strings
            write_new(id_file, run_id + "\n")  # never through a link (ligertune.files)
        self.run = wandb.init(
            project=options.get("wandb_project") or "ligertune",
            entity=options.get("wandb_entity"),
            name=options.get("run_name") or run_dir.name,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=dict(config),
        )

    def log(self, prefix: str, values: Mapping[str, float], step: int) -> None:
        self.run.log({f"{prefix}/{key}": value for key, value in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(
        self, run_dir: Path, options: Mapping[str, Any], config: Mapping[str, Any], start_step: int = 0
    ):
        import mlflow

        if options.get("mlflow_tracking_uri"):
            mlflow.set_tracking_uri(options["mlflow_tracking_uri"])
        mlflow.set_experiment(options.get("mlflow_experiment") or "ligertune")
        self.mlflow = mlflow
        mlflow.start_run(run_name=options.get("run_name") or run_dir.name)
        # MLflow params are flat strings of at most a few hundred characters.
        mlflow.log_params({key: str(value)[:250] for key, value in _flatten(config).items()})

    def log(self, prefix: str, values: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({f"{prefix}/{key}": value for key, value in values.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


SINKS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, dotted))
        else:
            flat[dotted] = value
    return flat


def open_metric_loggers(
    names: Sequence[str],
    run_dir: Path,
    options: Mapping[str, Any],
    config: Mapping[str, Any],
    start_step: int = 0,
) -> list[Any]:
    """One sink per selected name, in order. A package missing here (the recipe rule refuses it
    first; this is for library use that skipped the rules) is a warning and that sink is left out."""
    sinks = []
    for name in dict.fromkeys(names):
        try:
            sinks.append(SINKS[name](run_dir, options, config, start_step))
        except ImportError:
            extra = METRIC_LOGGERS[name][1]
            LOGGER.warning(
                f"{name} is not installed (pip install 'ligertune[{extra}]') but logging.loggers "
                "selects it; skipping it"
            )
    return sinks
