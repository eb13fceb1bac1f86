"""Paged attention on CPU. Same contract as reference.paged_attention.

Decoding sequences (one query each) are done together: by the C kernel (cpu_attention.c) for fp32, bf16, 8-bit
(int8, fp8 e4m3, per-head scales) and 4-bit caches, which reads K and V in place through the block table (a 4-bit
cache's rotation is applied to the queries and the outputs, outside the kernel); otherwise in
PyTorch with one gather of their blocks into a padded [S, L, Hkv, D] tensor, two batched matmuls and a masked
softmax. bf16 prompt chunks (several queries) go to the C flash-attention kernel in one call for all sequences
(AVX-512 builds, the same caches); fp32 ones to the decode kernel, a query at a time, so that a query's sums
run in one order however its prompt was split (batch invariance); otherwise one sequence at a time in
PyTorch, causal mask included. GQA is a
reshape of the queries to [Hkv, group, ...] that broadcasts against the KV heads, never a copy of K and V per
query head.
"""

from __future__ import annotations

import torch

from slimlm.formats import kv_int4
from slimlm.kernels import cpu_library
from slimlm.kernels.reference import cached_kv, dequantized


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, native) -> torch.Tensor:
    """q [S, Hq, D], one query per sequence at its last position -> [S, Hq, D]."""
    s, heads, dim = q.shape
    if native and _native_applies(q, k_cache, k_scale):
        return _decode_native(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :blocks].long().clamp(min=0)  # entries past a sequence's blocks are masked below
    k, v = _gathered(k_cache, table, q.dtype), _gathered(v_cache, table, q.dtype)  # [Hkv, S, L, D]
    # Per-head KV scales are applied to the query and to the output instead of to K and V
    # (q·(s·k) = (s·q)·k, Σ p·(s·v) = s·Σ p·v): a pass over K and V saved.
    qg = q.view(s, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [Hkv, S, group, D]
    if k_scale is not None:
        qg = qg * k_scale.to(q.dtype)[:, None, None, None]
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale  # [Hkv, S, group, L]
    unseen = torch.arange(k.shape[2], device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(unseen[None, :, None, :], float("-inf"))
    # Slots past a sequence's end hold whatever the pool held (never written): a zero weight times a NaN
    # there is NaN, so they are zeroed, not just given zero weight (only the tails: cheap).
    for i, length in enumerate(seq_lens.tolist()):
        v[:, i, length:] = 0
    out = torch.matmul(scores.softmax(-1), v)  # [Hkv, S, group, D]
    if v_scale is not None:
        out = out * v_scale.to(q.dtype)[:, None, None, None]
    return out.transpose(0, 1).reshape(s, heads, dim)


def _gathered(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `table` [S, blocks] lists, as one contiguous [Hkv, S, L, D] in `dtype`: whole blocks are
    gathered (one contiguous row each), then laid out head-major for the batched matmuls, one head at a time.
    Measured on CPU (8 x 4096 tokens, fp32): 3.3 ms, against 10-15 ms for a transposed gather or a 4-D permute
    copy; an 8-bit cache gathers its bytes and widens them after, a 4-bit one decodes its rows after."""
    s, blocks = table.shape
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, table.flatten())
    kv = rows.view(s, blocks * cache.shape[1], cache.shape[2], cache.shape[3])  # [S, L, Hkv, D or row bytes]
    return dequantized(torch.stack([kv[:, :, h] for h in range(cache.shape[2])]), None, dtype)


def kernel_takes(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the C kernel covers this attention shape (cpu_attention.c's MAX_HEADS, MAX_DIM; the AVX2
    twin's MAX_GROUP)."""
    return head_dim % 16 == 0 and head_dim <= 256 and heads <= 128 and heads // kv_heads <= 16


VERIFY_MAX_ROWS = 16  # a sequence with at most this many new tokens is attended a query at a time (decode kernel)
# What the C kernels take a cache as (slimlm_kernels.h's KIND_*): fp32, bf16, 8-bit codes with per-head scales, or
# 4-bit rows (formats.kv_int4; decode only)
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3, torch.uint8: 4}
EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)


def _native_applies(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    return (
        k_cache.dtype in KINDS
        and (k_scale is None or k_cache.dtype in EIGHT_BIT)
        and k_cache.is_contiguous()
        and kernel_takes(q.shape[1], k_cache.shape[2], q.shape[2])
        and (k_cache.dtype != torch.uint8 or q.shape[2] % 32 == 0)
    )  # 4-bit: 16 code bytes a step


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """The per-head scales as the C kernels take them: fp32 pointers, 0 (NULL) for none; and the tensors, which
    must outlive the call."""
    held = [None if x is None else x.to(torch.float32).contiguous() for x in (k_scale, v_scale)]
    return tuple(0 if x is None else x.data_ptr() for x in held), held


def _decode_native(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale) -> torch.Tensor:
    qf = q.to(torch.float32).contiguous()
    rotation = kv_int4.rotation(q.shape[2]) if k_cache.dtype == torch.uint8 else None
    if rotation is not None:  # 4-bit rows hold k·H and v·H: q·k = (q·H)·(k·H), Σ p·v = (Σ p·(v·H))·Hᵀ
        qf = qf @ rotation
    tables, lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(qf)
    (ks, vs), _held = _scales(k_scale, v_scale)
    status = cpu_library.load().slimlm_paged_decode(
        qf.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        KINDS[k_cache.dtype],
        ks,
        vs,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        q.shape[0],
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        int(cpu_library.has_amx()),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged decode attention could not allocate its score buffers")
    return (out if rotation is None else out @ rotation.T).to(q.dtype)


def _prefill_native_applies(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    return (
        _native_applies(q, k_cache, k_scale)
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.is_contiguous()
        and hasattr(cpu_library.load(), "slimlm_paged_prefill")
    )


def _prefill_native(
    q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, k_scale, v_scale, out
) -> torch.Tensor:
    """The prompt chunks' rows of `out` (its decode rows already written) by the C flash kernel, one call. The
    sequences are query_start's (block_tables and seq_lens may hold more rows: they are not read). Over 4-bit
    rows the kernel attends in their rotated space, in fp32: queries rotated in, its rows rotated back out."""
    if k_cache.dtype != torch.uint8:
        return _prefill_call(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, k_scale, v_scale, out)
    rotation = kv_int4.rotation(q.shape[2])
    rotated = _prefill_call(
        (q.float() @ rotation).contiguous(),
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start,
        scale,
        None,
        None,
        torch.empty(q.shape, dtype=torch.float32),
    )
    lens, starts = (query_start[1:] - query_start[:-1]).tolist(), query_start.tolist()
    rows = [r for s, n in enumerate(lens) if n > VERIFY_MAX_ROWS for r in range(starts[s], starts[s] + n)]
    out[rows] = (rotated[rows] @ rotation.T).to(out.dtype)
    return out


def _prefill_call(
    q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, k_scale, v_scale, out
) -> torch.Tensor:
    tables, lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    starts = query_start.to(torch.int32).contiguous()
    (ks, vs), _held = _scales(k_scale, v_scale)
    status = cpu_library.load().slimlm_paged_prefill(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(q.dtype == torch.bfloat16),
        KINDS[k_cache.dtype],
        ks,
        vs,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        starts.data_ptr(),
        starts.numel() - 1,
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        VERIFY_MAX_ROWS,
        int(cpu_library.has_amx()),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged prefill attention could not allocate its buffers")
    return out


def _prefill(q, k_cache, v_cache, blocks, length, scale, k_scale, v_scale) -> torch.Tensor:
    """q [n, Hq, D], the last n tokens of one sequence of `length` cached tokens -> [n, Hq, D]."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k = cached_kv(k_cache, k_scale, blocks, length, q.dtype).permute(1, 2, 0)  # [Hkv, D, L]
    v = cached_kv(v_cache, v_scale, blocks, length, q.dtype).transpose(0, 1)  # [Hkv, L, D]
    qg = q.view(n, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)  # [Hkv, group, n, D]
    scores = torch.matmul(qg, k[:, None]) * scale  # [Hkv, group, n, L]
    pos = torch.arange(length - n, length, device=q.device)
    scores.masked_fill_(torch.arange(length, device=q.device)[None, :] > pos[:, None], float("-inf"))
    out = torch.matmul(scores.softmax(-1), v[:, None])  # [Hkv, group, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, heads, dim)


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
    native: bool = True,
    query_lens: list[int] | None = None,
) -> torch.Tensor:
    """`native`: use the C kernel where it applies (fp32 or bf16 cache, no KV scales, head_dim a multiple of 16)."""
    q_lens = query_lens if query_lens is not None else (query_start[1:] - query_start[:-1]).tolist()
    if all(n == 1 for n in q_lens):
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, native)
    out = torch.empty_like(q)
    # Rows attended one query at a time, by the decode kernel: single tokens, and the few tokens of a draft's
    # verification, each against the cache up to itself, so that they get the bits a plain decode step would
    # (AVX2's int8 loop rounds activations: a last-bit difference upstream can flip a greedy token). In fp32 every
    # prompt row too, where the kernel applies: a query's sums then run in one order however its prompt was split
    # (a prefix-cache hit, chunked prefill, the batch), so its KV and logits are the same bits (batch invariance).
    per_query = native and q.dtype == torch.float32 and _native_applies(q, k_cache, k_scale)
    starts, lengths = query_start.tolist(), seq_lens.tolist()
    decoding, rows, lens = [], [], []
    for s, n in enumerate(q_lens):
        if n <= VERIFY_MAX_ROWS or per_query:
            decoding.append(s)
            rows += range(starts[s], starts[s] + n)
            lens += range(lengths[s] - n + 1, lengths[s] + 1)
    if decoding:
        rows_t = torch.tensor(rows, device=q.device)
        seqs = torch.tensor([s for s in decoding for _ in range(q_lens[s])], device=q.device)
        out[rows_t] = _decode(
            q[rows_t],
            k_cache,
            v_cache,
            block_tables[seqs],
            torch.tensor(lens, dtype=seq_lens.dtype, device=q.device),
            scale,
            k_scale,
            v_scale,
            native,
        )
    if len(decoding) == len(q_lens):
        return out
    if native and _prefill_native_applies(q, k_cache, k_scale):
        return _prefill_native(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, k_scale, v_scale, out)
    block_size = k_cache.shape[1]
    for s, n in enumerate(q_lens):
        if n > VERIFY_MAX_ROWS:
            start, length = starts[s], lengths[s]
            blocks = block_tables[s, : -(-length // block_size)]
            out[start : start + n] = _prefill(
                q[start : start + n], k_cache, v_cache, blocks, length, scale, k_scale, v_scale
            )
    return out
