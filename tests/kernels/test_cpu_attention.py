import dataclasses

import pytest
import torch

from slimlm.kernels import cpu_attention, cpu_library, reference
from tests.kernels.problems import Spy, paged_problem, relative_error, torch_threads

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,kv_dtype,q_dtype",
    [
        (6, 2, 64, torch.float32, torch.float32),
        (4, 4, 128, torch.float32, torch.float32),
        (9, 3, 64, torch.int8, torch.float32),
        (9, 3, 64, torch.float8_e4m3fn, torch.float32),
        (9, 3, 64, torch.uint8, torch.float32),  # 4-bit rows
        (4, 2, 128, torch.uint8, torch.bfloat16),
        (8, 8, 48, torch.bfloat16, torch.bfloat16),
        (9, 3, 64, torch.bfloat16, torch.bfloat16),  # bf16 cache in the C kernel
        (9, 3, 64, torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize(
    "seq_lens,q_lens",
    [
        ([1, 5, 16, 17, 55], [1, 1, 1, 1, 1]),  # all decoding: the batched path
        ([23, 50, 30, 41, 9], [23, 20, 1, 37, 1]),  # prompts, a chunk after cached tokens, decodes mixed in
    ],
    ids=["decode", "mixed"],
)
@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch"])
def test_matches_reference(poisoned, heads, kv_heads, head_dim, kv_dtype, q_dtype, seq_lens, q_lens, native):
    if native and not cpu_library.available():
        pytest.skip("needs gcc and AVX-512 or AVX2")
    p = paged_problem(seq_lens, q_lens, heads, kv_heads, head_dim, 16, kv_dtype, q_dtype, seed=len(seq_lens))
    out = cpu_attention.paged_attention(*p.args(), native=native)
    assert out.shape == p.q.shape and out.dtype == q_dtype
    assert relative_error(out, reference.paged_attention(*p.args(), dtype=torch.float64)) < TOLERANCE[q_dtype]


@pytest.mark.skipif(not cpu_library.available(), reason="needs gcc and AVX-512 or AVX2")
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize(
    "seq_lens", [[70], [3, 40, 33, 16, 1, 90], [1, 300, 129]], ids=["one-task", "a-task-per-sequence", "parts"]
)
@pytest.mark.parametrize("head_dim,kv_dtype", [(64, torch.bfloat16), (128, torch.float32), (48, torch.bfloat16)])
@pytest.mark.parametrize("amx", [True, False])
def test_c_kernel_over_other_block_sizes(poisoned, monkeypatch, block_size, seq_lens, head_dim, kv_dtype, amx):
    """Keys go 16 tokens at a time whatever the block size (a run of 16 spans blocks of 8, or half of 32).
    On two threads: six sequences are a task each; three, one of them long, split into two parts each (the
    one-token sequence into a token and an empty part), merged after. bf16 with head_dim 64 and blocks of
    32 takes the scores from the tile unit where the CPU has one (amx)."""
    if amx and not cpu_library.has_amx():
        pytest.skip("needs AMX (e.g. Sapphire Rapids)")
    monkeypatch.setattr(cpu_library, "has_amx", lambda: amx)
    p = paged_problem(seq_lens, [1] * len(seq_lens), 8, 2, head_dim, block_size, kv_dtype, kv_dtype, seed=block_size)
    with torch_threads(2):
        out = cpu_attention.paged_attention(*p.args(), native=True)
    assert relative_error(out, reference.paged_attention(*p.args(), dtype=torch.float64)) < TOLERANCE[kv_dtype]


@pytest.mark.skipif(not cpu_library.available(), reason="needs gcc and AVX-512 or AVX2")
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 3, 16), (128, 6, 8), (32, 1, 32)])
def test_c_kernel_reads_4bit_rows_in_place(poisoned, head_dim, group, block_size):
    """A 4-bit cache's decodes go to the C kernel (queries and outputs rotated around it), split into parts on
    two threads for one long sequence, and match the definition; a head dimension not a multiple of 32 takes PyTorch."""
    p = paged_problem([300, 17, 1], [1, 1, 1], 2 * group, 2, head_dim, block_size, torch.uint8, torch.float32)
    assert cpu_attention._native_applies(p.q, p.k_cache, p.k_scale)
    for seqs, threads in ((slice(None), 1), (slice(0, 1), 2)):
        args = list(p.args())
        args[0], args[3], args[4], args[5] = (
            p.q[seqs],
            p.block_tables[seqs],
            p.seq_lens[seqs],
            torch.arange(len(p.seq_lens[seqs]) + 1, dtype=torch.int32),
        )
        with torch_threads(threads):
            out = cpu_attention.paged_attention(*args, native=True)
        # step·(q·codes) and lo·Σq are summed apart and partly cancel: fp32 rounding up to ~1.1e-5 measured
        assert relative_error(out, reference.paged_attention(*args, dtype=torch.float64)) < 3e-5
    p = paged_problem([40], [1], 4, 2, 16, kv_dtype=torch.uint8, q_dtype=torch.float32)
    assert not cpu_attention._native_applies(p.q, p.k_cache, p.k_scale)


