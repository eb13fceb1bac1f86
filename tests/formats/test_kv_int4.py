"""The 4-bit KV rows against their definition (formats/kv_int4.py), written out element by element."""

import pytest
import torch

from slimlm.formats import kv_int4


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_the_rotation_is_an_orthonormal_signed_hadamard_matrix(dim):
    h = kv_int4.rotation(dim)
    assert torch.allclose(h @ h.T, torch.eye(dim), atol=1e-6)
    assert torch.equal(h.abs(), torch.full((dim, dim), dim**-0.5))
    sylvester = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(dim)] for i in range(dim)])
    signs = h * dim**0.5 / sylvester  # each column of Sylvester's matrix times one sign
    assert torch.equal(signs, signs[:1].expand(dim, dim)) and 0 < (signs[0] < 0).sum() < dim
    assert torch.equal(h, kv_int4.rotation(dim))  # fixed: a cache is read with the H it was written with
    with pytest.raises(ValueError, match="power-of-two head dimension, not 48"):
        kv_int4.rotation(48)


def test_rows_hold_the_rotated_vector_rounded_to_16_levels_then_step_and_minimum():
    dim = 64
    x = torch.randn(3, 5, dim) * torch.linspace(0.1, 8, dim)  # channels of different size, as keys have
    rows = kv_int4.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 5, kv_int4.row_bytes(dim)) == (3, 5, 36)
    y = (x.double() @ kv_int4.rotation(dim).double()).flatten(0, 1)
    for r, row in zip(y, rows.flatten(0, 1), strict=True):
        lo = r.min().half()
        step = ((r.max() - lo.double()) / 15).half()
        codes = [min(15, max(0, round(float((v - float(lo)) / float(step))))) for v in r]
        expected = [codes[j] | codes[j + dim // 2] << 4 for j in range(dim // 2)]
        assert row[: dim // 2].tolist() == expected
        assert row[dim // 2 :].view(torch.float16).tolist() == [float(step), float(lo)]


def test_reading_a_row_back_is_codes_times_step_plus_minimum_rotated_back():
    dim = 32
    x = torch.randn(7, dim) * 3
    rows = kv_int4.quantize(x)
    step, lo = rows[:, dim // 2 :].contiguous().view(torch.float16).float().unbind(-1)
    codes = torch.stack(
        [
            torch.tensor([(int(b) >> (4 * (j >= dim // 2))) & 15 for j, b in enumerate(list(row[: dim // 2]) * 2)])
            for row in rows
        ]
    ).float()
    expected = (codes * step[:, None] + lo[:, None]) @ kv_int4.rotation(dim).T
    got = kv_int4.dequantize(rows, torch.float64)
    assert got.dtype == torch.float64 and torch.allclose(got, expected.double(), atol=1e-5)
    # the error of each rotated value is at most half a step (rounding to the nearest level)
    err = (got.float() - x) @ kv_int4.rotation(dim)
    assert (err.abs() <= step[:, None] / 2 + 1e-3).all()


def test_a_constant_row_reads_back_exactly_and_a_zero_row_is_zero():
    h = kv_int4.rotation(16)
    const = torch.full((1, 16), 0.25) @ h.T  # rotates to the constant 0.25: step 0
    assert torch.allclose(kv_int4.dequantize(kv_int4.quantize(const), torch.float32), const, atol=1e-6)
    assert torch.equal(kv_int4.dequantize(kv_int4.quantize(torch.zeros(2, 16)), torch.float32), torch.zeros(2, 16))
    assert kv_int4.head_dim(torch.zeros(4, 2, kv_int4.row_bytes(128), dtype=torch.uint8)) == 128


def test_an_offset_is_subtracted_before_the_rotation_and_never_added_back():
    x, mu = torch.randn(5, 2, 32) * 4, torch.randn(2, 32) * 100
    assert torch.equal(kv_int4.quantize(x, mu), kv_int4.quantize(x - mu))
    # a large constant part (a key bias) takes the whole range unless subtracted: 4 bits then say little else
    x = x + mu
    centered = kv_int4.dequantize(kv_int4.quantize(x, mu), torch.float32) + mu
    plain = kv_int4.dequantize(kv_int4.quantize(x), torch.float32)
    assert (centered - x).norm() * 10 < (plain - x).norm()
