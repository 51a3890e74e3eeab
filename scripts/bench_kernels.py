#!/usr/bin/env python3
"""Kernel benchmark without the console script: the same options as `ligertune bench`, e.g.
``python scripts/bench_kernels.py --quick`` or ``python scripts/bench_kernels.py -k ce,flce``."""

import sys

from ligertune.cli import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]], prog_name="bench_kernels.py")
