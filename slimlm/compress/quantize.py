"""The affine weight quantizer every method shares.

    z = clip(round(x / s) + z0, zmin, zmax)        x̂ = s · (z − z0)

Codes live in the signed range [−2^(b−1), 2^(b−1) − 1], which is how compressed-tensors stores them, so a
symmetric quantizer has z0 = 0 and an asymmetric one a signed zero point. Scales and zero points are per
output row and per group of `group_size` consecutive input columns (−1: one group per row).
"""

from __future__ import annotations

import torch

from slimlm.formats.quantized import QuantArgs, QuantizedWeight, group_index

OBSERVERS = ("minmax", "mse")
SHRINKS = 20  # mse: ranges of 1, 0.99, ..., 0.81 times the group's own are tried
MSE_NORM = 2.4  # mse: the error a range is chosen by, Σ |w − ŵ|^2.4 (GPTQ's reference code; between L2 and L3)


def compute_qparams(
    w: torch.Tensor, args: QuantArgs, observer: str = "minmax", importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) for each row and group of `w` [out, in]: from the group's range ("minmax"), or
    from that range shrunk by the factor of SHRINKS that gives the least Σ |w − ŵ|^MSE_NORM ("mse": a few
    outliers clipped buys the rest of the group finer steps; the full range is one of the candidates).
    importance [in]: each input's weight in that sum (GPTQ passes its Hessian's diagonal, the mean square of
    the input: an error on a large input costs more), with the norm then 2."""
    g = w.reshape(w.shape[0], args.groups(w.shape[1]), -1)
    # The range always contains 0 so that zero weights stay exactly zero.
    lo, hi = (None, g.abs().amax(dim=-1)) if args.sym else (g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0))
    if observer == "minmax":
        return _range_qparams(lo, hi, args)
    if importance is not None:
        importance = importance.to(g.dtype).reshape(g.shape[1], g.shape[2])
    best = best_err = None
    for k in range(SHRINKS):
        p = 1 - k / 100
        scale, zero = _range_qparams(None if lo is None else lo * p, hi * p, args)
        err = (_fake_quantize_groups(g, scale, zero, args) - g).abs_()
        err = err.pow_(MSE_NORM).sum(dim=-1) if importance is None else (err.square_() * importance).sum(dim=-1)
        if best is None:
            best, best_err = (scale, zero), err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = (
            torch.where(better, scale, best[0]),
            None if zero is None else torch.where(better, zero, best[1]),
        )
    return best


def _range_qparams(
    lo: torch.Tensor | None, hi: torch.Tensor, args: QuantArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qparams that map [−hi, hi] (sym, lo None) or [lo, hi] onto the code range."""
    if lo is None:
        scale = hi / ((args.qmax - args.qmin) / 2)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    scale = (hi - lo) / (args.qmax - args.qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(args.qmin - lo / scale).clamp(args.qmin, args.qmax)
    return scale, zero.to(torch.int8)


def quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Codes for `w` [out, in] under given per-group scale/zero (groups by column, or by `g_idx`)."""
    idx = group_index(w.shape[1], args, g_idx, w.device)
    z = torch.round(w / scale[:, idx])
    if zero is not None:
        z = z + zero.to(w.dtype)[:, idx]
    codes = z.clamp(args.qmin, args.qmax).to(torch.int8)
    return QuantizedWeight(codes, scale, zero, args, g_idx)


RTN_SLICE_ELEMENTS = 1 << 24


def quantize_rtn(w: torch.Tensor, args: QuantArgs) -> QuantizedWeight:
    """Round-to-nearest: min-max qparams from the weight itself, then round, in fp32 at least. On slices of rows
    (each row's qparams are its own): a Qwen2.5-1.5B lm_head (151,936 × 1536) quantized whole made ~3 GB of fp32
    temporaries."""
    rows = max(1, RTN_SLICE_ELEMENTS // w.shape[1])
    parts = []
    for r in range(0, w.shape[0], rows):
        part = w[r : r + rows].to(torch.promote_types(w.dtype, torch.float32))
        scale, zero = compute_qparams(part, args)
        parts.append(quantize(part, scale, zero, args))
    if len(parts) == 1:
        return parts[0]
    zero = None if args.sym else torch.cat([q.zero for q in parts])
    return QuantizedWeight(torch.cat([q.codes for q in parts]), torch.cat([q.scale for q in parts]), zero, args)


def fake_quantize(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """quantize_rtn(w, args).dequantize(), bit for bit, computed on [out, groups, group_size] views with the
    qparams broadcast rather than gathered per column: what a search that tries many candidates calls (AWQ
    spent a fifth of a Qwen2.5-1.5B layer in the gathers)."""
    scale, zero = compute_qparams(w, args)
    return _fake_quantize_groups(w.reshape(w.shape[0], scale.shape[1], -1), scale, zero, args).reshape(w.shape)


def _fake_quantize_groups(
    g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: QuantArgs
) -> torch.Tensor:
    """g [out, groups, group_size] rounded under per-group qparams and dequantized."""
    s = scale[..., None]
    z = torch.round(g / s)
    if zero is None:
        return z.clamp_(args.qmin, args.qmax) * s
    z0 = zero.to(g.dtype)[..., None]
    return z.add_(z0).clamp_(args.qmin, args.qmax).sub_(z0) * s
