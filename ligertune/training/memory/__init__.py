"""GPU memory: the estimate behind ``ligertune plan`` and the ``auto`` settings (`estimate`,
`shape`, `choose`, `auto`), sub-module activation checkpointing (`checkpointing`) and
activation offload (`offload`)."""
