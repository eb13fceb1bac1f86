import pytest
import torch

from slimlm.kernels import reference, triton_gemm
from tests.kernels.problems import quantized_weight, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # fp16: operands and output rounded to 11 bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "bits,group_size,sym,act_order,m,n,k",
    [
        (4, 32, False, False, 1, 64, 128),
        (4, 64, True, True, 5, 100, 192),
        (8, -1, True, False, 17, 130, 72),
        (8, 32, False, True, 3, 64, 96),
        (4, -1, False, False, 33, 70, 40),
        (2, 32, False, False, 2, 64, 128),  # widened to the 4-bit layout
        (3, 32, True, True, 4, 64, 96),
    ],
)
def test_gemm_matches_reference(poisoned, dtype, bits, group_size, sym, act_order, m, n, k):
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=m + n)
    x = torch.randn(m, k).to(dtype)
    ref = reference.quant_matmul(x.double(), w)
    for launch in (None, (16, 32, 1), (16, 32, 3)):  # the heuristic, one program along K, split-K
        out = triton_gemm.quant_matmul(x, w, launch)
        assert out.shape == (m, n) and out.dtype == dtype
        assert relative_error(out, ref) < TOLERANCE[dtype], launch


def test_decode_splits_k_and_prefill_does_not():
    assert triton_gemm.config(1, 4096, 64)[2] > 1
    assert triton_gemm.config(512, 4096, 64)[2] == 1
