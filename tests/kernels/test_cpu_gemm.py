import pytest
import torch

from slimlm import SlimlmError
from slimlm.kernels import cpu_gemm, cpu_library, reference
from slimlm.kernels.packed import SERVED_BITS, dequantize, pack_dense
from tests.kernels.problems import (
    Spy,
    haswell_library,
    quantized_weight,
    relative_error,
    torch_threads,
    x_as_multiplied,
)

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="needs gcc and AVX-512 or AVX2")
needs_bf16 = pytest.mark.skipif(
    not (cpu_library.available() and cpu_library.has_bf16_gemm()), reason="needs AVX-512 BF16"
)

SHAPES = [  # bits, group, sym, act-order, n, k: ragged N, chunks of 256 inputs, segments of whole groups
    (4, 64, False, False, 192, 576),
    (4, 32, True, True, 70, 96),
    (8, -1, True, False, 130, 72),
    (8, 128, False, True, 64, 256),
    (4, -1, False, False, 100, 576),  # per channel: segments of 192 (576 = 3 · 192)
    (8, 128, False, False, 130, 2176),  # 17 groups over chunks of 1024, 1024 and 128
    (4, -1, False, False, 64, 1536),  # per channel: chunks of two 768-input segments
    (4, -1, True, False, 64, 270),  # 270's largest divisor under 256 is odd (135): segments of 90
    (2, 64, False, False, 192, 576),  # 2 and 3 bits: widened to the 4-bit layout (packed.SERVED_BITS)
    (3, 32, True, True, 70, 96),
]


