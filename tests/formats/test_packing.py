import pytest
import torch

from slimlm.formats.packing import CHUNK_ELEMENTS, pack_int32, unpack_int32


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_matrix_packed_in_several_chunks_round_trips(bits, dim):
    """More rows than one chunk of CHUNK_ELEMENTS holds (packing goes a few rows at a time): every row is
    packed, once, and unpacks to the same int8 codes."""
    rows, cols = 4 * CHUNK_ELEMENTS // 512, 512
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (rows, cols), generator=g, dtype=torch.int8)
    codes = codes.T.contiguous() if dim == 0 else codes
    packed = pack_int32(codes, bits, dim)
    n_words = cols * bits // 32
    assert packed.dtype == torch.int32 and packed.shape == ((n_words, rows) if dim == 0 else (rows, n_words))
    back = unpack_int32(packed, bits, cols, dim)
    assert back.dtype == torch.int8 and torch.equal(back, codes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [64, 61])
def test_4_and_8_bit_words_unpack_in_bytes_as_the_bit_stream_defines(bits, n):
    """Any int32 words (negative ones too) unpack to the codes at bits [i·b, (i+1)·b) of each row, minus the
    offset, whether read as bytes (4 and 8 bits) or as 64-bit pairs (every width): the two paths agree."""
    from slimlm.formats.packing import _unpack_rows

    g = torch.Generator().manual_seed(n)
    words = torch.randint(-(2**31), 2**31, (5, -(-n * bits // 32)), generator=g, dtype=torch.int64).to(torch.int32)
    bit = [(int(w) >> j) & 1 for row in words for w in row for j in range(32)]
    per_row = words.shape[1] * 32
    expected = [
        [sum(bit[r * per_row + i * bits + j] << j for j in range(bits)) - 2 ** (bits - 1) for i in range(n)]
        for r in range(5)
    ]
    assert unpack_int32(words, bits, n).tolist() == expected
    assert _unpack_rows(words, bits, n).tolist() == expected
    assert unpack_int32(words.T.contiguous(), bits, n, dim=0).T.tolist() == expected
