"""The CPU quantized GEMM (cpu_gemm.c, through cpu_library)."""

from __future__ import annotations

import torch

from slimlm.kernels import cpu_library
from slimlm.kernels.packed import BLOCK_N, PackedWeight

FUSED_MAX_ROWS_BF16 = 16  # above this, bf16 matmul on dequantized slices wins (benchmarks/kernels_cpu.py)
SLICE_BLOCKS = 16  # weight blocks (of BLOCK_N features) dequantized at a time: a few MB, stays in cache


def quant_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, out_features] in x's dtype.

    Few rows (or fp32): the fused loop, fp32 accumulation, weights read once per 4 rows. Many bf16 rows: the
    weight is dequantized to bf16 a slice at a time and torch's bf16 matmul does the arithmetic, which wins
    there (benchmarks/kernels_cpu.py measures both)."""
    if w.perm is not None:
        x = x[:, w.perm]
    if x.dtype == torch.bfloat16 and x.shape[0] > FUSED_MAX_ROWS_BF16:
        return _dequantized_matmul(x.contiguous(), w)
    xf = x.to(torch.float32).contiguous()
    m, k = xf.shape
    y = torch.empty(m, w.padded_out_features, dtype=torch.float32)
    cpu_library.load().slimlm_quant_matmul(
        w.bits, xf.data_ptr(), m, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(),
        w.codes.shape[0], w.group_size, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    y = y[:, : w.out_features]
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _dequantized_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    k = x.shape[1]
    blocks = w.codes.shape[0]
    out = torch.empty(x.shape[0], w.padded_out_features, dtype=torch.bfloat16)
    buffers = {}  # by width: reused, since fresh pages for every slice cost as much as the arithmetic
    for b0 in range(0, blocks, SLICE_BLOCKS):
        b1 = min(b0 + SLICE_BLOCKS, blocks)
        width = (b1 - b0) * BLOCK_N
        if width not in buffers:
            buffers[width] = torch.empty(k, width, dtype=torch.bfloat16)
        wt = buffers[width]
        cpu_library.load().slimlm_dequantize_bf16(
            w.bits, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), b0, b1, w.group_size,
            wt.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        out[:, b0 * BLOCK_N : b1 * BLOCK_N] = x @ wt
    return out[:, : w.out_features]
