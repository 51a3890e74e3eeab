"""The commands around training: `compare` (kernels off vs on on a recipe), `bench` (kernel
timings against eager, torch.compile and Liger), `check` (patched vs unpatched parity), `env`."""
