"""The GPTQ v1 checkpoint layout (AutoGPTQ / GPTQModel `checkpoint_format: gptq`), for tools that read only it.

Per quantized linear `name` with b-bit unsigned codes u = z + 2^(b−1):
    name.qweight  int32 [in·b/32, out]   u packed along the input dim, element i at bit (i mod 32/b)·b
    name.qzeros   int32 [groups, out·b/32]  zero point minus one (the v1 convention), packed along out
    name.scales   float16 [groups, out]
    name.g_idx    int32 [in]            group of each input column
and w = scales[g_idx] · (u − (qzeros + 1)). Only symmetric 4- and 8-bit weights are exported: the v1
zero-point offset makes asymmetric zeros lossy, and 2/3-bit layouts differ between tools.
"""

from __future__ import annotations

import torch

from slimlm.errors import SlimlmError
from slimlm.formats.packing import pack_int32, unpack_int32
from slimlm.formats.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantArgs, QuantizedWeight, group_index

MARKER = "qweight"
KEYS = ("qweight", "qzeros", "scales", "g_idx")


def check_exportable(args: QuantArgs) -> None:
    if not args.sym or args.bits not in (4, 8):
        raise SlimlmError(
            f"--format gptq writes symmetric 4- or 8-bit weights only (got {args.bits}-bit "
            f"{'sym' if args.sym else 'asym'}); use --sym with --bits 4 or 8, or the default compressed-tensors format"
        )


def to_tensors(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """v1 tensors for one linear. Scales are stored as float16, as every v1 reader expects."""
    check_exportable(q.args)
    out_f, in_f = q.codes.shape
    groups = q.scale.shape[1]
    # z − 1 = 2^(b−1) − 1 for every symmetric group; pack_int32 stores signed values + 2^(b−1), so: −1
    zeros_minus_one = torch.full((groups, out_f), -1, dtype=torch.int8)
    return {
        "qweight": pack_int32(q.codes.T.contiguous(), q.args.bits, dim=0),
        "qzeros": pack_int32(zeros_minus_one, q.args.bits, dim=1),
        "scales": q.scale.T.to(torch.float16).contiguous(),
        "g_idx": group_index(in_f, q.args, q.g_idx).to(torch.int32),
    }


def from_tensors(t: dict[str, torch.Tensor], args: QuantArgs, name: str) -> QuantizedWeight:
    """A QuantizedWeight (signed codes, symmetric) from one linear's v1 tensors, shapes checked first."""
    missing = [k for k in KEYS if k not in t]
    if missing:
        raise SlimlmError(f"the checkpoint has no {name}.{missing[0]}")
    in_f, out_f = t["g_idx"].numel(), t["scales"].shape[-1] if t["scales"].dim() else 0
    groups = args.groups(in_f)
    want = {
        "qweight": (in_f * args.bits // 32, out_f),
        "qzeros": (groups, out_f * args.bits // 32),
        "scales": (groups, out_f),
    }
    for key, shape in want.items():
        if tuple(t[key].shape) != shape:
            raise SlimlmError(f"{name}.{key} is {list(t[key].shape)}, the quantization_config implies {list(shape)}")
    # unpack_int32 gives the stored unsigned values − 2^(b−1): the signed codes, and −1 for a symmetric z − 1
    codes = unpack_int32(t["qweight"], args.bits, in_f, dim=0).T
    if not (unpack_int32(t["qzeros"], args.bits, out_f, dim=1) == -1).all():
        raise SlimlmError("GPTQ v1 checkpoint with asymmetric zero points: not supported yet")
    g_idx = t["g_idx"].long()
    if t["g_idx"].is_floating_point() or g_idx.min() < 0 or g_idx.max() >= groups:
        raise SlimlmError(f"{name}.g_idx holds groups outside 0..{groups - 1}")
    trivial = torch.equal(g_idx, group_index(in_f, args))
    return QuantizedWeight(codes.contiguous(), t["scales"].T.contiguous(), None, args, None if trivial else g_idx.int())


def quantization_config(args: QuantArgs, act_order: str | None, damp: float | None) -> dict:
    check_exportable(args)
    return {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": args.bits,
        "group_size": args.group_size,
        "sym": True,
        "desc_act": act_order == "group",
        "damp_percent": damp,
        "true_sequential": True,
    }


def args_from_config(qcfg: dict) -> QuantArgs:
    if qcfg.get("checkpoint_format", "gptq") != "gptq" or qcfg.get("sym", True) is not True:
        raise SlimlmError(
            f"GPTQ checkpoint format {qcfg.get('checkpoint_format')} (sym={qcfg.get('sym')}) is not supported; "
            "slimlm reads symmetric GPTQ v1"
        )
    bits, group = qcfg.get("bits"), qcfg.get("group_size")
    valid = type(bits) is int and type(group) is int
    if not valid or bits not in SUPPORTED_BITS or group not in SUPPORTED_GROUP_SIZES:
        raise SlimlmError(
            f"GPTQ bits={bits!r} group_size={group!r}: slimlm reads bits 2/3/4/8, group sizes {SUPPORTED_GROUP_SIZES}"
        )
    return QuantArgs(bits=bits, group_size=group, sym=True)
