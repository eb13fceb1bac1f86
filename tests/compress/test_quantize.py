import pytest
import torch

from slimlm import SlimlmError
from slimlm.compress import quantize as quantize_module
from slimlm.compress.quantize import compute_qparams, quantize, quantize_rtn
from slimlm.formats.quantized import QuantArgs

ALL_ARGS = [QuantArgs(b, g, s) for b in (2, 3, 4, 8) for g in (-1, 32, 64, 128) for s in (True, False)]


def reference_rtn(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """The affine quantizer written out group by group in float64, straight from its definition."""
    w = w.double()
    out = torch.empty_like(w)
    size = w.shape[1] if args.group_size == -1 else args.group_size
    qmin, qmax = -(2 ** (args.bits - 1)), 2 ** (args.bits - 1) - 1
    for r in range(w.shape[0]):
        for c0 in range(0, w.shape[1], size):
            x = w[r, c0 : c0 + size]
            if args.sym:
                s, z0 = x.abs().max() / ((qmax - qmin) / 2), 0.0
            else:
                lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)
                s = (hi - lo) / (qmax - qmin)
                z0 = torch.round(qmin - lo / s).clamp(qmin, qmax)
            z = torch.clamp(torch.round(x / s) + z0, qmin, qmax)
            out[r, c0 : c0 + size] = s * (z - z0)
    return out


@pytest.mark.parametrize("args", ALL_ARGS, ids=str)
def test_rtn_matches_definition(args):
    torch.manual_seed(args.bits * 100 + args.group_size)
    w = torch.randn(24, 256, dtype=torch.float64) * torch.rand(24, 1, dtype=torch.float64)
    q = quantize_rtn(w, args)
    assert q.codes.dtype == torch.int8
    assert int(q.codes.min()) >= args.qmin and int(q.codes.max()) <= args.qmax
    assert q.scale.shape == (24, args.groups(256))
    torch.testing.assert_close(q.dequantize(), reference_rtn(w, args), rtol=0, atol=1e-12)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(8, -1, False)], ids=str)
def test_rtn_in_slices_of_rows_is_rtn_of_the_whole_in_fp32(args, monkeypatch):
    """A tall bf16 matrix (an lm_head) is quantized a few rows at a time, in fp32: the same codes, scales and zero
    points as the whole matrix converted to fp32 at once."""
    w = torch.randn(100, 64).bfloat16()
    whole = quantize_rtn(w.float(), args)
    monkeypatch.setattr(quantize_module, "RTN_SLICE_ELEMENTS", 7 * 64)  # slices of 7 rows, the last one of 2
    sliced = quantize_rtn(w, args)
    assert sliced.scale.dtype == torch.float32 and sliced.codes.shape == (100, 64)
    assert torch.equal(sliced.codes, whole.codes) and torch.equal(sliced.scale, whole.scale)
    assert (sliced.zero is None) == args.sym and (args.sym or torch.equal(sliced.zero, whole.zero))


@pytest.mark.parametrize("sym", [True, False])
def test_error_is_at_most_half_a_step(sym):
    args = QuantArgs(4, 32, sym)
    w = torch.randn(16, 128)
    q = quantize_rtn(w, args)
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_asymmetric_keeps_zero_exact_and_uses_the_full_range():
    w = torch.rand(8, 64) + 0.5  # all positive: the range is [0, max]
    w[:, 5] = 0.0
    q = quantize_rtn(w, QuantArgs(4, 64, sym=False))
    assert (q.dequantize()[:, 5] == 0).all()
    assert int(q.codes.max()) == 7 and int(q.zero.min()) == -8


def test_an_all_positive_group_still_contains_zero():
    """The asymmetric range is [min(x, 0), max(x, 0)]: zero weights stay exact even if no weight is zero."""
    w = torch.rand(8, 64, generator=torch.Generator().manual_seed(0)) * 0.7 + 0.2  # all in (0.2, 0.9)
    args = QuantArgs(4, 64, sym=False)
    q = quantize_rtn(w, args)
    assert q.zero.dtype == torch.int8 and (q.zero == args.qmin).all()
    torch.testing.assert_close(q.scale[:, 0], w.amax(dim=1) / (args.qmax - args.qmin))  # the range starts at 0
    assert torch.equal(quantize(torch.zeros(8, 64), q.scale, q.zero, args).dequantize(), torch.zeros(8, 64))


def test_all_zero_group_dequantizes_to_zero():
    w = torch.zeros(4, 64)
    for sym in (True, False):
        q = quantize_rtn(w, QuantArgs(4, 32, sym))
        assert torch.equal(q.dequantize(), w)
        assert (q.scale > 0).all()  # a zero scale would make every code round(0 / 0)


