"""The C residual-add + RMSNorm and rotary + KV-write against their PyTorch definitions (reference.py): the
rotary kernel equal bit for bit in fp32 and bf16, the norm within the last bit of an fp32 reduction."""

import pytest
import torch

from slimlm.formats import kv_int4
from slimlm.kernels import cpu_layer, cpu_library, reference
from tests.kernels.problems import torch_threads

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
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(expected_h, x + kept)
    exact = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    exact = exact.to(dtype).double() * weight.double()  # normalized, rounded to dtype, then scaled
    bound = 2 * (2**-23 if dtype == torch.float32 else 2**-7) * exact.abs().max()  # two units in the last place
    assert (out.double() - exact).abs().max() <= bound and (expected.double() - exact).abs().max() <= bound
    if dtype == torch.bfloat16:  # the normalized value rounded before the weight scales it, as torch does:
        assert (out != expected).float().mean() < 0.01  # only a last-bit fp32 difference can change a bf16
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
@pytest.mark.parametrize("rows, width", [(1, 1536), (37, 40)])  # 37 rows: split between the threads
def test_silu_mul_matches_the_reference(dtype, rows, width):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    expected = reference.silu_mul(gate_up)
    with torch_threads(2):
        got = cpu_layer.silu_mul(gate_up)
    assert got.shape == (rows, width) and got.dtype == dtype
    exact = torch.nn.functional.silu(gate_up[:, :width].double()) * gate_up[:, width:].double()
    if dtype == torch.float32:  # exp within a few units in the last place of torch's, as torch's is of exact
        assert (got.double() - exact).abs().max() <= 8 * 2**-23 * exact.abs().max()
    else:  # silu rounded to bf16 before the product, as torch rounds it: a last-bit exp difference rarely shows
        assert (got != expected).float().mean() < 0.01
        assert (got.double() - expected.double()).abs().max() <= 2**-7 * expected.double().abs().max()


FP32_U = 2.0**-24  # fp32's unit roundoff


def log_softmax_bound(depth: float, exact: torch.Tensor) -> float:
    """Worst-case |error| of an fp32 x − max − log Σ e^(x − max) against the exact value: a sum of positive
    terms added `depth` deep (sequentially in a lane, then a tree over lanes), each e^x within 2 ulps, is off by
    at most (depth + 2)·u relatively, which log turns into an absolute error; then the result's two roundings
    (of max + log Σ and of x minus it), each at most u·|value|."""
    return (depth + 2) * FP32_U + 2 * FP32_U * exact.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (7, 151936), (3, 5000)])  # 5000: no whole 2048-term part
