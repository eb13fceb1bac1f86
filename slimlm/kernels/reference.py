"""Plain PyTorch definitions of what every kernel computes. Tests hold the kernels to these (in float64);
`SLIMLM_KERNELS=reference` runs them in place of the kernels.

Paged attention, shared by the decode and the prefill kernels:
    q            [T, Hq, D]   query tokens of all sequences packed back to back
    k/v_cache    [num_blocks, block_size, Hkv, D]   fp32/fp16/bf16, fp8 e4m3 or int8 (then k/v_scale [Hkv]);
                 or uint8 [num_blocks, block_size, Hkv, D/2 + 4]: 4-bit rows (formats.kv_int4)
    block_tables int32 [S, max_blocks]   the cache blocks of each sequence, in order
    seq_lens     int32 [S]   tokens in each sequence's cache, the new ones included (already written)
    query_start  int32 [S+1] sequence s owns queries query_start[s]:query_start[s+1], its last tokens
Query i of a sequence sits at position seq_len − q_len + i and sees keys 0..that position (causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimlm.formats import kv_int4
from slimlm.formats.kv_cache import KV_DTYPES, key_rotation
from slimlm.kernels.packed import PackedWeight, dequantize


def quant_matmul(x: torch.Tensor, w: PackedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T -> [M, out_features], computed in `dtype` (x's by default)."""
    dtype = dtype or x.dtype
    if w.perm is not None:
        x = x[:, w.perm]
    return (x.to(dtype) @ dequantize(w, dtype).T)[:, : w.out_features]


def int8_activations(x: torch.Tensor, run: int = 32) -> torch.Tensor:
    """x̂: x [M, K] quantized per `run` inputs to int8 (q = x·(127/max|x|) rounded to nearest, ties to even;
    x̂ = q·max|x|/127) and back, as the AVX2 4-bit kernel multiplies it (cpu_gemm's "int8" loop, llama.cpp's Q8
    activations). In fp32 step for step as the kernel: in float64 a product near .5 can round the other way."""
    runs = x.float().reshape(x.shape[0], -1, run)
    amax = runs.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(runs * inv) * (amax / 127)).reshape(x.shape).to(x.dtype)


def dequantized(kv: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V [..., Hkv, D] in `dtype`, times its per-head scale (fp8/int8 caches); 4-bit rows decoded."""
    if kv.dtype == torch.uint8:
        return kv_int4.dequantize(kv, dtype)
    kv = kv.to(dtype)
    return kv if scale is None else kv * scale.to(dtype)[:, None]


def quantized_kv(
    kv: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """K or V [..., Hkv, D] as a cache of `cache_dtype` stores it, less `offset` ([Hkv, D], keys') when given:
    4-bit rows, or (kv − offset) / scale rounded to the nearest fp8 (saturating at ±448) or integer (±127) with a
    per-head scale; a float cache takes kv as it is."""
    if cache_dtype == torch.uint8:
        return kv_int4.quantize(kv, offset)
    if scale is None:
        return kv.to(cache_dtype)
    limit = KV_DTYPES["int8" if cache_dtype == torch.int8 else "fp8"][1]
    x = (kv.float() if offset is None else kv.float() - offset.float()) / scale[:, None]
    x = x.clamp_(-limit, limit)
    return (x.round_() if cache_dtype == torch.int8 else x).to(cache_dtype)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of h, h) for h = x + residual (x alone without one): the residual stream of a decoder layer
    and the norm that reads it. Normalized in fp32, cast back, then scaled: what transformers does, so half
    precision rounds the same."""
    h = x if residual is None else x + residual
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype), h


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of logits [R, V]: log p(target), the largest log p and its token (the first of equals), fp32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best, best_ids = logprobs.max(dim=-1)
    return logprobs.gather(-1, targets[:, None])[:, 0], best, best_ids


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up = [gate | up] along the last dimension (the MLP's joined projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, transformers' half-split convention, x·cos + rotate_half(x)·sin, written as
    x·cos + roll(x, D/2)·[−sin₁, sin₂]: the same products and sums (negation is exact), half the calls."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotary_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [T, (Hq + 2·Hkv)·D], each token's cos and signed sin [T, D] -> rotated q [T, Hq, D]; the rotated
    keys and the values are written into the caches [blocks, block_size, Hkv, D] at `slots`, as they store them
    (keys less k_offset when given; an fp8 cache's keys, and then q, times formats.kv_cache.key_rotation)."""
    kv_heads, dim, row = k_cache.shape[2], cos.shape[-1], k_cache.shape[3]
    q, k, v = qkv.reshape(qkv.shape[0], -1, dim).split([qkv.shape[1] // dim - 2 * kv_heads, kv_heads, kv_heads], 1)
    cos, signed_sin = cos[:, None], signed_sin[:, None]
    q, k = rotate(q, cos, signed_sin), rotate(k, cos, signed_sin)
    h = key_rotation(k_cache.dtype, dim, str(qkv.device))
    if h is not None:
        k = (k.float() if k_offset is None else k.float() - k_offset.float()) @ h
        q, k_offset = (q.float() @ h).to(qkv.dtype), None
    k_cache.view(-1, kv_heads, row)[slots] = quantized_kv(k, k_scale, k_cache.dtype, k_offset)
    v_cache.view(-1, kv_heads, row)[slots] = quantized_kv(v, v_scale, v_cache.dtype)
    return q


def cached_kv(
    cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """The first `length` cached tokens of one sequence, [length, Hkv, D] in `dtype`."""
    return dequantized(cache[blocks.long()].flatten(0, 1)[:length], scale, dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    query_lens: list[int] | None = None,
) -> torch.Tensor:
    """`query_lens`: the host copy of query_start's differences, when the caller has it (no device sync)."""
    dtype = dtype or q.dtype
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    starts = query_start.tolist() if query_lens is None else [sum(query_lens[:i]) for i in range(len(query_lens) + 1)]
    for s in range(len(seq_lens)):
        length = int(seq_lens[s])
        start, end = starts[s], starts[s + 1]
        blocks = block_tables[s, : -(-length // block_size)]
        k = cached_kv(k_cache, k_scale, blocks, length, dtype).repeat_interleave(group, dim=1)
        v = cached_kv(v_cache, v_scale, blocks, length, dtype).repeat_interleave(group, dim=1)
        qs = q[start:end].to(dtype)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(length - (end - start), length, device=q.device)
        scores.masked_fill_(torch.arange(length, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out
