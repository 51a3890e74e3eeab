"""Where a run's lines and metrics go: console verbosity, train.log, and the metric loggers."""

from __future__ import annotations

import io
import sys
import types

import pytest
from rich.console import Console

from ligertune.config import load_recipe
from ligertune.errors import RecipeError
from ligertune.run import loggers
from ligertune.run.loggers import LOGGER, configure_logging, make_console
from ligertune.run.metrics import MetricsLogger, RunSummary, Throughput

# A shipped recipe, by name (resolved by load_recipe).
RECIPE = "quickstart"


@pytest.fixture(autouse=True)
def fresh_logger():
    """Each test sets the `ligertune` logger up itself; leave it as it was found."""
    handlers, level, propagate = LOGGER.handlers[:], LOGGER.level, LOGGER.propagate
    LOGGER.handlers = []
    yield
    LOGGER.handlers, LOGGER.level, LOGGER.propagate = handlers, level, propagate


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=100, color_system=None), out


def _summary() -> RunSummary:
    rates = Throughput(0, 1, 1.0, None).rates(Throughput(0, 1, 1.0, None).run)
    return RunSummary(3, 1.0, rates, None, None, final_loss=1.25, eval_loss=None)


@pytest.mark.parametrize(
    ("verbosity", "shown", "hidden"),
    [
        ("quiet", ["a warning"], ["an info line", "a debug line"]),
        ("normal", ["a warning", "an info line"], ["a debug line"]),
        ("verbose", ["a warning", "an info line", "a debug line"], []),
    ],
)
def test_verbosity_filters_the_console_and_train_log_keeps_everything(tmp_path, verbosity, shown, hidden):
    console, out = _console()
    configure_logging(verbosity, console)
    LOGGER.debug("a debug line")
    LOGGER.info("an info line")
    LOGGER.warning("a warning")
    metrics = MetricsLogger(tmp_path, total_steps=3, start_step=0, progress="rich")
    metrics.info("step line after train.log opened")
    metrics.summary(_summary())
    metrics.close()
    text = out.getvalue()
    for line in shown:
        assert line in text
    for line in hidden:
        assert line not in text
    assert "run summary" in text and "loss, last step" in text  # the summary shows even with --quiet
    assert ("step line after" in text) == (verbosity != "quiet")
    assert ("0/3" in text) == (verbosity != "quiet")  # the bar's count; --quiet: no bar either
    log = (tmp_path / "train.log").read_text()
    # Lines from before the run directory was known are at the top of train.log, timestamped.
    # (-v also opens with what third-party noise is hidden: ligertune.run.noise.)
    lines = [line for line in log.splitlines() if "hiding known third-party warnings" not in line]
    assert "DEBUG" in lines[0] and lines[0].endswith("a debug line") and lines[0][:4].isdigit()
    assert "an info line" in lines[1] and "WARNING" in lines[2]
    assert "step line after train.log opened" in log and "loss, last step" in log


def test_other_ranks_show_warnings_only_and_write_no_train_log(tmp_path):
    console, out = _console()
    configure_logging("verbose", console, main=False)
    LOGGER.info("rank 1 info")
    LOGGER.warning("rank 1 warning")
    assert "rank 1 info" not in out.getvalue() and "rank 1 warning" in out.getvalue()
    assert not [h for h in LOGGER.handlers if isinstance(h, loggers._StartupBuffer)]


def test_a_resume_appends_to_train_log(tmp_path):
    configure_logging("normal", _console()[0])
    for run in ("first", "second"):
        metrics = MetricsLogger(tmp_path, total_steps=3, start_step=0, progress="plain")
        metrics.info(f"{run} run")
        metrics.close()
    log = (tmp_path / "train.log").read_text()
    assert log.index("first run") < log.index("second run")


def test_library_use_without_the_cli_still_prints_and_restores_the_logger(tmp_path, capsys):
    before = list(LOGGER.handlers)  # pytest's own capture may hang one there
    metrics = MetricsLogger(tmp_path, total_steps=3, start_step=0, progress="plain")
    metrics.info("printed without any set-up")
    metrics.close()
    assert "printed without any set-up" in capsys.readouterr().out
    assert LOGGER.handlers == before
    assert "printed without any set-up" in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize(("isatty", "columns", "width"), [(False, None, loggers.WIDE), (False, "90", 90)])
