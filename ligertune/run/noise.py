"""Known third-party warnings that say nothing about the user's run, kept off the console.

We import torchao and deepspeed only where a recipe uses them (``training.fp8``,
``parallel.strategy: deepspeed``), but other libraries import them whenever they are installed:
transformers' quantizer registry imports torchao, accelerate's model unwrapping (called by every
``save_pretrained``) imports deepspeed. Their import-time warnings then reach every command, even
with ``--quiet`` (DeepSpeed's own logger prints to stdout), and read as if something were broken.

Each entry of `KNOWN_NOISE` names the logger, the message (a regular expression matched at the
start) and why it is noise. `install_noise_filters` puts a filter on each of those loggers: the
record is dropped, and with ``--verbose`` re-logged as a debug line of ours (so ``-v`` and
train.log still show what was hidden, marked as such). Anything else those libraries say goes
through untouched: a filter matches one known message, never a whole logger. When a library
rewords a message the filter stops matching and the warning shows again, which is the safe
failure.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Noise:
    logger: str
    message: re.Pattern[str]
    why: str


KNOWN_NOISE = (
    Noise(
        "torchao",
        re.compile(r"Failed to load .*torchao[/\\]_C"),
        "torchao's prebuilt CUDA extensions, which this torch build cannot load; imported by transformers "
        "whenever torchao is installed, and not needed unless training.fp8 is on a GPU",
    ),
    Noise(
        "torch.utils._pytree",
        re.compile(r"<enum '\w+'> is an Enum subclass and is now natively supported by torch.compile"),
        "a deprecation in torchao's import (it registers enums the way torch 2.13 deprecates)",
    ),
    Noise(
        "DeepSpeed",
        re.compile(r"Setting accelerator to CPU"),
        "DeepSpeed's accelerator probe on a machine without a GPU; accelerate imports deepspeed "
        "whenever it is installed",
    ),
)


class _KnownNoise(logging.Filter):
    """Drops the records of one logger that match known noise; with `verbose`, hands them on to
    `report` (our debug line) first."""

    def __init__(self, entries: list[Noise], report: logging.Logger, verbose: bool):
        super().__init__()
        self.entries, self.report, self.verbose = entries, report, verbose

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not any(entry.message.match(message) for entry in self.entries):
            return True
        if self.verbose:
            self.report.debug(f"(hidden warning of {record.name}) {message}")
        return False


def install_noise_filters(report: logging.Logger, verbose: bool) -> None:
    """Filter `KNOWN_NOISE` out of the libraries' loggers (again: a second call replaces the
    filters of the first). With `verbose`, say on `report` what is hidden and why."""
    by_logger: dict[str, list[Noise]] = {}
    for entry in KNOWN_NOISE:
        by_logger.setdefault(entry.logger, []).append(entry)
    for name, entries in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _KnownNoise)]:
            logger.removeFilter(old)
        logger.addFilter(_KnownNoise(entries, report, verbose))
    if verbose:
        report.debug(
            "hiding known third-party warnings (shown below as debug lines when they occur): "
            + "; ".join(f"{entry.logger}: {entry.why}" for entry in KNOWN_NOISE)
        )
