"""`python -m ligertune` (and `torchrun -m ligertune train ...`) runs the CLI."""

from ligertune.cli import main

main()
