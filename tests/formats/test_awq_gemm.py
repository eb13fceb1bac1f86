"""AutoAWQ's GEMM layout read back against its definition, written out here element by element:
w[i, o] = scales[g, o] · (q[i, o] − zeros[g, o]), g = i // group, nibble j of each int32 holding column
8c + ORDER[j]. The order is spelled out, not imported: the test must not share the reader's."""

import pytest
import torch

from slimlm import SlimlmError
from slimlm.formats import awq_gemm
from slimlm.formats.quantized import QuantArgs, QuantizedWeight

AUTOAWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq_gemm(codes_u: torch.Tensor) -> torch.Tensor:
    """[rows, cols] unsigned 4-bit -> int32 [rows, cols/8], nibble j = column 8c + ORDER[j] (AutoAWQ's rule)."""
    rows, cols = codes_u.shape
    grouped = codes_u.reshape(rows, cols // 8, 8).to(torch.int64)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j, col in enumerate(AUTOAWQ_ORDER):
        packed |= grouped[:, :, col] << (4 * j)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_tensors(in_f: int, out_f: int, group: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """Random AWQ GEMM tensors (every code 0..15 and the top nibble set, so int32 signs matter) and the
    float weight [out, in] they stand for, computed one element at a time."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (in_f, out_f), generator=g)
    q[0, :8] = 15  # a word whose top bit is set: a negative int32
    zeros = torch.randint(0, 16, (in_f // group, out_f), generator=g)
    scales = torch.rand(in_f // group, out_f, generator=g).half() + 0.01
    w = torch.empty(out_f, in_f)
    for i in range(in_f):
        for o in range(out_f):
            w[o, i] = scales[i // group, o].float() * (q[i, o] - zeros[i // group, o]).float()
    return {"qweight": pack_awq_gemm(q), "qzeros": pack_awq_gemm(zeros), "scales": scales}, w


@pytest.mark.parametrize("in_f, out_f, group", [(64, 16, 32), (128, 24, 64), (256, 8, 128)])
def test_tensors_read_back_to_the_documented_weight(in_f, out_f, group):
    t, w = awq_tensors(in_f, out_f, group)
    q = awq_gemm.from_tensors(t, QuantArgs(4, group, sym=False), "proj")
    assert q.codes.shape == (out_f, in_f) and q.zero.shape == (out_f, in_f // group)
    assert q.codes.dtype == torch.int8 and q.codes.is_contiguous() and q.scale.is_contiguous()
    assert int(q.codes.min()) >= -8 and int(q.codes.max()) <= 7  # the signed convention of compressed-tensors
    assert q.scale.dtype == torch.float16 and q.g_idx is None  # scales as stored; multiplied out in fp32 below
    assert torch.equal(QuantizedWeight(q.codes, q.scale.float(), q.zero, q.args).dequantize(), w)


def test_unpack_columns_undoes_the_interleave():
    codes = torch.arange(16).repeat(3, 2)  # [3, 32]: each row 0..15 twice
    got = awq_gemm.unpack_columns(pack_awq_gemm(codes))
    assert torch.equal(got, (codes - 8).to(got.dtype))


@pytest.mark.parametrize(
    "qcfg, args",
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "GEMM"},
            QuantArgs(4, 64, False),
        ),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 32}, QuantArgs(4, 32, False)),  # AutoAWQ's own keys
        ({"quant_method": "awq", "bits": 4}, QuantArgs(4, 128, False)),  # AutoAWQ's defaults: gemm, 128, zeros
        ({"bits": 4, "w_bit": 8, "group_size": 32, "q_group_size": 64}, QuantArgs(4, 32, False)),  # HF keys first
    ],
    ids=["explicit", "autoawq-keys", "defaults", "hf-keys-first"],
)
def test_config_read_with_autoawq_defaults(qcfg, args):
    assert awq_gemm.args_from_config(qcfg) == args


@pytest.mark.parametrize(
    "qcfg, message",
    [
        (
            {"bits": 4, "version": "gemv"},
            "AWQ checkpoint (version gemv, 4-bit, zero_point=None) is not supported; slimlm reads AWQ GEMM 4-bit "
            "with zero points",
        ),
        ({"bits": 8}, "AWQ checkpoint (version gemm, 8-bit, zero_point=None) is not supported"),
        ({"bits": 4, "zero_point": False}, "AWQ checkpoint (version gemm, 4-bit, zero_point=False) is not supported"),
        ({"bits": 4, "group_size": 16}, "AWQ group_size=16: slimlm reads 32, 64 or 128"),
        ({"bits": 4, "group_size": "64"}, "AWQ group_size='64': slimlm reads 32, 64 or 128"),
        ({"bits": 4, "group_size": 64.0}, "AWQ group_size=64.0: slimlm reads 32, 64 or 128"),
        ({"bits": 4, "q_group_size": 256}, "AWQ group_size=256: slimlm reads 32, 64 or 128"),
    ],
    ids=["gemv", "8-bit", "no-zero-point", "group-16", "group-str", "group-float", "q-group-256"],
)
def test_config_refusals_say_what_is_read(qcfg, message):
    with pytest.raises(SlimlmError) as e:
        awq_gemm.args_from_config(qcfg)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("key", ["qweight", "qzeros", "scales"])
def test_a_missing_tensor_is_named(key):
    t, _ = awq_tensors(64, 16, 32)
    del t[key]
    with pytest.raises(SlimlmError) as e:
        awq_gemm.from_tensors(t, QuantArgs(4, 32, False), "m.proj")
    assert str(e.value) == f"the checkpoint has no m.proj.{key}"


@pytest.mark.parametrize(
    "key, shape, wanted",
    [
        ("qzeros", (3, 2), [2, 2]),  # one group too many
        ("qzeros", (2, 3), [2, 2]),
        ("scales", (2, 8), [2, 16]),  # fewer outputs than the codes: the shapes must agree
        ("qweight", (64, 3), [64, 2]),
    ],
)
def test_a_misshapen_tensor_is_named(key, shape, wanted):
    t, _ = awq_tensors(64, 16, 32)
    t[key] = torch.zeros(shape, dtype=t[key].dtype)
    if key == "scales":  # scales set the output width: the others are then judged against 8 outputs
        key, wanted = "qweight", [64, 1]
    with pytest.raises(SlimlmError) as e:
        awq_gemm.from_tensors(t, QuantArgs(4, 32, False), "proj")
    assert str(e.value) == f"proj.{key} is {list(t[key].shape)}, the quantization_config implies {wanted}"


@pytest.mark.parametrize("key, shape", [("qweight", (64,)), ("scales", (256,)), ("qzeros", (2, 2, 1)), ("scales", ())])
def test_a_tensor_that_is_not_a_matrix_is_named(key, shape):
    t, _ = awq_tensors(64, 16, 32)
    t[key] = torch.zeros(shape, dtype=t[key].dtype)
    with pytest.raises(SlimlmError) as e:
        awq_gemm.from_tensors(t, QuantArgs(4, 32, False), "proj")
    assert str(e.value) == f"proj.{key} is {list(shape)}; AWQ GEMM tensors are 2-D"


def test_inputs_that_the_group_does_not_divide_are_refused():
    t, _ = awq_tensors(64, 16, 32)
    t["qweight"] = torch.zeros(80, 2, dtype=torch.int32)  # 80 inputs: 2 groups of 32 and a remainder
    with pytest.raises(SlimlmError) as e:
        awq_gemm.from_tensors(t, QuantArgs(4, 32, False), "proj")
    assert str(e.value) == "proj: group_size 32 does not divide its input dim 80"
