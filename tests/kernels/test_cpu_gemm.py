import pytest
import torch

from slimlm.kernels import cpu_gemm, cpu_library, reference
from tests.kernels.problems import quantized_weight, relative_error

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="needs gcc and AVX-512 or AVX2")


@pytest.mark.parametrize(
    "bits,group_size,sym,act_order,n,k",
    [
        (4, 64, False, False, 192, 576),
        (4, 32, True, True, 70, 96),
        (8, -1, True, False, 130, 72),
        (8, 128, False, True, 64, 256),
    ],
)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11])
def test_fused_gemm_matches_reference(poisoned, bits, group_size, sym, act_order, n, k, m):
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=m)
    x = torch.randn(m, k)
    ref = reference.quant_matmul(x.double(), w)
    out = cpu_gemm.quant_matmul(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_error(out, ref) < 1e-5  # fp32 accumulation


@pytest.mark.parametrize("m", [3, cpu_gemm.FUSED_MAX_ROWS_BF16 + 1, 40])
def test_bf16_rows_take_either_path_within_bf16_error(poisoned, m):
    _, w = quantized_weight(1100, 128, 4, 64, sym=False, seed=m)  # > SLICE_BLOCKS blocks, ragged last slice
    x = torch.randn(m, 128).bfloat16()
    out = cpu_gemm.quant_matmul(x, w)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference.quant_matmul(x.double(), w)) < 1e-2  # bf16 has 8 mantissa bits
