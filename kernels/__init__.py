"""ligertune.kernels: fused Triton kernels for LLM training (torch + triton only).

Each module holds the Triton kernels, their launch helpers, ``torch.library`` custom ops with
fake implementations and autograd (so torch.compile sees one node per launch), a functional API,
an ``nn.Module`` and a pure-PyTorch reference of the same math. Two paths stay
``torch.autograd.Function``s: the cross entropy's eager-only ``inplace_backward`` (torch.library
registers no autograd for an op that overwrites its input) and ``fused_linear_logprobs``'s
one-pass group loss (it takes a Python callable, which no op schema can) and distillation (not
converted yet). ``moe`` (the mixture-of-experts experts block) has no module of its own: its
functional API takes the place of transformers' ``Experts.forward``.
"""
