"""How the fused loss kernels cut their rows into chunks: plain arithmetic, no torch, so that the
memory plan (`ligertune.plan`) computes the same chunks the kernels will, without importing them.

The fused linear cross entropy (and the log-prob and distillation kernels built on it) never
hold the [N, V] logits: they run chunks of rows whose [C, V] buffer fits a byte budget.
"""

from __future__ import annotations

import math

DEFAULT_MEMORY_BUDGET_BYTES = 768 * 2**20
# Chunks are rounded to a multiple of this many rows (matmul tile size) when the budget allows.
_ROW_ALIGN = 64


def chunk_rows(n_rows: int, n_cols: int, bytes_per_element: int, budget_bytes: int) -> int:
    """Rows per chunk: the largest count whose [rows, n_cols] buffer fits ``budget_bytes``,
    balanced over the chunks that ``n_rows`` then needs and tile-aligned where that still fits.
    At least one row, however small the budget."""
    max_rows = max(1, budget_bytes // (n_cols * bytes_per_element))
    if n_rows <= max_rows:
        return max(1, n_rows)
    rows = math.ceil(n_rows / math.ceil(n_rows / max_rows))
    aligned = math.ceil(rows / _ROW_ALIGN) * _ROW_ALIGN
    return aligned if aligned <= max_rows else rows


def sweep_rows(
    n_rows: int,
    n_cols: int,
    n_hidden: int,
    bytes_per_element: int,
    budget_bytes: int,
    *,
    accumulator_bytes: int = 0,
    weight_bytes: int = 2,
) -> int:
    """Rows per chunk of the fused loop: ``chunk_rows`` within the budget, or all ``n_rows`` in one
    chunk when that needs no more memory than the chunked loop.

    Several chunks sum dW over them in an accumulator of ``accumulator_bytes`` per element
    (0: none, as with bf16 accumulation or fp32 weights); one chunk needs none, since cuBLAS sums
    all N rows in fp32 itself, and runs three full-size GEMMs instead of three per chunk. The peaks
    compared: one chunk holds its [N, V] buffer and dW; several hold the accumulator with their
    [C, V] buffer, then with the rounded dW (the buffer is freed first). At 8192 × 4096 × 128256
    in bf16 both are 3.2 GB, so the single chunk is taken; at 16384 × 2048 it would be 4.7 GB
    against 1.8 GB, so not.
    """
    rows = chunk_rows(n_rows, n_cols, bytes_per_element, budget_bytes)
    if rows >= n_rows or not accumulator_bytes:
        return rows
    weight_size = n_cols * n_hidden
    single = n_rows * n_cols * bytes_per_element + weight_size * weight_bytes
    chunked = weight_size * accumulator_bytes + max(
        rows * n_cols * bytes_per_element, weight_size * weight_bytes
    )
    return n_rows if single <= chunked else rows


# fp32 C × V buffers alive at once in a distillation chunk: both log-softmaxes, probabilities,
# the mixture (JSD), the gradient.
DISTILL_BUFFERS = 6
