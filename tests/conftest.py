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