@pytest.mark.parametrize("sym", [True, False])
def test_codes_saturate_at_both_ends_under_a_smaller_scale(sym):
    """AWQ's clipping and GPTQ's static qparams quantize with scales tighter than the weights' range."""
    args = QuantArgs(4, 64, sym)
    w = torch.linspace(-1, 1, 64).repeat(4, 1)
    scale, zero = compute_qparams(w, args)
    q = quantize(w, scale / 2, zero, args)
    assert int(q.codes.min()) == args.qmin and int(q.codes.max()) == args.qmax


def test_g_idx_groups_columns_by_index():
    args = QuantArgs(4, 32, True)
    w = torch.randn(8, 64)
    perm = torch.randperm(64)
    g_idx = (torch.arange(64) // 32)[perm.argsort()].int()  # column j belongs to group g_idx[j]
    scale, zero = compute_qparams(w[:, perm], args)
    q = quantize(w, scale, zero, args, g_idx)
    expected = quantize_rtn(w[:, perm], args).dequantize()[:, perm.argsort()]
    torch.testing.assert_close(q.dequantize(), expected)


@pytest.mark.parametrize("kw,msg", [({"bits": 5}, "bits 5"), ({"group_size": 48}, "group_size 48")])
def test_unsupported_settings(kw, msg):
    with pytest.raises(SlimlmError, match=msg):
        QuantArgs(**kw)


@pytest.mark.parametrize(
    "args", [QuantArgs(4, 32, True), QuantArgs(3, 64, False), QuantArgs(2, -1, False), QuantArgs(8, -1, True)], ids=str
)
def test_fake_quantize_is_rtn_then_dequantize_bit_for_bit(args):
    from slimlm.compress.quantize import fake_quantize

    g = torch.Generator().manual_seed(args.bits)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-3, 1, 128)  # rows and groups of all magnitudes
    w[3] = 0.0  # an all-zero row: scale 1, codes at the zero point
    w[5, :64] = w[5, :64].abs()  # a group with no negative weights: its range still holds 0
    assert torch.equal(fake_quantize(w, args), quantize_rtn(w, args).dequantize())


def reference_mse(w: torch.Tensor, args: QuantArgs, importance: torch.Tensor | None = None) -> torch.Tensor:
    """The mse observer from its definition, in float64, group by group: the group's range shrunk by p = 1 − k/100,
    k = 0..19, the first p with the least Σ |x − x̂|^2.4 kept (Σ importance · (x − x̂)², given the inputs'
    importance). Returns the dequantized weights."""
    w = w.double()
    out = torch.empty_like(w)
    size = w.shape[1] if args.group_size == -1 else args.group_size
    for r in range(w.shape[0]):
        for c0 in range(0, w.shape[1], size):
            x = w[r, c0 : c0 + size]
            best = None
            for k in range(20):
                p = 1 - k / 100
                if args.sym:
                    s, z0 = p * x.abs().max() / ((args.qmax - args.qmin) / 2), 0.0
                else:
                    lo, hi = p * min(x.min(), 0.0), p * max(x.max(), 0.0)
                    s = (hi - lo) / (args.qmax - args.qmin)
                    s = s if s > 0 else 1.0  # an all-zero group: any scale is exact; the quantizer takes 1
                    z0 = torch.round(args.qmin - lo / s).clamp(args.qmin, args.qmax)
                s = s if s > 0 else 1.0
                q = s * (torch.clamp(torch.round(x / s) + z0, args.qmin, args.qmax) - z0)
                if importance is None:
                    err = ((x - q).abs() ** 2.4).sum()
                else:
                    err = (importance[c0 : c0 + size].double() * (x - q) ** 2).sum()
                if best is None or err < best[0]:
                    best = (err, q)
            out[r, c0 : c0 + size] = best[1]
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    "args", [QuantArgs(4, 32, True), QuantArgs(4, 64, False), QuantArgs(3, -1, True), QuantArgs(8, 32, False)], ids=str
)
def test_the_mse_observer_is_its_definition_and_never_worse_than_the_range(args, weighted):
    g = torch.Generator().manual_seed(args.bits + args.group_size)
    w = torch.randn(12, 128, generator=g, dtype=torch.float64) ** 3  # heavy tails: clipping pays in most groups
    w[2] = 0.0
    importance = torch.rand(128, generator=g, dtype=torch.float64) ** 4 * 100 if weighted else None
    scale, zero = compute_qparams(w, args, "mse", importance)
    got = quantize(w, scale, zero, args).dequantize()
    torch.testing.assert_close(got, reference_mse(w, args, importance), rtol=0, atol=1e-12)
    plain = quantize_rtn(w, args)
    size = 128 if args.group_size == -1 else args.group_size

    def errors(dq):
        err = (dq - w).abs() ** 2.4 if importance is None else importance * (dq - w) ** 2
        return err.reshape(12, -1, size).sum(-1)

    assert (errors(got) <= errors(plain.dequantize())).all()
    if args.bits <= 4:  # at 8 bits the steps are fine enough that clipping an outlier never pays here
        assert (scale < plain.scale).float().mean() > 0.3  # many groups chose a narrower range
    assert torch.equal(got[2], w[2])  # an all-zero row stays exact
