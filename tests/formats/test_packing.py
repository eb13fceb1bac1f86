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
