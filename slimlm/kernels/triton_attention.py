"""Paged attention in Triton: a decode kernel and a varlen prefill kernel over the same block tables.

Shapes and meaning as in reference.paged_attention. Both kernels use an online softmax (running max and
sum), so a sequence's keys stream through once, one cache block at a time, in whatever order the block
table lists them. KV in fp8 e4m3 or int8 is widened in registers and multiplied by its per-head scale.

Decode is bound by KV bytes. One program serves one sequence and one KV head, and all query heads that
share that KV head (the GQA group, padded to 16 rows for tl.dot) read each key and value once.
Prefill (and chunked prefill) is bound by arithmetic: one program takes up to BLOCK_M consecutive queries of
one sequence for one query head; a host-side table maps programs to (sequence, first query).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimlm.kernels import reference


@triton.jit
def _load_kv(
    cache, scale_ptr, block, kvh, offs_t, t_ok, offs_d, d_ok, stride_b, stride_t, stride_h, HAS_SCALE: tl.constexpr
):
    """One cache block's keys or values for one KV head, [BLOCK_SIZE, HEAD_PAD] in fp32."""
    ptr = cache + block * stride_b + offs_t[:, None] * stride_t + kvh * stride_h + offs_d[None, :]
    kv = tl.load(ptr, t_ok[:, None] & d_ok[None, :], 0.0).to(tl.float32)
    if HAS_SCALE:
        kv = kv * tl.load(scale_ptr + kvh)
    return kv


@triton.jit
def _attend_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One online-softmax step: fold a block of keys/values into the running max, sum and output."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _attend_cached(
    q,
    pos,
    scale,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    table,
    length,
    end,
    kvh,
    offs_d,
    d_ok,
    stride_b,
    stride_t,
    stride_h,
    ROWS: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Attention of q's ROWS rows over one sequence's cached keys 0..end−1, block by block through its block
    table; row i sees the keys up to its absolute position pos[i]. Returns the unnormalised output and sums."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    offs_t = tl.arange(0, BLOCK_SIZE)
    for b in range(0, tl.cdiv(end, BLOCK_SIZE)):
        block = tl.load(table + b).to(tl.int64)
        key_pos = b * BLOCK_SIZE + offs_t
        t_ok = key_pos < length
        k = _load_kv(k_cache, k_scale, block, kvh, offs_t, t_ok, offs_d, d_ok, stride_b, stride_t, stride_h, HAS_SCALE)
        v = _load_kv(v_cache, v_scale, block, kvh, offs_t, t_ok, offs_d, d_ok, stride_b, stride_t, stride_h, HAS_SCALE)
        visible = t_ok[None, :] & (key_pos[None, :] <= pos[:, None])
        m_i, l_i, acc = _attend_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE)
    return acc, l_i


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    k_scale,
    v_scale,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_b,
    stride_t,
    stride_h,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(seq_lens + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], g_ok[:, None] & d_ok[None, :])
    pos = tl.zeros([GROUP_PAD], tl.int32) + length - 1  # every head of the group queries the last position
    acc, l_i = _attend_cached(
        q,
        pos,
        scale,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables + seq * stride_bt,
        length,
        length,
        kvh,
        offs_d,
        d_ok,
        stride_b,
        stride_t,
        stride_h,
        GROUP_PAD,
        HEAD_PAD,
        BLOCK_SIZE,
        HAS_SCALE,
        IEEE,
    )
    out = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, acc / l_i[:, None], g_ok[:, None] & d_ok[None, :])


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start,
    tiles,
    k_scale,
    v_scale,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_b,
    stride_t,
    stride_h,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    seq = tl.load(tiles + 2 * tile)
    first = tl.load(tiles + 2 * tile + 1)  # index of the tile's first query within its sequence
    length = tl.load(seq_lens + seq)
    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    offs_m = first + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    pos = length - q_len + offs_m  # absolute position of each query
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = q_ptr + (q_begin + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, m_ok[:, None] & d_ok[None, :], 0.0)
    last = tl.minimum(length - q_len + first + BLOCK_M, length)  # keys past the tile's last query are unseen
    acc, l_i = _attend_cached(
        q,
        pos,
        scale,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables + seq * stride_bt,
        length,
        last,
        kvh,
        offs_d,
        d_ok,
        stride_b,
        stride_t,
        stride_h,
        BLOCK_M,
        HEAD_PAD,
        BLOCK_SIZE,
        HAS_SCALE,
        IEEE,
    )
    l_i = tl.where(m_ok, l_i, 1.0)
    out = out_ptr + (q_begin + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out, acc / l_i[:, None], m_ok[:, None] & d_ok[None, :])


def _common(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> dict:
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton attention kernels need a power-of-two block size >= 16, got {block_size}")
    return dict(
        GROUP=q.shape[1] // kv_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        HAS_SCALE=k_scale is not None,
        IEEE=q.dtype == torch.float32,
    )


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
    block_m: int = 64,
    query_lens: list[int] | None = None,
) -> torch.Tensor:
    if k_cache.dtype == torch.uint8:  # 4-bit rows: not in these kernels yet; the PyTorch definition reads them
        return reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, query_lens=query_lens
        )
    out = torch.empty_like(q)
    num_seqs = len(seq_lens)
    meta = _common(q, k_cache, k_scale)
    strides = (*q.stride()[:2], *k_cache.stride()[:3], block_tables.stride(0), *out.stride()[:2])
    assert k_cache.stride() == v_cache.stride()
    if q.shape[0] == num_seqs:  # one query per sequence: decode
        group = meta["GROUP"]
        _decode_kernel[(num_seqs, k_cache.shape[2])](
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            k_scale,
            v_scale,
            out,
            scale,
            *strides,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            **meta,
        )
        return out
    q_lens = query_lens if query_lens is not None else (query_start[1:] - query_start[:-1]).tolist()
    tiles = torch.tensor(
        [(s, first) for s, n in enumerate(q_lens) for first in range(0, n, block_m)], dtype=torch.int32
    ).to(q.device)
    _prefill_kernel[(tiles.shape[0], q.shape[1])](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start,
        tiles,
        k_scale,
        v_scale,
        out,
        scale,
        *strides,
        BLOCK_M=block_m,
        **meta,
    )
    return out
