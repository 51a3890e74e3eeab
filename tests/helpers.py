"""Shared setup of the training-level tests: the quickstart recipe shrunk to a tiny model, and
tiny random-init Llamas built straight from a config.

Also imported by the torchrun workers of test_distributed.py (run as a script, with the
repository root on PYTHONPATH), so it imports nothing heavy at module level.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"

# Overrides that shrink the quickstart's model to a 2-layer, hidden-64 Llama at 64 tokens per
# row: a training step takes a fraction of a second on the CPU.
TINY_MODEL = [
    "model.config_overrides={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2}",
    "data.max_seq_len=64",
]
# Overrides for a run that only trains: no kernels, no periodic checkpoints, no HF export, and a
# plain log line every step (what the tests parse).
PLAIN_RUN = [
    "kernels=none",
    "logging.log_every=1",
    "logging.progress=plain",
    "checkpoint.every_steps=null",
    "checkpoint.export_hf=false",
]


def pythonpath_with_root() -> str:
    """PYTHONPATH for a child process that imports ``tests.*`` or ``scripts.*``: the repository
    root first, then whatever the caller had (the GPU machine's wheels live there)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def assert_refused_before_writing(main, argv: list[str], out, message: str, capsys) -> None:
    """A script's ``main(argv)`` (argv ending in ``--out out``) exits 2 with `message` on
    stderr and has written nothing under `out`."""
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def run_repo_script(script: str, *args: str):
    """``python <script> <args>`` from the repository root, output captured. The environment is
    this process's (on a machine without a GPU it carries conftest's TRITON_INTERPRET=1) with
    the root on PYTHONPATH."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": pythonpath_with_root()},
        text=True,
        capture_output=True,
    )


_TINY_LLAMA = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_llama(**config):
    """A random-init ``LlamaForCausalLM``: 2 layers, 4 attention heads and 2 key-value heads
    unless ``config`` (``LlamaConfig`` arguments: the vocabulary and sizes at least) says otherwise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**(_TINY_LLAMA | config)))


def window_outcomes(trainer, windows: list[list]) -> list[tuple]:
    """`forward_backward` of each window (a list of micro-batches) on a set-up trainer's model,
    each from zero gradients: its `StepOutcome` and the parameters' gradients."""
    from ligertune.training.step import forward_backward

    parts, outcomes = trainer.parts, []
    for window in windows:
        out = forward_backward(parts.model, parts.objective, window, trainer.runtime, parts.autocast)
        outcomes.append((out, [p.grad.clone() for p in parts.model.parameters()]))
        parts.optimizer.zero_grad(set_to_none=True)
    return outcomes


def assert_same_outcomes(first: tuple, second: tuple) -> None:
    """Two `window_outcomes` entries train alike: loss, metrics and gradients, to fp32 rounding."""
    import torch

    (one, g1), (other, g2) = first, second
    torch.testing.assert_close(one.loss, other.loss, rtol=1e-6, atol=1e-7)
    for k in one.metrics:
        torch.testing.assert_close(one.metrics[k], other.metrics[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
