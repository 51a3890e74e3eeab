"""ligertune.kernels: fused Triton kernels for LLM training (torch + triton only).

Each module holds the Triton kernels, their launch helpers, a ``torch.autograd.Function``,
a functional API, an ``nn.Module`` and a pure-PyTorch reference of the same math.
"""
