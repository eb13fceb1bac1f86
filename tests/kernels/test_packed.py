import pytest
import torch

from slimlm import SlimlmError
from slimlm.compress.quantize import quantize_rtn
from slimlm.formats.quantized import SUPPORTED_BITS, QuantArgs
from slimlm.kernels import packed, reference
from tests.kernels.problems import quantized_weight, relative_error


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", [-1, 32, 64])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_repacked_weight_is_the_checkpoint_weight(bits, group_size, sym, act_order):
    q, p = quantized_weight(100, 192, bits, group_size, sym, act_order, seed=bits + group_size)
    q.scale = q.scale.half().float()  # the layout keeps fp16 scales; everything else is exact
    x = torch.randn(3, 192, dtype=torch.float64)
    expected = x @ q.dequantize(torch.float64).T
    assert p.out_features == 100 and p.padded_out_features == 128 and p.bits == packed.SERVED_BITS[bits]
    assert relative_error(reference.quant_matmul(x, p), expected) < 1e-12


def test_four_bit_codes_take_half_a_byte():
    _, p = quantized_weight(128, 256, 4, 64, sym=False)
    assert p.codes.shape == (2, 256, 32) and p.codes.dtype == torch.uint8
    assert p.nbytes() == 128 * 256 // 2 + 128 * 4 * 3  # codes + fp16 scales + uint8 zeros


def test_ragged_groups_are_refused():
    q = quantize_rtn(torch.randn(64, 64), QuantArgs(4, 32, True))
    q.g_idx = torch.zeros(64, dtype=torch.int32)  # every column in group 0: not equal groups
    with pytest.raises(SlimlmError) as e:
        packed.pack(q)
    assert str(e.value) == "g_idx does not split the input columns into equal groups; cannot repack this weight"


@pytest.mark.parametrize("act_order", [False, True])
def test_to_a_device_keeps_every_field(act_order):
    _, p = quantized_weight(70, 128, 4, 64, sym=False, act_order=act_order)
    moved = p.to("cpu")
    for field in ("codes", "scales", "zeros", "perm"):
        a, b = getattr(p, field), getattr(moved, field)
        assert (a is None and b is None) or (b.device.type == "cpu" and torch.equal(a, b))
    assert (moved.bits, moved.group_size, moved.out_features) == (p.bits, p.group_size, p.out_features) == (4, 64, 70)
    assert (moved.perm is None) == (not act_order)


def test_dense_weights_pack_as_bf16_pairs_in_blocks():
    weight = torch.randn(70, 96).bfloat16()
    p = packed.pack_dense(weight)
    assert (p.bits, p.out_features, p.padded_out_features, p.in_features) == (16, 70, 128, 96)
    assert p.codes.shape == (2, 96, 64) and p.nbytes() == 128 * 96 * 2  # no scales or zeros
    pairs = p.codes.reshape(2, 48, 64, 2)
    assert torch.equal(pairs[1, 5, 3], weight[64 + 3, 10:12])  # block 1, inputs 10 and 11 of feature 67
    assert torch.equal(pairs[1, :, 6:].float(), torch.zeros(48, 58, 2))  # padding features
    assert torch.equal(packed.dequantize(p, torch.bfloat16)[:70], weight)
    x = torch.randn(3, 96, dtype=torch.float64)
    assert relative_error(reference.quant_matmul(x, p), x @ weight.double().T) < 1e-12
    with pytest.raises(SlimlmError) as e:
        packed.pack_dense(torch.randn(4, 5).bfloat16())
    assert str(e.value) == "a bf16 weight packs in pairs of inputs; 5 inputs is odd"


def test_dense_fp32_weights_pack_k_major_in_blocks():
    weight = torch.randn(70, 5)
    p = packed.pack_dense(weight)
    assert (p.bits, p.out_features, p.padded_out_features, p.in_features) == (32, 70, 128, 5)
    assert p.codes.shape == (2, 5, 64) and p.codes[1, 3, 5] == weight[69, 3] and p.codes[1, :, 6:].abs().sum() == 0
    assert torch.equal(packed.dequantize(p)[:70], weight)
