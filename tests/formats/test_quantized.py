"""The quantized-weight types: the settings they refuse, and dequantization against its definition."""

import pytest
import torch

from slimlm import SlimlmError
from slimlm.formats.quantized import QuantArgs, QuantizedWeight, group_index, scale_bytes, stored_scale


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 5}, "bits 5 is not supported; use one of 2, 3, 4, 8"),
        ({"group_size": 48}, "group_size 48 is not supported; use one of -1, 32, 64, 128 (-1 = per channel)"),
    ],
)
def test_unsupported_settings_name_the_flag_and_the_choices(kwargs, message):
    with pytest.raises(SlimlmError) as e:
        QuantArgs(**kwargs)
    assert str(e.value) == message


def test_code_range_is_signed():
    assert (QuantArgs(4).qmin, QuantArgs(4).qmax) == (-8, 7)
    assert (QuantArgs(2).qmin, QuantArgs(2).qmax) == (-2, 1)


def test_group_index_runs_of_group_size_or_the_given_g_idx():
    assert group_index(6, QuantArgs(4, -1)).tolist() == [0] * 6
    assert group_index(96, QuantArgs(4, 32)).tolist() == [0] * 32 + [1] * 32 + [2] * 32
    g = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    assert group_index(4, QuantArgs(4, 32), g).dtype == torch.int64
    assert group_index(4, QuantArgs(4, 32), g).tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False])
def test_dequantize_is_scale_times_code_minus_zero(dtype, sym):
    """x̂[r, c] = s[r, g(c)] · (z[r, c] − z0[r, g(c)]), element by element, in the scale's dtype."""
    torch.manual_seed(0)
    args = QuantArgs(4, 32, sym)
    codes = torch.randint(-8, 8, (3, 64), dtype=torch.int8)
    scale = torch.rand(3, 2).to(dtype) + 0.5
    zero = None if sym else torch.randint(-8, 8, (3, 2), dtype=torch.int8)
    g_idx = torch.randint(0, 2, (64,), dtype=torch.int32)
    for g in (None, g_idx):
        w = QuantizedWeight(codes, scale, zero, args, g).dequantize()
        assert w.dtype == dtype
        for r in range(3):
            for c in range(64):
                grp = c // 32 if g is None else int(g[c])
                z0 = 0 if zero is None else int(zero[r, grp])
                assert w[r, c] == (int(codes[r, c]) - z0) * scale[r, grp]
    assert QuantizedWeight(codes, scale, zero, args).dequantize(torch.float64).dtype == torch.float64


@pytest.mark.parametrize("bits", [4, 8])
def test_an_fp16_scale_dequantizes_to_fp32_exactly(bits):
    """fp16 scales of an fp32 model: the product is taken in fp32 (exact), as transformers and vLLM take it."""
    args = QuantArgs(bits, 32, False)
    codes = torch.randint(args.qmin, args.qmax + 1, (4, 64), dtype=torch.int8)
    scale = (torch.rand(4, 2) + 0.3).half()
    zero = torch.randint(args.qmin, args.qmax + 1, (4, 2), dtype=torch.int8)
    w = QuantizedWeight(codes, scale, zero, args).dequantize(torch.float32)
    exact = (codes.double() - zero.double().repeat_interleave(32, 1)) * scale.double().repeat_interleave(32, 1)
    assert w.dtype == torch.float32 and torch.equal(w.double(), exact)


def test_fp32_weights_store_fp16_scales_unless_one_is_outside_fp16s_normal_range():
    scale = torch.tensor([[2.0**-14, 0.1], [3.0, 65504.0]])
    stored = stored_scale(scale, torch.float32)
    assert stored.dtype == torch.float16 and torch.equal(stored.float(), scale.half().float())
    assert scale_bytes(torch.float32) == stored.element_size()
    for outside in (2.0**-14 * 0.99, 0.0, 65520.0):  # subnormal, zero, overflow: the codes' meaning kept
        odd = torch.tensor([[0.1, outside]])
        assert stored_scale(odd, torch.float32).dtype == torch.float32
    assert stored_scale(torch.empty(0, 1), torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_weights_store_scales_in_their_own_dtype(dtype):
    scale = torch.tensor([[1e-9, 0.1]])
    assert stored_scale(scale, dtype).dtype == dtype and scale_bytes(dtype) == 2
