"""The 4-bit KV cache: each token's key or value of one KV head is one row of bytes, rounded as it is written.

A key (after RoPE) first loses its layer's offset μ [Hkv, D], the mean key per KV head and channel (measured
by the runtime at load, ModelRunner.set_key_offsets): no softmax can see it, since q·(k − μ) = q·k − q·μ is the
same shift for every key of a query, and it is most of a key's range in models with large key biases (Qwen2:
channels at ±350 that vary by ±1; rounded with them, the 1.5B's wiki perplexity rose a thousandfold). Values are
not shifted (the read would have to add μ back). A vector x [D] (a key less μ, or a value) is then rotated,
y = x·H with H a fixed randomized Hadamard matrix (orthonormal: Sylvester's ±1 matrix with seeded column signs,
over √D). The rotation spreads a few large channels over all of them (QuaRot), so one scale per row fits every
value; attention is unchanged by it, since q·k = (q·H)·(k·H) and Σ p·v = (Σ p·(v·H))·Hᵀ. y is then rounded
asymmetrically to 16 levels:
    step = fp16((max y − min y) / 15), lo = fp16(min y), code = clamp(round((y − lo) / step), 0, 15)
and read back as x̂ = (code·step + lo)·Hᵀ (+ μ for a key, which attention never needs). The row holds D/2 bytes
of codes, byte j carrying code j in its low nibble and code j + D/2 in its high nibble, then step and lo as
fp16: D/2 + 4 bytes, against D for an 8-bit cache (1.78× the tokens per byte at D = 64, 1.88× at D = 128). The
scales are each row's own. Chosen by measurement over symmetric rows, per-channel key scales and no rotation
or no centering (benchmarks/kv_cache.py --parts int4).
"""

from __future__ import annotations

import functools

import torch

META_BYTES = 4  # after a row's codes: its fp16 step and fp16 minimum
SEED = 0  # the rotation's column signs; part of the format (a cache is read with the H it was written with)


def row_bytes(head_dim: int) -> int:
    return head_dim // 2 + META_BYTES


def head_dim(cache: torch.Tensor) -> int:
    """The head dimension of a 4-bit cache [..., row_bytes]."""
    return (cache.shape[-1] - META_BYTES) * 2


@functools.cache
def rotation(dim: int, device: str = "cpu") -> torch.Tensor:
    """H [dim, dim] fp32 (dim a power of two): Sylvester's Hadamard matrix, columns' signs seeded, over √dim."""
    if dim & (dim - 1):
        raise ValueError(f"a 4-bit KV cache needs a power-of-two head dimension, not {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(SEED)) * 2 - 1
    return (h * signs / dim**0.5).to(device)


def quantize(x: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] float, less `offset` (broadcast; keys' μ) -> uint8 rows [..., D/2 + 4] (see the module docstring)."""
    dim = x.shape[-1]
    y = (x.float() if offset is None else x.float() - offset.float()) @ rotation(dim, str(x.device))
    lo = y.amin(-1, keepdim=True).half()
    step = ((y.amax(-1, keepdim=True) - lo.float()) / 15).half()
    # a zero step (a constant row) reads back lo whatever the code: 0 then
    codes = torch.where(step > 0, (y - lo.float()) / step.float(), 0).round_().clamp_(0, 15).to(torch.uint8)
    packed = codes[..., : dim // 2] | (codes[..., dim // 2 :] << 4)
    meta = torch.cat([step, lo], -1).view(torch.uint8)
    return torch.cat([packed, meta], -1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., D/2 + 4] -> x̂ [..., D] in `dtype`."""
    half = rows.shape[-1] - META_BYTES
    codes = torch.cat([rows[..., :half] & 15, rows[..., :half] >> 4], -1).float()
    step, lo = rows[..., half:].contiguous().view(torch.float16).float().split(1, -1)
    return ((codes * step + lo) @ rotation(2 * half, str(rows.device)).T).to(dtype)
