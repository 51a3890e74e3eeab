"""LayerNorm: Triton forward and backward.

Math (per row of ``H`` elements, all in fp32, one rounding to the input dtype at the end)::

    μ = mean(x),  x̂ = x − μ,  r = 1 / sqrt(mean(x̂²) + eps)     μ and r saved for backward
    n = x̂ · r
    y = w ⊙ n + b

Backward. With ``dn = dy ⊙ w`` and ``∂n_j/∂x_k = r · (δ_jk − 1/H − n_j n_k / H)`` (the −1/H from
the mean, the last term from r)::

    dx_k = Σ_j dn_j ∂n_j/∂x_k = r · (dn_k − mean(dn) − n_k · mean(dn ⊙ n))
    dw   = Σ_rows dy ⊙ n
    db   = Σ_rows dy

The kernels are the RMSNorm row kernels of ``rms_norm.py`` with their ``CENTER`` flag on (the mean
subtracted before the variance, the extra ``mean(dn)`` term in dx) and a bias; they share its
launch configuration, persistent backward grid and fp32 per-program dw/db partials. The variance
is computed two-pass from the row held in registers (no Welford needed: the row is never
re-read), which is also the numerically safer form. Like RMSNorm's, the launches are custom
ops (``ligertune::layer_norm_fwd``, ``ligertune::row_norm_bwd``) that torch.compile sees as nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._utils import use_triton
from .rms_norm import _row_norm_bwd, _row_norm_forward, check_norm_args


@torch.library.custom_op("ligertune::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)``; the backward is ``ligertune::row_norm_bwd`` (``rms_norm.py``)."""
    y, _, _, mean, rstd = _row_norm_forward(
        x, None, weight, bias, eps, 0.0, center=True, llama_cast=False, out_dtype=x.dtype
    )
    return y, mean, rstd


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    compute_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dx, *rest = _row_norm_bwd(dy, x, weight, mean, rstd, None, 0.0, False, compute_dw, compute_db)
    dw = rest.pop(0) if compute_dw else None
    db = rest.pop(0).to(ctx.bias_dtype) if compute_db else None
    return dx, dw, db, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm in plain PyTorch: fp32 math (any mix of input/parameter dtypes), output in x's dtype."""
    check_norm_args("layer_norm", x, eps, weight=weight, bias=bias)
    y = F.layer_norm(
        x.float(),
        (x.shape[-1],),
        weight.float() if weight is not None else None,
        bias.float() if bias is not None else None,
        eps,
    )
    return y.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` (any leading shape; ``weight``/``bias`` optional)."""
    check_norm_args("layer_norm", x, eps, weight=weight, bias=bias)
    params = [p for p in (weight, bias) if p is not None]
    if not use_triton(x, *params):
        return layer_norm_reference(x, weight, bias, eps)
    return _layer_norm_fwd(x, weight, bias, float(eps))[0]


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over one trailing dimension (state_dict ``weight``, ``bias``)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        elementwise_affine: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