@pytest.mark.parametrize("bits,group_size,sym,act_order,n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 11])
def test_fp32_rows_match_reference_to_fp32_accuracy(poisoned, bits, group_size, sym, act_order, n, k, m):
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=m)
    x = torch.randn(m, k)
    ref = reference.quant_matmul(x_as_multiplied(x, w), w)
    out = cpu_gemm.quant_matmul(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert relative_error(out, ref) < 1e-5  # fp32 accumulation, whichever loop ran


@pytest.fixture
def no_amx(monkeypatch):
    """The AVX-512 BF16 loops as a CPU without AMX runs them (an AMX CPU hands most bf16 rows to the tile unit)."""
    monkeypatch.setattr(cpu_library, "has_amx", lambda: False)


needs_amx = pytest.mark.skipif(
    not (cpu_library.available() and cpu_library.has_amx()), reason="needs AMX (e.g. Sapphire Rapids)"
)


def whole_tile_steps(group_size: int, k: int) -> bool:
    """Whether the code tiles' segments (inside one group, ≤ 1024 inputs, even) are whole AMX tile steps of 32
    inputs: then one row tile multiplies the codes themselves."""
    group = k if group_size == -1 else group_size
    seg = min(group, 1024)
    while group % seg or seg % 2:
        seg -= 1
    return seg % 32 == 0


@needs_amx
@pytest.mark.parametrize("bits,group_size,sym,act_order,n,k", SHAPES)
@pytest.mark.parametrize("m", [cpu_gemm.AMX_MIN_ROWS[4], 7, 16, 17, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_tiles_round_the_weights_as_torch(poisoned, bits, group_size, sym, act_order, n, k, m, threads):
    """From AMX_MIN_ROWS bf16 rows on, an AMX CPU multiplies on the tile unit. Up to 16 rows, one row tile: of
    the codes themselves where the segments are whole tile steps, exact in the weights as the code tiles
    (the float64 product of the real weights up to fp32 accumulation), else of the weights unpacked as they
    stream. Above: the AVX-512 weight tiles' bf16-rounded weights (the float64 product with exactly those
    weights); 17: a pair of row tiles over chunks; 40: a pair and a last single tile; with two threads a
    narrow layer splits its row tiles too."""
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=m)
    x = torch.randn(m, k).bfloat16()
    assert cpu_gemm.path(m, torch.bfloat16, w) == "bf16-amx"
    assert cpu_gemm.path(m, torch.float32, w) != "bf16-amx"
    x_perm = x if w.perm is None else x[:, w.perm]
    if m <= 16 and whole_tile_steps(group_size, k):
        ref = reference.quant_matmul(x.double(), w)
    else:
        ref = x_perm.double() @ dequantize(w).bfloat16().double()[: w.out_features].T
    with torch_threads(threads):
        y = cpu_gemm.quant_matmul(x, w)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert relative_error(y.double(), ref) < 4e-3  # the output's own bf16 rounding
        fp32 = torch.empty(m, w.out_features)
        assert (
            cpu_library.load().slimlm_quant_matmul_amx(
                w.bits,
                x_perm.contiguous().data_ptr(),
                m,
                k,
                *w.kernel_args,
                fp32.data_ptr(),
                w.out_features,
                0,
                threads,
            )
            == 0
        )
        assert relative_error(fp32.double(), ref) < 1e-5  # before that rounding: fp32 accumulation only


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_blocks_share_an_x_larger_than_l2(poisoned, threads):
    """x of 264 × 2176 bf16 (1.1 MB): each thread takes 2-4 weight blocks together per chunk of inputs (17
    blocks: groups of 4 and a last one on one thread, of 2 on two), and a last row tile of 8 rows."""
    _, w = quantized_weight(1054, 2176, 4, 128, False, False, seed=threads)
    x = torch.randn(264, 2176).bfloat16()
    ref = x.double() @ dequantize(w).bfloat16().double()[: w.out_features].T
    with torch_threads(threads):
        fp32 = torch.empty(264, w.out_features)
        assert (
            cpu_library.load().slimlm_quant_matmul_amx(
                w.bits, x.data_ptr(), 264, 2176, *w.kernel_args, fp32.data_ptr(), w.out_features, 0, threads
            )
            == 0
        )
    assert relative_error(fp32.double(), ref) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_fp32_rows_run_one_loop_whatever_their_number(monkeypatch, bits):
    """fp32 x takes the fused loop at every row count (AVX2's 4-bit: the int8 loop), so a row's bits never
    depend on the rows beside it: each row of a 300-row product equals that row multiplied alone."""
    _, w = quantized_weight(2112, 128, bits, 64, False)
    loops = {cpu_gemm.path(m, torch.float32, w) for m in (1, 2, 3, 10, 11, 33, 97, 300)}
    assert loops == ({"int8"} if cpu_gemm.int8_fits(w) else {"fused"})
    x = torch.randn(300, 128) * torch.logspace(-3, 3, 128)
    whole = cpu_gemm.quant_matmul(x, w)
    assert all(torch.equal(cpu_gemm.quant_matmul(x[i : i + 1], w)[0], whole[i]) for i in (0, 7, 150, 299))
    assert relative_error(whole, reference.quant_matmul(x_as_multiplied(x, w), w)) < 1e-6


@needs_bf16
@pytest.mark.parametrize("bits,group_size,sym,act_order,n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 7, 12, 30])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_code_tiles_are_exact_in_the_weights(poisoned, no_amx, bits, group_size, sym, act_order, n, k, m, threads):
    """Codes, scales and zero points enter exactly: only fp32 accumulation separates the result from the
    float64 product of the same bf16 x. 5 and 7 rows split into tiles of 3 + 2 and 4 + 3; with two threads a
    narrow layer (≤ 3 blocks of 64 features) splits its rows between them too."""
    if m > cpu_gemm.CODE_MAX_ROWS[SERVED_BITS[bits]]:
        pytest.skip("above the code tiles' range for these bits")
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=m)
    x = torch.randn(m, k).bfloat16()
    assert cpu_gemm.path(m, torch.bfloat16, w) == "bf16-codes"
    ref = reference.quant_matmul(x.double(), w)
    with torch_threads(threads):
        out = cpu_gemm.quant_matmul(x, w)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        assert relative_error(out.double(), ref) < 4e-3  # the output's own bf16 rounding
        assert relative_error(_fp32_result(x, w), ref) < 1e-5  # before it: fp32 accumulation only


@needs_bf16
@pytest.mark.parametrize("bits,group_size,sym,act_order,n,k", SHAPES)
@pytest.mark.parametrize("extra", [1, 7])
def test_bf16_weight_tiles_round_the_weights_as_torch(poisoned, no_amx, bits, group_size, sym, act_order, n, k, extra):
    """Above the code rows, each weight is dequantized once, rounded to bf16 (nearest even) and multiplied by
    6-row tiles: the result is the float64 product with exactly those weights, up to fp32 accumulation."""
    m = cpu_gemm.CODE_MAX_ROWS[SERVED_BITS[bits]] + extra
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=extra)
    x = torch.randn(m, k).bfloat16()
    assert cpu_gemm.path(m, torch.bfloat16, w) == "bf16-weights"
    x_perm = x if w.perm is None else x[:, w.perm]
    rounded = dequantize(w).bfloat16().double()[: w.out_features]
    ref = x_perm.double() @ rounded.T
    y = cpu_gemm.quant_matmul(x, w)
    assert y.dtype == torch.bfloat16
    assert relative_error(y.double(), ref) < 4e-3  # the output's own bf16 rounding
    # before that rounding, the sums agree to fp32 accuracy: rerun with the last step visible
    assert relative_error(_fp32_result(x, w), ref) < 1e-5


def _fp32_result(x: torch.Tensor, w) -> torch.Tensor:
    """The bf16 kernel's fp32 output, before quant_matmul rounds it to x's dtype."""
    if w.perm is not None:
        x = x[:, w.perm]
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    cpu_library.load().slimlm_quant_matmul_bf16(
        w.bits,
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        w.zeros.data_ptr(),
        w.codes.shape[0],
        w.group_size,
        y.data_ptr(),
        w.out_features,
        0,
        cpu_gemm.CODE_MAX_ROWS[w.bits],
        torch.get_num_threads(),
    )
    return y.double()


@pytest.mark.parametrize("m", [3, cpu_gemm.FUSED_MAX_ROWS_BF16 + 1, 40])
def test_bf16_rows_take_any_path_within_bf16_error(poisoned, m):
    _, w = quantized_weight(1100, 128, 4, 64, sym=False, seed=m)  # > SLICE_BLOCKS blocks, ragged last slice
    x = torch.randn(m, 128).bfloat16()
    out = cpu_gemm.quant_matmul(x, w)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference.quant_matmul(x.double(), w)) < 1e-2  # bf16 has 8 mantissa bits