def test_a_console_that_is_not_a_terminal_is_wide(monkeypatch, isatty, columns, width):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    console = make_console()
    assert console.width == width
    console.print("x" * 150)
    assert ("x" * 150 in sys.stdout.getvalue()) == (width >= 150)


def _records() -> list[dict]:
    return [
        {"event": "train", "step": 2, "loss": 2.5, "lr": 1e-3, "skipped_steps": 0, "time": 1.0, "ok": True},
        {"event": "eval", "step": 2, "eval_loss": 2.25},
    ]


def test_tensorboard_logger_writes_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")  # the dev extra installs it; a bare install need not
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricsLogger(tmp_path, total_steps=3, start_step=0, progress="plain", loggers=["tensorboard"])
    for record in _records():
        metrics.write(record)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/eval_loss"} <= tags
    assert "train/time" not in tags and "train/ok" not in tags  # neither a metric nor a number
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(2, 2.5)]


def test_deprecated_tensorboard_flag_still_selects_tensorboard(tmp_path):
    recipe = load_recipe(RECIPE, ["logging.tensorboard=true"])
    assert recipe.logging.selected_loggers() == ["tensorboard"]
    both = load_recipe(RECIPE, ["logging.tensorboard=true", "logging.loggers=[tensorboard]"])
    assert both.logging.selected_loggers() == ["tensorboard"]


class _FakeWandbRun:
    def __init__(self, calls: list, **kwargs):
        self.calls = calls
        calls.append(("init", kwargs))

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_logger_keeps_its_run_id_across_resumes(tmp_path, monkeypatch):
    calls: list = []
    fake = types.SimpleNamespace(init=lambda **kwargs: _FakeWandbRun(calls, **kwargs))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    options = {"wandb_project": "proj", "run_name": None}
    for _ in range(2):
        metrics = MetricsLogger(
            tmp_path, 3, 0, progress="plain", loggers=["wandb"], options=options, config={"seed": 1}
        )
        metrics.write(_records()[0])
        metrics.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / "wandb-run-id").read_text().strip()
    assert inits[0]["resume"] == "allow"
    assert inits[0]["project"] == "proj" and inits[0]["name"] == tmp_path.name
    assert inits[0]["config"] == {"seed": 1}
    logged = [c for c in calls if c[0] == "log"]
    assert logged[0][1]["train/loss"] == 2.5 and logged[0][2] == 2
    assert calls.count(("finish",)) == 2


def test_mlflow_logger_logs_params_and_metrics(tmp_path, monkeypatch):
    calls: list = []
    fake = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("uri", uri)),
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_params=lambda params: calls.append(("params", params)),
        log_metrics=lambda values, step: calls.append(("metrics", values, step)),
        end_run=lambda: calls.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    options = {"mlflow_tracking_uri": "file:///tmp/x", "run_name": "r1"}
    metrics = MetricsLogger(
        tmp_path,
        3,
        0,
        progress="plain",
        loggers=["mlflow"],
        options=options,
        config={"training": {"lr": 1e-4}},
    )
    metrics.write(_records()[1])
    metrics.close()
    assert calls[:4] == [
        ("uri", "file:///tmp/x"),
        ("experiment", "ligertune"),
        ("start", "r1"),
        ("params", {"training.lr": "0.0001"}),
    ]
    assert calls[4] == ("metrics", {"eval/eval_loss": 2.25}, 2) and calls[-1] == ("end",)


def test_a_selected_logger_that_is_not_installed_is_a_recipe_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE, ["logging.loggers=[tensorboard,wandb]"])
    assert e.value.problems == [
        "logging.loggers: wandb is selected but not installed; install it with: pip install "
        "'ligertune[wandb]' or remove it from logging.loggers"
    ]


def test_a_logger_missing_in_library_use_is_a_warning_not_a_crash(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    metrics = MetricsLogger(tmp_path, 3, 0, progress="plain", loggers=["wandb"])
    metrics.write(_records()[0])
    metrics.close()
    assert "wandb is not installed (pip install 'ligertune[wandb]')" in capsys.readouterr().out


def test_wandb_offline_run_is_written_in_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # not in the dev extra: runs where the wandb extra is installed
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    metrics = MetricsLogger(tmp_path, 3, 0, progress="plain", loggers=["wandb"], config={"seed": 1})
    metrics.write(_records()[0])
    metrics.close()
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    assert [p.name for p in (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")]