def test_row_logprobs_against_float64(dtype, rows, vocab):
    """log p(target) and the largest log p within the fp32 rounding the kernel's order of additions allows
    (parts of 2048 terms, 256 deep in each of AVX2's 8 lanes, the fewest any build has, then 3 levels of tree;
    the parts added in fp64) of the float64 log-softmax; the most likely token the first of equal ones
    (argmax's), here a tie planted in each row. The reference is torch's own fp32 log-softmax, which on AVX2
    sums the whole row in one vector of 8 lanes (152K terms: 18,992 deep, measured 2.9e-5 off there) and
    only that bound holds for it on every CPU."""
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    for r in range(rows):
        first, second = sorted(torch.randint(0, vocab, (2,), generator=g).tolist())
        logits[r, first] = logits[r, second] = logits[r].max() + 1
    targets = torch.randint(0, vocab, (rows,), generator=g)
    exact = torch.log_softmax(logits.double(), dim=-1)
    exact_chosen, exact_best = exact.gather(-1, targets[:, None])[:, 0], exact.max(-1).values
    chosen, best, best_ids = cpu_layer.row_logprobs(logits, targets)
    kernel = log_softmax_bound(2048 / 8 + 3, exact_chosen)
    torch.testing.assert_close(chosen.double(), exact_chosen, rtol=0, atol=kernel)
    torch.testing.assert_close(best.double(), exact_best, rtol=0, atol=kernel)
    assert torch.equal(best_ids, logits.float().argmax(-1))
    ref = reference.row_logprobs(logits, targets)
    assert torch.equal(ref[2], best_ids)
    assert (ref[0].double() - exact_chosen).abs().max() <= log_softmax_bound(vocab / 8 + 3, exact_chosen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("centered", [False, True], ids=["", "keys-less-offset"])
def test_8bit_kv_writes_equal_the_reference_bit_for_bit(dtype, kv_dtype, rows, centered):
    """Keys (less their offsets, when given) and values quantized as quantized_kv does (divided, clamped,
    rounded to nearest even): values from far below fp8's smallest subnormal to far past its largest normal,
    and int8's ties. fp8 keys and q are rotated (formats.kv_cache.key_rotation), the sums in another order than
    torch's: q within fp32 rounding, a key on a rounding boundary may take the neighbouring code."""
    heads, kv_heads, dim = 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    magnitude = torch.exp2(torch.randint(-14, 12, (rows, (heads + 2 * kv_heads) * dim), generator=g).float())
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * magnitude).to(dtype)
    qkv[0, -dim:] = torch.arange(dim) / 2 - 16  # halves: ties for int8 with a scale of 1
    cos, sin = torch.randn(rows, dim, generator=g).to(dtype), torch.randn(rows, dim, generator=g).to(dtype)
    k_scale, v_scale = torch.rand(kv_heads, generator=g) + 0.5, torch.tensor([1.0, 0.7, 1.3])
    slots = torch.randperm(64, generator=g)[:rows]
    offset = torch.randn(kv_heads, dim, generator=g) * 100 if centered else None
    caches = [torch.zeros(8, 8, kv_heads, dim, dtype=kv_dtype) for _ in range(4)]
    expected = reference.rotary_kv_write(qkv, cos, sin, slots, caches[0], caches[1], k_scale, v_scale, offset)
    with torch_threads(2):
        got = cpu_layer.rotary_kv_write(qkv, cos, sin, slots, caches[2], caches[3], k_scale, v_scale, offset)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))  # values
    if kv_dtype == torch.int8:
        assert torch.equal(got, expected) and torch.equal(caches[0], caches[2])
        return
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, expected, rtol=rtol, atol=1e-6 * expected.float().abs().max().item())
    ref, ours = (c.view(torch.uint8).int() for c in (caches[0], caches[2]))  # e4m3 codes: neighbours differ by 1
    off = (ref - ours).abs()
    assert off.max() <= 1 and (off > 0).float().mean() <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, dim", [(1, 9, 3, 64), (5, 4, 4, 32), (3, 8, 2, 128), (20, 3, 1, 64)])