def test_c_kernel_takes_fp32_decodes():
    p = paged_problem([40, 7], [1, 1], 8, 2, 64, kv_dtype=torch.float32, q_dtype=torch.float32)
    assert cpu_attention._native_applies(p.q, p.k_cache, p.k_scale)
    p = paged_problem([40, 7], [1, 1], 8, 2, 40, kv_dtype=torch.float32, q_dtype=torch.float32)
    assert not cpu_attention._native_applies(p.q, p.k_cache, p.k_scale)  # head_dim not a multiple of 16


@pytest.mark.skipif(
    not (cpu_library.available() and hasattr(cpu_library.load(), "slimlm_paged_prefill")),
    reason="needs the AVX-512 kernels",
)
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize(
    "head_dim,kv_dtype,dtype",
    [
        (64, torch.bfloat16, torch.bfloat16),
        (128, torch.bfloat16, torch.bfloat16),
        (128, torch.float32, torch.float32),
        (48, torch.bfloat16, torch.bfloat16),
        (64, torch.int8, torch.bfloat16),
        (64, torch.float8_e4m3fn, torch.bfloat16),
        (64, torch.float8_e4m3fn, torch.float32),
        (64, torch.uint8, torch.float32),
        (128, torch.uint8, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("amx", [True, False])
def test_c_prompt_kernel_in_one_call(poisoned, monkeypatch, block_size, head_dim, kv_dtype, dtype, amx):
    """bf16 prompt chunks go to the C flash kernel in one call on two threads: tiles of 16 queries with ragged
    tails, a chunk of 70 after 100 cached tokens (keys 16 or 32 at a time across blocks of 8 or 32), a decode
    mixed in (the decode kernel's), and every slot past a sequence's end NaN. bf16 queries with head_dim 64 or
    128 and a bf16 or 8-bit cache run on the tile unit where the CPU has one (amx), and on the AVX-512 loops
    otherwise (4-bit rows always: in fp32, in their rotated space). fp32 queries, every row of them, go to the
    decode kernel in one call (batch invariance: cpu_attention.paged_attention)."""
    if amx and not cpu_library.has_amx():
        pytest.skip("needs AMX (e.g. Sapphire Rapids)")
    monkeypatch.setattr(cpu_library, "has_amx", lambda: amx)
    p = paged_problem([170, 37, 9, 16], [70, 37, 1, 16], 8, 2, head_dim, block_size, kv_dtype, dtype, seed=block_size)
    spy = Spy(cpu_library.load())
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    with torch_threads(2):
        out = cpu_attention.paged_attention(*p.args(), native=True)
    per_query = dtype == torch.float32
    assert spy.calls.count("slimlm_paged_prefill") == (0 if per_query else 1)
    assert spy.calls.count("slimlm_paged_decode") == 1
    assert relative_error(out, reference.paged_attention(*p.args(), dtype=torch.float64)) < TOLERANCE[dtype]


def test_prompt_chunks_are_query_starts_sequences(poisoned):
    """Block tables and lengths may list more sequences than query_start has queries for (a step's view of
    a larger batch): only query_start's are read, whatever lies past its end."""
    p = paged_problem([40, 30], [20, 30], 8, 2, 64, 16, torch.float32, torch.float32, seed=3)
    backing = torch.tensor([0, 20, 50, 10**6], dtype=torch.int32)  # a huge "next start" right past the view
    args = list(p.args())
    args[5] = backing[:2]  # one sequence: the first 20 queries
    out = cpu_attention.paged_attention(p.q[:20], *args[1:], native=True)
    first = reference.paged_attention(
        p.q[:20], p.k_cache, p.v_cache, p.block_tables[:1], p.seq_lens[:1], backing[:2], p.scale, dtype=torch.float64
    )
    assert relative_error(out, first) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("march", ["native", "skylake-avx512", "haswell"])
@pytest.mark.parametrize("bf16_queries", [False, True])
def test_c_kernel_widens_every_8bit_code(monkeypatch, kv_dtype, march, bf16_queries):
    """One cached token, so the output is the scaled value itself: a head of 256 values that are every code
    (fp8's two NaN codes, which quantized_kv never writes, as zero), in each ISA's build; with queries exact in
    bf16 (a bf16 model's), the values go through the bf16 dot product (a weight of 1 is exact there too)."""
    if not cpu_library.available() or (march != "native" and not cpu_library.has_bf16_gemm()):
        pytest.skip("needs the C kernels (and, for the other ISAs' builds, a CPU that runs them all)")
    lib = cpu_library.load(march)
    spy = Spy(lib)
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    p = paged_problem([1], [1], 2, 1, 256, 16, kv_dtype, torch.float32)
    if bf16_queries:
        p = dataclasses.replace(p, q=p.q.bfloat16().float())
    p.v_cache.view(torch.uint8)[p.block_tables[0, 0]] = codes
    out = cpu_attention.paged_attention(*p.args(), native=True)
    assert spy.calls.count("slimlm_paged_decode") == 1
    expected = codes.view(kv_dtype).float() * p.v_scale[0]
    assert torch.equal(out[0, 0], expected) and torch.equal(out[0, 1], expected)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("amx", [True, False])
def test_8bit_cache_with_queries_exact_in_bf16(poisoned, monkeypatch, kv_dtype, amx):
    """A bf16 model's queries with an 8-bit cache: the keys widened exactly to bf16 for the tile unit's scores
    (amx), or to fp32 for the vector loops; the values through the bf16 dot product with the weights rounded
    to bf16 (hence bf16's tolerance); a long sequence split into parts."""
    if amx and not cpu_library.has_amx():
        pytest.skip("needs AMX (e.g. Sapphire Rapids)")
    monkeypatch.setattr(cpu_library, "has_amx", lambda: amx)
    p = paged_problem([300, 17, 1], [1, 1, 1], 9, 3, 64, 16, kv_dtype, torch.float32, seed=7)
    p = dataclasses.replace(p, q=p.q.bfloat16().float())
    spy = Spy(cpu_library.load())
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    with torch_threads(2):
        out = cpu_attention.paged_attention(*p.args(), native=True)
    assert spy.calls.count("slimlm_paged_decode") == 1
    assert relative_error(out, reference.paged_attention(*p.args(), dtype=torch.float64)) < 1e-3  # measured 4e-4


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_a_drafts_verification_rows_get_the_bits_of_decode_steps(native, kv_dtype):
    """A sequence with a few new tokens (a draft's k + 1) is attended a query at a time, each against the
    cache up to itself, so every row equals bit for bit what a one-token decode step at that position gives:
    on AVX2 the int8 loop rounds activations, and a last-bit difference here flipped greedy tokens (speculative
    output then differed from plain). Longer chunks (prompts) keep the flash kernel."""
    if native and not cpu_library.available():
        pytest.skip("needs gcc and AVX-512 or AVX2")
    n, length = 5, 37
    p = paged_problem([length, 60], [n, 30], 6, 2, 64, 16, kv_dtype, torch.float32, seed=3)
    out = cpu_attention.paged_attention(*p.args(), native=native)
    for i in range(n):  # row i: position length - n + i, after length - n + i + 1 cached tokens
        one = dataclasses.replace(
            p,
            q=p.q[i : i + 1].contiguous(),
            block_tables=p.block_tables[:1],
            seq_lens=torch.tensor([length - n + i + 1], dtype=p.seq_lens.dtype),
            query_start=torch.tensor([0, 1], dtype=p.query_start.dtype),
        )
        assert torch.equal(out[i], cpu_attention.paged_attention(*one.args(), native=native)[0]), i
    assert relative_error(out, reference.paged_attention(*p.args(), dtype=torch.float64)) < 1e-5
