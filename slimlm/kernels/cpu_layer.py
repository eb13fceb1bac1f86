"""A decoder layer's small operations in one C call each (cpu_layer.c): the residual add with its RMSNorm, and
the rotary embedding with the KV-cache write. Same contracts as reference.add_rms_norm and
reference.rotary_kv_write, which run instead for what the C code does not cover (fp16, quantized KV caches,
tensors that are not laid out flat)."""

from __future__ import annotations

import torch

from slimlm.kernels import cpu_library, reference

DTYPES = (torch.float32, torch.bfloat16)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of h, h) for h = x + residual; h is written into `residual` in place (not a new tensor)."""
    flat = [x, weight] if residual is None else [x, weight, residual]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype or not t.is_contiguous() for t in flat):
        return reference.add_rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    dim = x.shape[-1]
    cpu_library.load().slimlm_add_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // dim, dim, eps, int(x.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    return out, x if residual is None else residual


def rotary_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotated q [T, Hq, D]; rotated keys and the values written into the (float, unscaled) caches at `slots`."""
    flat = all(t.dtype == qkv.dtype and t.is_contiguous() for t in (qkv, cos, signed_sin, k_cache, v_cache))
    scaled = k_scale is not None or v_scale is not None
    if qkv.dtype not in DTYPES or not flat or scaled or slots.dtype != torch.int64 or not slots.is_contiguous():
        return reference.rotary_kv_write(qkv, cos, signed_sin, slots, k_cache, v_cache, k_scale, v_scale)
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    heads = qkv.shape[1] // dim - 2 * kv_heads
    q = torch.empty(qkv.shape[0], heads, dim, dtype=qkv.dtype)
    cpu_library.load().slimlm_rotary_kv_write(
        qkv.data_ptr(), qkv.shape[0], heads, kv_heads, dim, cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(), int(qkv.dtype == torch.bfloat16),
    )  # fmt: skip
    return q
