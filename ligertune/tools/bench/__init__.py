"""`ligertune bench`: every kernel against eager PyTorch, torch.compile and Liger-Kernel.

`cases` says what is measured (inputs, providers, minimal bytes and FLOPs per kernel, named as
in the kernel registry), `timing` how (the one GPU timer and the memory probes), `run` resolves
the options and measures, `results` holds the rows, `report` writes them.
"""

from ligertune.tools.bench.results import BenchError
from ligertune.tools.bench.run import BenchOptions, run_command

__all__ = ["BenchError", "BenchOptions", "run_command"]
