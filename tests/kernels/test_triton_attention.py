import pytest
import torch

from slimlm.kernels import reference, triton_attention
from tests.kernels.problems import paged_problem, relative_error

# fp16 queries: scores and probabilities pass through fp16 dot products
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}

CASES = [  # heads, kv_heads, head_dim, kv dtype, query dtype
    (6, 2, 64, torch.float32, torch.float32),
    (4, 4, 32, torch.float16, torch.float16),
    (9, 3, 64, torch.int8, torch.float32),
    (9, 3, 64, torch.float8_e4m3fn, torch.float16),
    (8, 1, 48, torch.bfloat16, torch.float32),  # bf16 cache widened on load; head dim padded to 64
]


def check(problem):
    ref = reference.paged_attention(*problem.args(), dtype=torch.float64)
    out = triton_attention.paged_attention(*problem.args(), block_m=16)
    assert out.shape == problem.q.shape
    assert relative_error(out, ref) < TOLERANCE[problem.q.dtype]


@pytest.mark.parametrize("heads,kv_heads,head_dim,kv_dtype,q_dtype", CASES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(poisoned, heads, kv_heads, head_dim, kv_dtype, q_dtype, block_size):
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size + 7]  # ragged, partial last blocks
    check(paged_problem(seq_lens, [1] * 5, heads, kv_heads, head_dim, block_size, kv_dtype, q_dtype, seed=block_size))


@pytest.mark.parametrize("heads,kv_heads,head_dim,kv_dtype,q_dtype", CASES)
def test_varlen_prefill_matches_reference(poisoned, heads, kv_heads, head_dim, kv_dtype, q_dtype):
    # a whole prompt, a chunk after cached tokens, one decode token, a chunk longer than a query tile
    seq_lens, q_lens = [23, 50, 30, 41], [23, 20, 1, 37]
    check(paged_problem(seq_lens, q_lens, heads, kv_heads, head_dim, 16, kv_dtype, q_dtype, seed=heads))


def test_block_sizes_the_kernel_cannot_tile_are_refused():
    problem = paged_problem([9], [1], 2, 2, 32, block_size=8)
    with pytest.raises(ValueError, match="block size"):
        triton_attention.paged_attention(*problem.args())
