import pytest
import torch

from slimlm.kernels import cpu_gram, cpu_library

pytestmark = pytest.mark.skipif(not cpu_gram.built(), reason="cpu_gram.c needs AVX-512 BF16")


@pytest.fixture(params=["vector", "tiles"])
def unit(request, monkeypatch):
    """Which loop sums: the bf16 dot-product unit's (as a CPU without AMX runs it) or the AMX tile unit's."""
    if request.param == "vector":
        monkeypatch.setattr(cpu_library, "has_amx", lambda: False)
    elif not cpu_library.has_amx():
        pytest.skip("needs AMX (e.g. Sapphire Rapids)")
    return request.param


def upper_tiles(n: int) -> torch.Tensor:
    tiles = torch.ones(n // 16, n // 16, dtype=torch.bool).triu()
    return tiles.repeat_interleave(16, 0).repeat_interleave(16, 1)


@pytest.mark.parametrize(("tokens", "width"), [(1, 16), (7, 32), (513, 48), (1200, 544), (45, 96)])
def test_the_gram_of_bf16_rows_against_float64_on_the_upper_tiles(unit, tokens, width):
    """Products of bf16 numbers are exact and the sums fp32: within fp32's rounding of the float64 result, on
    every tile on and above the diagonal (an odd token count pairs the last one with zeros, a count short of
    whole tile steps with zero tokens; 544 columns span three 256-column blocks and 1200 tokens three chunks);
    the tiles below are left as they were. Widths of whole 32-column blocks go to the tile unit where it is."""
    assert cpu_gram.uses_amx(width) == (unit == "tiles" and width % 32 == 0)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, width, generator=g).bfloat16()
    before = torch.randn(width, width, generator=g)
    out = before.clone()
    cpu_gram.add_gram(out, x, 0.25, 3.0)
    want = 3.0 * before.double() + 0.25 * (x.double().T @ x.double())
    up = upper_tiles(width)
    torch.testing.assert_close(out.double()[up], want[up], rtol=2e-6, atol=2e-6 * tokens)
    assert torch.equal(out[~up], before[~up])


def test_beta_zero_ignores_what_out_held_and_later_chunks_add_to_the_first(unit):
    """beta 0 writes the first chunk's sums over NaN; the next chunks (of 512 tokens) add to them."""
    x = torch.full((1200, 32), 1 + 2**-7).bfloat16()  # (1 + 2⁻⁷)² is not a bf16 number: the sums stay fp32
    out = torch.full((32, 32), float("nan"))
    cpu_gram.add_gram(out, x, 1.0, 0.0)
    torch.testing.assert_close(out[upper_tiles(32)].double(), torch.full((3 * 256,), 1200 * (1 + 2**-7) ** 2).double())


def test_it_applies_to_bf16_cpu_activations_of_whole_tiles_only():
    assert cpu_gram.applies(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert not cpu_gram.applies(torch.zeros(4, 40, dtype=torch.bfloat16))
    assert not cpu_gram.applies(torch.zeros(4, 32))
