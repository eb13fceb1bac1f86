"""The CPU quantized GEMM (cpu_gemm.c, through cpu_library)."""

from __future__ import annotations

import torch

from slimlm.kernels import cpu_library
from slimlm.kernels.packed import BLOCK_N, PackedWeight

FUSED_MAX_ROWS_BF16 = 16  # AVX-512: above this, bf16 matmul on dequantized slices wins (benchmarks/kernels_cpu.py)
FUSED_MAX_ROWS_AVX2 = 24  # AVX2: above this, fp32 matmul on dequantized slices wins, for either dtype of x
SLICE_BLOCKS = 16  # weight blocks (of BLOCK_N features) dequantized at a time: a few MB, stays in cache


def quant_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, out_features] in x's dtype.

    Few rows: the fused loop, fp32 accumulation, weights read once per register tile of rows. Many rows:
    the weight is dequantized a slice at a time and torch's matmul does the arithmetic, which wins there
    (benchmarks/kernels_cpu.py measures both): in bf16 for bf16 rows on AVX-512 (fp32 rows stay fused), in
    fp32 for any rows on AVX2, which has no fast bf16 matmul."""
    if w.perm is not None:
        x = x[:, w.perm]
    if dequantizes_slices(x.shape[0], x.dtype):
        slices = torch.bfloat16 if cpu_library.vector_bits() == 512 else torch.float32  # what slimlm_dequantize writes
        return _dequantized_matmul(x.to(slices).contiguous(), w).to(x.dtype)
    xf = x.to(torch.float32).contiguous()
    m, k = xf.shape
    y = torch.empty(m, w.padded_out_features, dtype=torch.float32)
    cpu_library.load().slimlm_quant_matmul(
        w.bits, xf.data_ptr(), m, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(),
        w.codes.shape[0], w.group_size, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    y = y[:, : w.out_features]
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def dequantizes_slices(rows: int, dtype: torch.dtype) -> bool:
    """Whether quant_matmul hands `rows` rows of `dtype` to torch's matmul on dequantized weight slices."""
    if cpu_library.vector_bits() == 512:
        return dtype == torch.bfloat16 and rows > FUSED_MAX_ROWS_BF16
    return rows > FUSED_MAX_ROWS_AVX2


def _dequantized_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    k = x.shape[1]
    blocks = w.codes.shape[0]
    out = torch.empty(x.shape[0], w.padded_out_features, dtype=x.dtype)
    buffers = {}  # by width: reused, since fresh pages for every slice cost as much as the arithmetic
    for b0 in range(0, blocks, SLICE_BLOCKS):
        b1 = min(b0 + SLICE_BLOCKS, blocks)
        width = (b1 - b0) * BLOCK_N
        if width not in buffers:
            buffers[width] = torch.empty(k, width, dtype=x.dtype)
        wt = buffers[width]
        cpu_library.load().slimlm_dequantize(
            w.bits, k, w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), b0, b1, w.group_size,
            wt.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        out[:, b0 * BLOCK_N : b1 * BLOCK_N] = x @ wt
    return out[:, : w.out_features]
