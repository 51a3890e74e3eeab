"""Test setup: Triton's CPU interpreter on machines without a GPU.

TRITON_INTERPRET must be set before triton is imported anywhere, so it is set here, at the
top of the first module pytest imports.
"""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tokenised-data cache of every run the tests start (and of their child processes): a
# folder of this session's, never the user's ~/.cache.
os.environ.setdefault("LIGERTUNE_DATA_CACHE", tempfile.mkdtemp(prefix="ligertune-test-data-"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The quick subset (`-m "not slow"`, README) stays quick only if long tests carry the marker:
# the session ends by naming the unmarked ones that took longer than this (a note, not a
# failure: timings on a shared machine vary).
SLOW_SECONDS = 20.0
_unmarked_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > SLOW_SECONDS and "slow" not in report.keywords:
        _unmarked_slow.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _unmarked_slow:
        terminalreporter.write_sep(
            "-", f"over {SLOW_SECONDS:.0f} s without the slow marker (add @pytest.mark.slow)"
        )
        for nodeid, seconds in _unmarked_slow:
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
