"""The C residual-add + RMSNorm and rotary + KV-write against their PyTorch definitions (reference.py): the
rotary kernel equal bit for bit in fp32 and bf16, the norm within the last bit of an fp32 reduction."""

import pytest
import torch

from slimlm.kernels import cpu_layer, cpu_library, reference

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the CPU kernels cannot be built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 576), (3, 64), (40, 96)])  # 40 rows: split among threads
def test_add_rms_norm_matches_the_reference(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    expected, expected_h = reference.add_rms_norm(x, weight, 1e-5, residual)
    kept = residual.clone()
    out, h = cpu_layer.add_rms_norm(x, weight, 1e-5, residual)
    assert h is residual and torch.equal(h, expected_h)  # the sum, rounded as torch rounds, written in place
    assert torch.equal(expected_h, x + kept)
    exact = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    exact = exact.to(dtype).double() * weight.double()  # normalized, rounded to dtype, then scaled
    bound = 2 * (2**-23 if dtype == torch.float32 else 2**-7) * exact.abs().max()  # two units in the last place
    assert (out.double() - exact).abs().max() <= bound and (expected.double() - exact).abs().max() <= bound
    alone, same = cpu_layer.add_rms_norm(x, weight, 1e-5)  # no residual: x is the stream
    reference_alone = reference.add_rms_norm(x, weight, 1e-5)[0].double()
    assert same is x and (alone.double() - reference_alone).abs().max() <= 2 * bound


def test_add_rms_norm_eps_and_weight_count():
    x = torch.full((2, 8), 1e-3)
    weight = torch.arange(1, 9, dtype=torch.float32)
    for eps in (1e-6, 1e-2):
        out, _ = cpu_layer.add_rms_norm(x, weight, eps)
        assert torch.allclose(out, weight * 1e-3 / (1e-6 + eps) ** 0.5 * torch.ones(2, 1), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (5, 4, 4, 32), (3, 8, 2, 128)])
def test_rotary_kv_write_equals_the_reference_bit_for_bit(dtype, rows, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(rows + heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    cos, sin = torch.randn(rows, dim, generator=g).to(dtype), torch.randn(rows, dim, generator=g).to(dtype)
    blocks, block_size = 4, 4
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    caches = [torch.full((blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    expected = reference.rotary_kv_write(qkv, cos, sin, slots, caches[0], caches[1])
    got = cpu_layer.rotary_kv_write(qkv, cos, sin, slots, caches[2], caches[3])
    assert got.shape == (rows, heads, dim) and got.dtype == dtype and torch.equal(got, expected)
    for ref, ours in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ref.nan_to_num(7.0), ours.nan_to_num(7.0))  # same slots written, the rest untouched
    assert int(caches[2].isnan().any(-1).any(-1).sum()) == blocks * block_size - rows


def test_what_the_c_code_does_not_cover_runs_the_reference():
    qkv, cos, sin = torch.randn(2, 3 * 16, dtype=torch.float16), torch.randn(2, 16), torch.randn(2, 16)
    caches = [torch.zeros(2, 4, 1, 16, dtype=torch.float16) for _ in range(2)]
    slots = torch.tensor([0, 5])
    q = cpu_layer.rotary_kv_write(qkv, cos.half(), sin.half(), slots, *caches)
    assert torch.equal(q, reference.rotate(qkv[:, :16].view(2, 1, 16), cos.half()[:, None], sin.half()[:, None]))
    scale = torch.tensor([0.1])
    int8 = [torch.zeros(2, 4, 1, 16, dtype=torch.int8) for _ in range(2)]
    cpu_layer.rotary_kv_write(qkv.float(), cos, sin, slots, *int8, scale, scale)
    assert torch.equal(
        int8[1].view(-1, 1, 16)[slots], reference.quantized_kv(qkv[:, 32:].float().view(2, 1, 16), scale, torch.int8)
    )
    strided = torch.randn(2, 16)[:, ::2]
    out, h = cpu_layer.add_rms_norm(strided, torch.ones(8), 1e-6)
    assert torch.equal(out, reference.add_rms_norm(strided, torch.ones(8), 1e-6)[0])