# The other ISAs' builds run on this CPU too (an AVX-512 BF16 CPU executes AVX-512F and AVX2 code): the
# dispatch and the kernels a CPU without BF16, or without AVX-512, would run are checked here as well.
OTHER_ISAS = {"skylake-avx512": (512, False), "haswell": (256, False)}


@pytest.fixture(params=list(OTHER_ISAS))
def other_isa(request, monkeypatch):
    if not cpu_library.has_bf16_gemm():
        pytest.skip("needs a CPU that runs every build (AVX-512 BF16)")
    lib = cpu_library.load(request.param)
    monkeypatch.setattr(cpu_library, "load", lambda: lib)
    monkeypatch.setattr(cpu_library, "vector_bits", lambda: lib.slimlm_vector_bits())
    monkeypatch.setattr(cpu_library, "has_bf16_gemm", lambda: hasattr(lib, "slimlm_quant_matmul_bf16"))
    return request.param


def test_other_isa_builds_are_what_they_say(other_isa):
    bits, bf16 = OTHER_ISAS[other_isa]
    assert (cpu_library.vector_bits(), cpu_library.has_bf16_gemm()) == (bits, bf16)


def test_the_loop_for_each_row_count_on_cpus_without_bf16(other_isa):
    _, w = quantized_weight(64, 128, 4, 64, False)
    if other_isa == "haswell":  # AVX2: bf16 x on fp32 slices above FUSED_MAX_ROWS_AVX2 rows; fp32 x never
        limit = cpu_gemm.FUSED_MAX_ROWS_AVX2
        _, w8 = quantized_weight(64, 128, 8, 64, False)
        _, narrow = quantized_weight(64, 144, 4, -1, False)  # 144 inputs: not whole runs of INT8_RUN
        for dtype in (torch.float32, torch.bfloat16):
            assert [cpu_gemm.path(m, dtype, w) for m in (1, limit, limit + 1, 512)] == ["int8"] * 4  # decode steps
        sliced = ["fused", "fused", "dequant-slices"]
        with cpu_gemm.exact_activations():  # scored prompt tokens, activations="exact"
            assert [cpu_gemm.path(m, torch.float32, w) for m in (1, limit, limit + 1)] == ["fused"] * 3
            assert [cpu_gemm.path(m, torch.bfloat16, w) for m in (1, limit, limit + 1)] == sliced
        assert [cpu_gemm.path(m, torch.float32, w8) for m in (1, limit, limit + 1)] == ["fused"] * 3
        assert [cpu_gemm.path(m, torch.bfloat16, w8) for m in (1, limit, limit + 1)] == sliced
        assert cpu_gemm.path(1, torch.float32, narrow) == "fused"
    else:  # AVX-512 without BF16: bf16 slices above FUSED_MAX_ROWS_BF16 bf16 rows; fp32 rows always fused
        limit = cpu_gemm.FUSED_MAX_ROWS_BF16
        assert [cpu_gemm.path(m, torch.bfloat16, w) for m in (1, limit, limit + 1)] == [
            "fused",
            "fused",
            "dequant-slices",
        ]
        assert cpu_gemm.path(500, torch.float32, w) == "fused"
    _, odd = quantized_weight(64, 270, 4, -1, True)  # the bf16 dot products need even widths; these loops do not
    assert cpu_gemm.path(1, torch.float32, odd) == "fused"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 17, 40])
