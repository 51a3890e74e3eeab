"""What the software stack and hardware look like, for `ligertune env` and run logs."""

from __future__ import annotations

import importlib.metadata
import os
import platform

from ligertune.catalog.strategies import STRATEGIES


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def kernel_mode() -> str:
    """How the Triton kernels run on this machine."""
    import torch

    if torch.cuda.is_available():
        return "compiled Triton on CUDA"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton CPU interpreter (TRITON_INTERPRET=1; slow, for testing)"
    return "PyTorch reference on CPU (set TRITON_INTERPRET=1 to run the Triton code under the interpreter)"


def describe_environment() -> dict[str, str]:
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ligertune": _version("ligertune"),
    }
    for dist in (
        "torch",
        "triton",
        "transformers",
        "datasets",
        "tokenizers",
        "accelerate",
        *(s.package for s in STRATEGIES if s.package),
        "liger-kernel",
    ):
        info[dist] = _version(dist)
    info["cuda (torch build)"] = str(torch.version.cuda)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info[f"gpu {i}"] = (
                f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
            )
    else:
        info["gpus"] = "none"
    info["kernels"] = kernel_mode()
    return info
