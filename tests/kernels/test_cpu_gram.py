import pytest
import torch

from slimlm.kernels import cpu_gram

pytestmark = pytest.mark.skipif(not cpu_gram.built(), reason="cpu_gram.c needs AVX-512 BF16")


def upper_tiles(n: int) -> torch.Tensor:
    tiles = torch.ones(n // 16, n // 16, dtype=torch.bool).triu()
    return tiles.repeat_interleave(16, 0).repeat_interleave(16, 1)


@pytest.mark.parametrize(("tokens", "width"), [(1, 16), (7, 32), (513, 48), (1200, 544)])
def test_the_gram_of_bf16_rows_against_float64_on_the_upper_tiles(tokens, width):
    """Products of bf16 numbers are exact and the sums fp32: within fp32's rounding of the float64 result, on
    every tile on and above the diagonal (an odd token count pairs the last one with zeros; 544 columns span
    three 256-column blocks and chunks of 256 token pairs); the tiles below are left as they were."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, width, generator=g).bfloat16()
    before = torch.randn(width, width, generator=g)
    out = before.clone()
    cpu_gram.add_gram(out, x, 0.25, 3.0)
    want = 3.0 * before.double() + 0.25 * (x.double().T @ x.double())
    up = upper_tiles(width)
    torch.testing.assert_close(out.double()[up], want[up], rtol=2e-6, atol=2e-6 * tokens)
    assert torch.equal(out[~up], before[~up])


def test_beta_zero_ignores_what_out_held_and_later_chunks_add_to_the_first():
    """beta 0 writes the first chunk's sums over NaN; the next chunks of 256 token pairs add to them."""
    x = torch.full((1200, 32), 1 + 2**-7).bfloat16()  # (1 + 2⁻⁷)² is not a bf16 number: the sums stay fp32
    out = torch.full((32, 32), float("nan"))
    cpu_gram.add_gram(out, x, 1.0, 0.0)
    torch.testing.assert_close(out[upper_tiles(32)].double(), torch.full((3 * 256,), 1200 * (1 + 2**-7) ** 2).double())


def test_it_applies_to_bf16_cpu_activations_of_whole_tiles_only():
    assert cpu_gram.applies(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert not cpu_gram.applies(torch.zeros(4, 40, dtype=torch.bfloat16))
    assert not cpu_gram.applies(torch.zeros(4, 32))
