"""ligertune: fine-tune LLMs from YAML recipes, with fused Triton kernels."""

__version__ = "0.1.0"
