"""The plain PyTorch definitions every kernel is held to, checked against definitions that share nothing with
them: attention over each sequence's K/V laid out contiguously (no blocks), the weight as the checkpoint's
codes dequantize it, and the KV-cache rounding rules written element by element."""

import pytest
import torch

from slimlm.formats import kv_int4
from slimlm.kernels import reference
from tests.kernels.problems import paged_problem, quantized_weight


def contiguous_attention(p, dtype=torch.float64) -> torch.Tensor:
    """Causal attention per sequence over its first seq_len cache slots, gathered block by block, GQA by
    mapping query head h to KV head h // group, one query at a time."""
    block_size, kv_heads = p.k_cache.shape[1], p.k_cache.shape[2]
    group = p.q.shape[1] // kv_heads
    out = torch.zeros(p.q.shape, dtype=dtype)
    for s in range(len(p.seq_lens)):
        n, start, end = int(p.seq_lens[s]), int(p.query_start[s]), int(p.query_start[s + 1])
        slots = [int(p.block_tables[s, i // block_size]) * block_size + i % block_size for i in range(n)]
        k, v = (
            kv_int4.dequantize(c.flatten(0, 1)[slots], dtype)
            if c.dtype == torch.uint8
            else c.flatten(0, 1)[slots].to(dtype)
            for c in (p.k_cache, p.v_cache)
        )
        if p.k_scale is not None:
            k, v = k * p.k_scale.to(dtype)[:, None], v * p.v_scale.to(dtype)[:, None]
        for i in range(start, end):
            pos = n - (end - start) + (i - start)  # the query's own position: it sees keys 0..pos
            for h in range(p.q.shape[1]):
                scores = (k[: pos + 1, h // group] @ p.q[i, h].to(dtype)) * p.scale
                out[i, h] = scores.softmax(0) @ v[: pos + 1, h // group]
    return out


@pytest.mark.parametrize(
    "seq_lens, q_lens, heads, kv_heads, kv_dtype",
    [
        ([20, 7, 33], [4, 7, 1], 4, 2, torch.float32),  # a whole prompt, a chunk, a decode; GQA 2
        ([16, 1], [16, 1], 3, 3, torch.float16),  # block-aligned, a one-token sequence, MHA
        ([40, 9], [3, 2], 6, 2, torch.int8),  # scaled caches, GQA 3
        ([17], [5], 2, 1, torch.float8_e4m3fn),
        ([30, 12], [30, 1], 4, 2, torch.uint8),  # 4-bit rows
        ([9, 5], [2, 5], 8, 4, torch.float32),
    ],  # more KV heads than slots in a block (block_size 2 below)
)
def test_paged_attention_equals_attention_over_contiguous_kv(seq_lens, q_lens, heads, kv_heads, kv_dtype):
    block_size = 2 if kv_heads == 4 else 8
    p = paged_problem(
        seq_lens, q_lens, heads, kv_heads, 16, block_size=block_size, kv_dtype=kv_dtype, q_dtype=torch.float32
    )
    expected = contiguous_attention(p)
    got = reference.paged_attention(*p.args(), dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    # the host copy of the query lengths gives the same answer as query_start
    assert torch.equal(reference.paged_attention(*p.args(), dtype=torch.float64, query_lens=q_lens), got)
    # without `dtype` it computes in q's dtype
    assert reference.paged_attention(*p.args()).dtype == torch.float32


@pytest.mark.parametrize(
    "bits, group, sym, act_order", [(4, 32, True, False), (8, -1, False, False), (4, 32, False, True)]
)
def test_quant_matmul_is_x_times_the_dequantized_weight(bits, group, sym, act_order):
    q, w = quantized_weight(72, 96, bits, group, sym, act_order=act_order)  # 72 outputs: the pack pads to 128
    q.scale = q.scale.half().float()  # the kernel layout keeps fp16 scales
    x = torch.randn(5, 96, dtype=torch.float64)
    expected = x @ q.dequantize(torch.float64).T
    got = reference.quant_matmul(x, w)
    assert got.shape == (5, 72) and got.dtype == torch.float64 and torch.allclose(got, expected, rtol=0, atol=1e-12)
    got32 = reference.quant_matmul(x.float(), w, torch.float64)  # computed in the given dtype
    assert got32.dtype == torch.float64 and torch.allclose(got32, x.float().double() @ q.dequantize(torch.float64).T)


def test_a_float_cache_takes_kv_as_it_is():
    kv = torch.randn(5, 2, 8)
    assert torch.equal(reference.quantized_kv(kv, None, torch.float16), kv.half())
    assert torch.equal(reference.dequantized(kv.half(), None, torch.float32), kv.half().float())


def test_int8_cache_rounds_to_nearest_and_clamps_per_head():
    scale = torch.tensor([0.5, 0.25])
    kv = torch.tensor([[[0.74, -0.76, 63.6, -200.0]], [[0.1, -0.13, 31.9, 40.0]]]).transpose(0, 1)  # [1, 2, 4]
    stored = reference.quantized_kv(kv, scale, torch.int8)
    assert stored.dtype == torch.int8
    assert stored[0].tolist() == [[1, -2, 127, -127], [0, -1, 127, 127]]  # x / s, rounded, within ±127
    assert torch.equal(
        reference.dequantized(stored, scale, torch.float32)[0],
        torch.tensor([[0.5, -1.0, 63.5, -63.5], [0.0, -0.25, 31.75, 31.75]]),
    )


def test_fp8_cache_rounds_to_nearest_fp8_and_saturates():
    scale = torch.tensor([2.0])
    kv = torch.tensor([[[3.0, 17.0, 1000.0, -1e6, 1e-3]]]).transpose(1, 2).reshape(1, 1, 5)
    stored = reference.quantized_kv(kv, scale, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn
    # 3/2 = 1.5 exact; 17/2 = 8.5 lies between fp8 values 8 and 9 (ties to even: 8); 500 and -5e5 saturate at ±448
    assert stored.float().flatten().tolist()[:4] == [1.5, 8.0, 448.0, -448.0]
    assert reference.dequantized(stored, scale, torch.float32).flatten()[2] == 896.0


def test_an_8bit_cache_stores_keys_less_their_offset():
    """(kv − offset) / scale, per KV head and channel, then rounded as without one."""
    scale, offset = torch.tensor([2.0, 0.5]), torch.tensor([[300.0, -1.0], [0.0, 40.0]])  # [Hkv, D]
    kv = torch.tensor([[[303.0, -18.0], [0.75, 40.5]]])  # [1, Hkv, D]
    fp8 = reference.quantized_kv(kv, scale, torch.float8_e4m3fn, offset)
    assert fp8.float().tolist() == [[[1.5, -8.0], [1.5, 1.0]]]  # 3/2, -17/2 (a tie: to even), 0.75/0.5, 0.5/0.5
    assert reference.quantized_kv(kv, scale, torch.int8, offset).tolist() == [[[2, -8], [2, 1]]]  # ties to even
    assert fp8.float().tolist() != reference.quantized_kv(kv, scale, torch.float8_e4m3fn).float().tolist()


def test_cached_kv_reads_a_sequence_through_its_block_table():
    cache = torch.arange(4 * 2 * 1 * 1, dtype=torch.float32).reshape(4, 2, 1, 1)  # 4 blocks of 2 slots
    got = reference.cached_kv(cache, None, torch.tensor([3, 0, 2], dtype=torch.int32), 5, torch.float64)
    assert got.dtype == torch.float64 and got.flatten().tolist() == [6, 7, 0, 1, 4]


def test_bf16_queries_over_a_scaled_cache_compute_in_bf16():
    p = paged_problem([20, 7], [4, 1], 4, 2, 16, kv_dtype=torch.int8, q_dtype=torch.bfloat16)
    got = reference.paged_attention(*p.args())
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), contiguous_attention(p), atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_transformers_rmsnorm_after_the_residual_add(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual = torch.randn(2, 3, 24).to(dtype), torch.randn(2, 3, 24).to(dtype)
    norm = LlamaRMSNorm(24, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(24) + 0.5).to(dtype)
    out, h = reference.add_rms_norm(x, norm.weight.data, 1e-5, residual)
    assert torch.equal(h, x + residual) and out.dtype == dtype
    assert torch.allclose(out.float(), norm(h).float(), rtol=1e-5 if dtype == torch.float32 else 1e-2)
    alone, same = reference.add_rms_norm(x, norm.weight.data, 1e-5)
    assert same is x and torch.allclose(alone.float(), norm(x).float(), rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_rotary_kv_write_rotates_q_and_k_and_quantizes_each_with_its_scale():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, dim = 4, 2, 8
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    angle = torch.rand(3, dim // 2).repeat(1, 2)
    cos, sin = angle.cos(), angle.sin()
    signed_sin = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1)
    caches = [torch.zeros(2, 4, kv_heads, dim, dtype=torch.int8) for _ in range(2)]
    k_scale, v_scale = torch.tensor([0.02, 0.03]), torch.tensor([0.01, 0.05])
    slots = torch.tensor([6, 0, 3])
    q = reference.rotary_kv_write(qkv, cos, signed_sin, slots, *caches, k_scale, v_scale)
    q_in = qkv[:, : heads * dim].view(1, 3, heads, dim).transpose(1, 2)  # transformers' [B, H, T, D]
    k_in = qkv[:, heads * dim : (heads + kv_heads) * dim].view(1, 3, kv_heads, dim).transpose(1, 2)
    q_hf, k_hf = apply_rotary_pos_emb(q_in, k_in, cos[None], sin[None])
    assert torch.allclose(q, q_hf[0].transpose(0, 1), atol=1e-6)
    k_stored = caches[0].view(-1, kv_heads, dim)[slots]
    assert torch.equal(k_stored, reference.quantized_kv(k_hf[0].transpose(0, 1), k_scale, torch.int8))
    v = qkv[:, (heads + kv_heads) * dim :].view(3, kv_heads, dim)
    assert torch.equal(caches[1].view(-1, kv_heads, dim)[slots], reference.quantized_kv(v, v_scale, torch.int8))
    assert int((caches[0] != 0).any(-1).any(-1).sum()) <= 3  # nothing written outside the three slots