@pytest.mark.parametrize("bits", [4, 8])
def test_cpus_without_bf16_match_the_reference_on_every_loop(poisoned, other_isa, dtype, m, bits):
    """1100 outputs: more than SLICE_BLOCKS blocks, so the slices include a ragged last one; act-order too."""
    _, w = quantized_weight(1100, 128, bits, 64, sym=False, act_order=True, seed=m)
    x = torch.randn(m, 128).to(dtype)
    out = cpu_gemm.quant_matmul(x, w)
    assert out.shape == (m, 1100) and out.dtype == dtype
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 x gives a bf16 result; fp32 accumulates in fp32
    assert relative_error(out, reference.quant_matmul(x_as_multiplied(x.float(), w), w)) < tolerance


INT8_SHAPES = [s for s in SHAPES if s[0] == 4 and s[5] % 32 == 0]


@pytest.mark.parametrize("bits,group_size,sym,act_order,n,k", INT8_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 9])
def test_avx2_int8_loop_is_the_weights_times_x_hat(poisoned, monkeypatch, bits, group_size, sym, act_order, n, k, m):
    """AVX2's 4-bit loop multiplies x̂ (x quantized to int8 per run of 32 inputs): to fp32 accuracy the
    product of the dequantized weights with exactly that x̂, and within int8's error of the product with x.
    Scales of 1e-3 to 1e3 across runs, and a run of zeros, check each run's scale is its own."""
    lib = haswell_library(monkeypatch)
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=m)
    x = torch.randn(m, k) * torch.logspace(-3, 3, k // 32).repeat_interleave(32)
    x[:, 32:64] = 0
    assert cpu_gemm.path(m, torch.float32, w) == "int8"
    out = cpu_gemm.quant_matmul(x, w)
    assert lib.calls.count("slimlm_quant_matmul_i8") == 1
    assert relative_error(out, reference.quant_matmul(x_as_multiplied(x, w), w)) < 1e-5
    assert relative_error(out, reference.quant_matmul(x.double(), w)) < 2e-2


@pytest.mark.parametrize(
    "bits,group_size,sym,act_order,n,k",
    [*INT8_SHAPES, (4, -1, True, False, 64, 352)],  # 352 = 11 · 32 per channel: pieces of one run
)
def test_avx2_int8_rows_come_out_the_same_alone_or_with_others(
    poisoned, monkeypatch, bits, group_size, sym, act_order, n, k
):
    """From PANEL_MIN_ROWS rows on, the block's codes are unpacked once for all rows (in pieces of up to 256
    inputs); every row must still come out bit for bit as it does alone: prefill and decode agree. 3-7 rows
    cover a whole tile of 4 and each remainder."""
    lib = haswell_library(monkeypatch)
    _, w = quantized_weight(n, k, bits, group_size, sym, act_order, seed=3)
    x = torch.randn(7, k) * torch.logspace(-2, 2, k // 32).repeat_interleave(32)
    alone = torch.cat([cpu_gemm.quant_matmul(row[None], w) for row in x])
    for m in range(3, 8):
        assert torch.equal(cpu_gemm.quant_matmul(x[:m], w), alone[:m]), m
    assert lib.calls.count("slimlm_quant_matmul_i8") == 7 + 5


@needs_bf16
@pytest.mark.parametrize("bits", [4, 8])
def test_quant_matmul_runs_the_loop_path_names(monkeypatch, no_amx, bits):
    """Every loop gives the right numbers, so only a spy shows which one ran: the one `path` names."""
    _, w = quantized_weight(64, 128, bits, 64, False)
    limit = cpu_gemm.CODE_MAX_ROWS[bits]
    assert [cpu_gemm.path(m, torch.bfloat16, w) for m in (limit, limit + 1)] == ["bf16-codes", "bf16-weights"]
    spy = Spy(cpu_library.load())
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    cases = [
        (1, torch.bfloat16, "slimlm_quant_matmul_bf16"),
        (limit + 1, torch.bfloat16, "slimlm_quant_matmul_bf16"),
        (1, torch.float32, "slimlm_quant_matmul"),
        (limit, torch.float32, "slimlm_quant_matmul"),
    ]
    for rows, dtype, called in cases:
        spy.calls = []
        cpu_gemm.quant_matmul(torch.randn(rows, 128).to(dtype), w)
        assert spy.calls == [called], (rows, dtype)


@needs_amx
def test_amx_cpus_run_the_tile_unit_from_amx_min_rows(monkeypatch):
    _, w = quantized_weight(64, 128, 4, 64, False)
    spy = Spy(cpu_library.load())
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    for rows in (cpu_gemm.AMX_MIN_ROWS[4] - 1, cpu_gemm.AMX_MIN_ROWS[4], 300):
        spy.calls = []
        cpu_gemm.quant_matmul(torch.randn(rows, 128).bfloat16(), w)
        assert spy.calls == ["slimlm_quant_matmul_" + ("amx" if rows >= cpu_gemm.AMX_MIN_ROWS[4] else "bf16")], rows


@needs_bf16
@pytest.mark.parametrize("rows", [3, 40])
def test_a_failed_allocation_in_the_bf16_kernels_is_named(monkeypatch, rows):
    _, w = quantized_weight(64, 128, 4, 64, False)
    failing = Spy(cpu_library.load(), status=-1)
    monkeypatch.setattr(cpu_library, "load", lambda: failing)
    with pytest.raises(SlimlmError) as e:
        cpu_gemm.quant_matmul(torch.randn(rows, 128).bfloat16(), w)
    assert str(e.value) == f"out of memory in the CPU quantized matmul ({rows}×128 rows of x)"


@pytest.mark.parametrize("bits", [4, 8])
def test_cpus_without_bf16_run_the_loop_path_names_over_every_slice(poisoned, other_isa, monkeypatch, bits):
    """2112 outputs: 33 blocks, more than two slices of SLICE_BLOCKS."""
    _, w = quantized_weight(2112, 128, bits, 64, sym=True)
    spy = Spy(cpu_library.load())
    monkeypatch.setattr(cpu_library, "load", lambda: spy)
    called = {"dequant-slices": "slimlm_dequantize", "int8": "slimlm_quant_matmul_i8", "fused": "slimlm_quant_matmul"}
    for rows, dtype in ((2, torch.float32), (40, torch.bfloat16), (40, torch.float32)):
        spy.calls = []
        x = torch.randn(rows, 128).to(dtype)
        out = cpu_gemm.quant_matmul(x, w)
        assert set(spy.calls) == {called[cpu_gemm.path(rows, dtype, w)]}, (rows, dtype)
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert relative_error(out, reference.quant_matmul(x_as_multiplied(x.float(), w), w)) < tolerance


@needs_bf16
@pytest.mark.parametrize("n,k", [(100, 64), (960, 576), (70, 2080)])  # ragged N; 2080: chunks of 1024, 1024, 32
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 17, 40])
@pytest.mark.parametrize("amx", [False, True])
def test_dense_bf16_weights_give_the_float64_product(poisoned, monkeypatch, n, k, m, amx):
    """pack_dense's pairs are read in place by every bf16 loop: only fp32 accumulation separates the result
    from the float64 product (code tiles up to 4 rows, weight tiles above; on the tile unit from 3 rows: one
    row tile streamed, a pair of them over chunks, a pair and a last single one)."""
    if amx and not cpu_library.has_amx():
        pytest.skip("needs AMX")
    monkeypatch.setattr(cpu_library, "has_amx", lambda: amx)
    weight, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
    w = pack_dense(weight)
    kernel = cpu_gemm.path(m, torch.bfloat16, w)
    assert kernel == ("bf16-amx" if amx and m >= 3 else "bf16-codes" if m <= 4 else "bf16-weights")
    ref = x.double() @ weight.double().T
    fp32 = torch.empty(m, n)
    args = (16, x.data_ptr(), m, k, *w.kernel_args, fp32.data_ptr(), n, 0)
    with torch_threads(2):
        lib = cpu_library.load()
        if kernel == "bf16-amx":
            assert lib.slimlm_quant_matmul_amx(*args, 2) == 0
        else:
            assert lib.slimlm_quant_matmul_bf16(*args, cpu_gemm.CODE_MAX_ROWS[16], 2) == 0
        assert relative_error(fp32.double(), ref) < 1e-5
        y = cpu_gemm.quant_matmul(x, w)
    assert y.dtype == torch.bfloat16 and relative_error(y.double(), ref) < 4e-3  # the output's bf16 rounding
    y32 = cpu_gemm.quant_matmul(x.float(), w)  # fp32 x is rounded to bf16 for these loops
    assert y32.dtype == torch.float32 and relative_error(y32.double(), ref) < 4e-3


