"""GPU memory: the estimate behind ``ligertune plan`` and the ``auto`` settings (`estimate`,
`shape`, `choose`, `auto`), and activation offload (`offload`)."""
