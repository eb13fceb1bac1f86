"""W4A16 / W8A16 GEMM in Triton over the layout of packed.py.

One program computes a [BLOCK_M, 64] tile of y = x · Wᵀ: it walks K in steps of BLOCK_K, unpacks a
[BLOCK_K, 64] tile of codes (one byte holds two 4-bit features), applies each row's group scale and zero
point in fp32, casts to x's dtype and accumulates with tl.dot in fp32. Small M (decode) is bound by weight
bytes, so K is also split across programs (split-K) until there are enough programs to keep every SM
streaming; the partial sums are added afterwards. Large M tiles deeper along M and does not split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimlm.kernels.packed import BLOCK_N, PackedWeight

TARGET_PROGRAMS = 264  # ~2 waves on a 132-SM H100/H200


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    K,
    N_PAD,
    GROUPS,
    GROUP_SIZE,
    K_PER_SPLIT,
    stride_xm,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    block = tl.program_id(1)
    split = tl.program_id(2)
    ROW_BYTES: tl.constexpr = 64 * BITS // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, 64)
    if BITS == 4:
        byte = offs_n % 32
        shift = ((offs_n // 32) * 4).to(tl.uint8)
    else:
        byte = offs_n
        shift = tl.zeros([64], dtype=tl.uint8)
    codes_ptr += block * K * ROW_BYTES
    scales_ptr += block * GROUPS * 64
    zeros_ptr += block * GROUPS * 64
    acc = tl.zeros([BLOCK_M, 64], dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], (offs_m[:, None] < M) & k_ok[None, :], 0.0)
        c = tl.load(codes_ptr + offs_k[:, None] * ROW_BYTES + byte[None, :], k_ok[:, None], 0)
        q = ((c >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        g = (offs_k // GROUP_SIZE)[:, None] * 64 + offs_n[None, :]
        s = tl.load(scales_ptr + g, k_ok[:, None], 0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g, k_ok[:, None], 0).to(tl.float32)
        w = ((q - z) * s).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out = out_ptr + split * M * N_PAD + offs_m[:, None] * N_PAD + block * 64 + offs_n[None, :]
    tl.store(out, acc, offs_m[:, None] < M)


def config(m: int, k: int, blocks: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, split_k) for a problem: shallow tiles and split-K for decode, deep tiles for prefill."""
    if m <= 16:
        block_m, block_k = 16, 128
    elif m <= 64:
        block_m, block_k = 64, 64
    else:
        block_m, block_k = 128, 64
    tiles = triton.cdiv(m, block_m) * blocks
    split = 1
    while m <= 64 and tiles * split < TARGET_PROGRAMS and k // (split * 2) >= 4 * block_k:
        split *= 2
    return block_m, block_k, split


def quant_matmul(x: torch.Tensor, w: PackedWeight, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ W.T -> [M, out_features] in x's dtype. `launch` overrides config()."""
    assert BLOCK_N == 64
    if w.perm is not None:
        x = x[:, w.perm]
    x = x.contiguous()
    m, k = x.shape
    blocks = w.codes.shape[0]
    block_m, block_k, split = launch or config(m, k, blocks)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    partial = torch.empty(split, m, w.padded_out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), blocks, split)
    _quant_matmul_kernel[grid](
        x,
        w.codes,
        w.scales,
        w.zeros,
        partial,
        m,
        k,
        w.padded_out_features,
        w.scales.shape[1],
        w.group_size,
        k_per_split,
        x.stride(0),
        BITS=w.bits,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
    )
    y = partial[0] if split == 1 else partial.sum(0)
    return y[:, : w.out_features].to(x.dtype)