def test_dense_weights_fit_where_the_loops_take_them():
    fits = cpu_library.available() and cpu_library.has_bf16_gemm()
    assert cpu_gemm.dense_fits(torch.zeros(8, 64, dtype=torch.bfloat16)) == fits
    assert cpu_gemm.dense_fits(torch.zeros(8, 5))  # fp32: every build's fused loop
    assert not cpu_gemm.dense_fits(torch.zeros(8, 64, dtype=torch.float16))
    assert not cpu_gemm.dense_fits(torch.zeros(8, 48, dtype=torch.bfloat16))  # K not a multiple of 32


@pytest.mark.parametrize("isa", ["native", "haswell"])
@pytest.mark.parametrize("n,k", [(100, 64), (960, 576), (70, 5)])
@pytest.mark.parametrize("m", [1, 3, 4, 9, 33, 100])
def test_dense_fp32_weights_give_the_float64_product(poisoned, monkeypatch, isa, n, k, m):
    """pack_dense's fp32 blocks: the fused loop (AVX-512 or AVX2) reads them as they are (no scales), at every
    row count, to fp32 accuracy."""
    if isa == "haswell":
        haswell_library(monkeypatch)
    weight, x = torch.randn(n, k), torch.randn(m, k)
    w = pack_dense(weight)
    assert cpu_gemm.path(m, torch.float32, w) == "fused"
    with torch_threads(2):
        y = cpu_gemm.quant_matmul(x, w)
    assert y.shape == (m, n) and relative_error(y.double(), x.double() @ weight.double().T) < 1e-6
    assert cpu_gemm.quant_matmul(x.bfloat16(), w).dtype == torch.bfloat16  # other x: in the weights' dtype