def test_rotary_kv_write_equals_the_reference_bit_for_bit(dtype, rows, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(rows + heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    cos, sin = torch.randn(rows, dim, generator=g).to(dtype), torch.randn(rows, dim, generator=g).to(dtype)
    blocks, block_size = 8, 4
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    caches = [torch.full((blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype) for _ in range(4)]
    expected = reference.rotary_kv_write(qkv, cos, sin, slots, caches[0], caches[1])
    with torch_threads(2):  # 20 rows: split between the threads
        got = cpu_layer.rotary_kv_write(qkv, cos, sin, slots, caches[2], caches[3])
    assert got.shape == (rows, heads, dim) and got.dtype == dtype and torch.equal(got, expected)
    for ref, ours in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ref.nan_to_num(7.0), ours.nan_to_num(7.0))  # same slots written, the rest untouched
    assert int(caches[2].isnan().any(-1).any(-1).sum()) == blocks * block_size - rows


@pytest.fixture
def reference_calls(monkeypatch):
    """Records every fallback to the PyTorch definitions (and still runs them)."""
    calls = []
    for name in ("add_rms_norm", "rotary_kv_write", "row_logprobs"):
        original = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, _f=original, _n=name: calls.append((_n, a)) or _f(*a))
    return calls


def rotary_problem(dtype=torch.float32, rows=2, heads=2, kv_heads=1, dim=16):
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    cos, sin = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    caches = [torch.zeros(2, 4, kv_heads, dim, dtype=dtype) for _ in range(2)]
    return qkv, cos, sin, torch.tensor([0, 5])[:rows], caches


def test_the_c_path_runs_for_flat_fp32_and_bf16(reference_calls):
    for dtype in (torch.float32, torch.bfloat16):
        qkv, cos, sin, slots, caches = rotary_problem(dtype)
        cpu_layer.rotary_kv_write(qkv, cos, sin, slots, *caches)
        x = torch.randn(2, 3, 8).to(dtype)  # any leading shape: rows are what precedes the last dim
        out, h = cpu_layer.add_rms_norm(x, torch.ones(8, dtype=dtype), 1e-6, torch.zeros(2, 3, 8, dtype=dtype))
        assert torch.equal(h, x) and out.shape == x.shape
        normed = (x.double() * x.double().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()).to(dtype)
        assert torch.allclose(out.double(), normed.double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert reference_calls == []


def test_scored_rows_take_the_c_path_when_flat_and_the_reference_otherwise(reference_calls):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1000, generator=g)
    targets = torch.tensor([5, 999, 0], dtype=torch.int32)  # any integer dtype: the C code reads int64
    exact = torch.log_softmax(logits.double(), -1)[torch.arange(3), targets.long()]
    for dtype in (torch.float32, torch.bfloat16):
        chosen, _, best_ids = cpu_layer.row_logprobs(logits.to(dtype), targets)
        tolerance = 2e-5 if dtype == torch.float32 else 0.1
        assert (chosen.double() - exact).abs().max() < tolerance and torch.equal(best_ids, logits.argmax(-1))
    assert reference_calls == []
    for name, args in {
        "fp16": (logits.half(), targets),
        "strided": (torch.randn(3, 2000, generator=g)[:, ::2], targets),
        "3-d": (logits[None], targets[None]),
    }.items():
        reference_calls.clear()
        cpu_layer.row_logprobs(*args)
        assert [c[0] for c in reference_calls] == ["row_logprobs"], name
        assert all(a is b for a, b in zip(reference_calls[0][1], args, strict=True)), name


def test_what_the_c_code_does_not_cover_runs_the_reference(reference_calls):
    qkv, cos, sin, slots, caches = rotary_problem()
    scale = torch.tensor([0.1])
    cases = {
        "fp16": (qkv.half(), cos.half(), sin.half(), slots, *(c.half() for c in caches)),
        "mixed dtypes": (qkv, cos.bfloat16(), sin, slots, *caches),
        "strided cos": (qkv, torch.randn(2, 32)[:, ::2], sin, slots, *caches),
        "int32 slots": (qkv, cos, sin, slots.int(), *caches),
        "strided slots": (qkv, cos, sin, torch.tensor([0, 9, 5])[::2], *caches),
        "k scale": (qkv, cos, sin, slots, *caches, scale, None),
        "v scale": (qkv, cos, sin, slots, *caches, None, scale),
    }
    for name, args in cases.items():
        reference_calls.clear()
        cpu_layer.rotary_kv_write(*args)
        assert [call[0] for call in reference_calls] == ["rotary_kv_write"], name
        passed = (*args, None, None, None)[:9]  # the scales and the key offset default to None
        assert all(a is b for a, b in zip(reference_calls[0][1], passed, strict=True)), name
    # a key offset over a float cache, or a 4-bit cache with scales, reaches the reference with it
    offset = torch.randn(1, 16)
    for caches_, scales in (
        (caches, ()),
        ([torch.zeros(2, 4, 1, 12, dtype=torch.uint8) for _ in range(2)], (scale, scale)),
    ):
        reference_calls.clear()
        cpu_layer.rotary_kv_write(qkv, cos, sin, slots, *caches_, *(scales or (None, None)), k_offset=offset)
        assert reference_calls[0][1][-1] is offset
    strided = torch.randn(1, 32)[:, ::2]  # an 8-bit cache's keys less a strided offset
    reference_calls.clear()
    cpu_layer.rotary_kv_write(
        qkv, cos, sin, slots, *[torch.zeros(2, 4, 1, 16, dtype=torch.int8)] * 2, scale, scale, strided
    )
    assert reference_calls[0][1][-1] is strided
    # an int8 cache: both scales reach the reference, which quantizes K and V with them
    int8 = [torch.zeros(2, 4, 1, 16, dtype=torch.int8) for _ in range(2)]
    k_scale, v_scale = torch.tensor([0.1]), torch.tensor([0.05])
    cpu_layer.rotary_kv_write(qkv, cos, sin, slots, *int8, k_scale, v_scale)
    k = reference.rotate(qkv[:, 32:48].view(2, 1, 16), cos[:, None], sin[:, None])
    assert torch.equal(int8[0].view(-1, 1, 16)[slots], reference.quantized_kv(k, k_scale, torch.int8))
    assert torch.equal(
        int8[1].view(-1, 1, 16)[slots], reference.quantized_kv(qkv[:, 48:].view(2, 1, 16), v_scale, torch.int8)
    )
    # the norm: a strided x, a strided residual, an fp16 stream, a weight of another dtype
    x, residual, weight = torch.randn(2, 8), torch.randn(2, 8), torch.rand(8) + 0.5
    strided = torch.randn(2, 16)[:, ::2]
    for name, args in {
        "strided x": (strided, weight, 1e-6, residual),
        "strided residual": (x, weight, 1e-6, strided),
        "fp16": (x.half(), weight.half(), 1e-6, residual.half()),
        "bf16 weight": (x, weight.bfloat16(), 1e-6, None),
    }.items():
        reference_calls.clear()
        out, h = cpu_layer.add_rms_norm(*args)
        assert [call[0] for call in reference_calls] == ["add_rms_norm"], name
        assert all(a is b for a, b in zip(reference_calls[0][1], args, strict=True)), name


@pytest.mark.skipif(not cpu_library.available(), reason="needs gcc and AVX-512 or AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,kv_heads", [(64, 3), (128, 2)])
def test_the_c_write_rounds_4bit_rows_as_the_reference(dtype, dim, kv_heads):
    """q bit for bit; each 4-bit row's step and minimum as the reference's, and its codes too but where the
    rotation's sums, taken in another order, put a value on the other side of a rounding boundary (a code off
    by one, at most 1% of them)."""
    rows, heads = 5, 2 * kv_heads
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype) * 3
    cos, sin = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    slots = torch.tensor([3, 0, 9, 4, 12])
    offset = torch.randn(kv_heads, dim) * 10
    caches = [torch.zeros(4, 4, kv_heads, kv_int4.row_bytes(dim), dtype=torch.uint8) for _ in range(4)]
    expected = reference.rotary_kv_write(qkv, cos, sin, slots, caches[0], caches[1], k_offset=offset)
    got = cpu_layer.rotary_kv_write(qkv, cos, sin, slots, caches[2], caches[3], k_offset=offset)
    assert torch.equal(got, expected)
    for ours, theirs in ((caches[2], caches[0]), (caches[3], caches[1])):
        width = kv_int4.row_bytes(dim)
        a, b = ours.view(-1, kv_heads, width)[slots], theirs.view(-1, kv_heads, width)[slots]
        assert torch.equal(a[..., dim // 2 :], b[..., dim // 2 :])  # step and minimum
        codes = [torch.cat([x[..., : dim // 2] & 15, x[..., : dim // 2] >> 4], -1).int() for x in (a, b)]
        off = (codes[0] - codes[1]).abs()
        assert off.max() <= 1 and (off > 0).float().mean() <= 0.01
