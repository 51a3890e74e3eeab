"""ligertune.kernels: fused Triton kernels for LLM training (torch + triton only).

Each module holds the Triton kernels, their launch helpers, ``torch.library`` custom ops with
fake implementations and autograd (the decoder-layer kernels, so torch.compile sees one node per
launch) or a ``torch.autograd.Function`` (the loss kernels), a functional API, an ``nn.Module``
and a pure-PyTorch reference of the same math.
"""