def test_row_pieces_keep_each_output_under_fresh_bytes_where_the_pieces_run_the_same_loop(monkeypatch):
    _, w = quantized_weight(256, 128, 4, 32, False)
    monkeypatch.setattr(cpu_gemm, "path", lambda rows, dtype, w: "int8")
    limit = cpu_gemm.FRESH_BYTES // (256 * 4)  # fp32 rows that fit
    assert [cpu_gemm.row_pieces(torch.empty(m, 128), w) for m in (1, limit, limit + 1, 3 * limit)] == [1, 1, 2, 3]
    assert cpu_gemm.row_pieces(torch.empty(limit + 1, 128, dtype=torch.bfloat16), w) == 1  # half the bytes
    monkeypatch.setattr(cpu_gemm, "FRESH_BYTES", 256 * 4 * (cpu_gemm.MIN_PIECE_ROWS - 1))
    assert cpu_gemm.row_pieces(torch.empty(2 * cpu_gemm.MIN_PIECE_ROWS, 128), w) == 1  # pieces too small
    monkeypatch.setattr(cpu_gemm, "FRESH_BYTES", 256 * 4 * limit)
    monkeypatch.setattr(cpu_gemm, "path", lambda rows, dtype, w: "fused" if rows <= limit else "int8")
    assert cpu_gemm.row_pieces(torch.empty(3 * limit, 128), w) == 1  # a piece would run another loop
    monkeypatch.setattr(cpu_gemm, "path", lambda rows, dtype, w: "dequant-slices")
    assert cpu_gemm.row_pieces(torch.empty(3 * limit, 128), w) == 1
