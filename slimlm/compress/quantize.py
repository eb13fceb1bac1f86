"""The affine weight quantizer every method shares.

    z = clip(round(x / s) + z0, zmin, zmax)        x̂ = s · (z − z0)

Codes live in the signed range [−2^(b−1), 2^(b−1) − 1], which is how compressed-tensors stores them, so a
symmetric quantizer has z0 = 0 and an asymmetric one a signed zero point. Scales and zero points are per
output row and per group of `group_size` consecutive input columns (−1: one group per row).
"""

from __future__ import annotations

import torch

from slimlm.formats.quantized import QuantArgs, QuantizedWeight, group_index


def compute_qparams(w: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scale (and zero point) for each row and group of `w` [out, in]."""
    g = w.reshape(w.shape[0], args.groups(w.shape[1]), -1)
    if args.sym:
        amax = g.abs().amax(dim=-1)
        scale = amax / ((args.qmax - args.qmin) / 2)
        return torch.where(scale > 0, scale, torch.ones_like(scale)), None
    # The range always contains 0 so that zero weights stay exactly zero.
    xmin = g.amin(dim=-1).clamp(max=0)
    xmax = g.amax(dim=-1).clamp(min=0)
    scale = (xmax - xmin) / (args.qmax - args.qmin)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(args.qmin - xmin / scale).clamp(args.qmin, args.qmax)
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
    g, s = w.reshape(w.shape[0], scale.shape[1], -1), scale[..., None]
    z = torch.round(g / s)
    if zero is None:
        return (z.clamp_(args.qmin, args.qmax) * s).reshape(w.shape)
    z0 = zero.to(w.dtype)[..., None]
    return (z.add_(z0).clamp_(args.qmin, args.qmax).sub_(z0) * s).reshape(w.shape)
