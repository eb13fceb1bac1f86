"""Reading the AutoAWQ "GEMM" checkpoint layout (`quant_method: awq`, `version: gemm`), 4-bit only.

Per quantized linear `name`, transposed relative to GPTQ's output-major codes:
    name.qweight  int32 [in, out/8]      8 unsigned codes per int32, packed along the output dim
    name.qzeros   int32 [in/group, out/8] unsigned zero points, same packing
    name.scales   float16 [in/group, out]
and w[i, o] = scales[g, o] · (q[i, o] − zeros[g, o]) with g = i // group. Within each int32 the nibble at
bits 4j..4j+3 holds output column 8c + ORDER[j]: AutoAWQ interleaves even and odd columns for its kernel.
"""

from __future__ import annotations

import torch

from slimlm.errors import SlimlmError
from slimlm.formats.packing import unpack_int32
from slimlm.formats.quantized import QuantArgs, QuantizedWeight

MARKER = "qweight"
KEYS = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a packed int32 -> column offset ORDER[j]


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] -> signed 4-bit codes (code − 8) [rows, cols] in natural column order."""
    rows = packed.shape[0]
    in_packing_order = unpack_int32(packed, 4, packed.shape[1] * 8).view(rows, -1, 8)
    natural = torch.empty_like(in_packing_order)
    natural[:, :, list(ORDER)] = in_packing_order
    return natural.view(rows, -1)


def args_from_config(qcfg: dict) -> QuantArgs:
    version = str(qcfg.get("version", "gemm")).lower()
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    if version != "gemm" or bits != 4 or not qcfg.get("zero_point", True):
        raise SlimlmError(
            f"AWQ checkpoint (version {version}, {bits}-bit, zero_point={qcfg.get('zero_point')}) is not supported; "
            "slimlm reads AWQ GEMM 4-bit with zero points"
        )
    group = qcfg.get("group_size", qcfg.get("q_group_size", 128))
    if type(group) is not int or group not in (32, 64, 128):
        raise SlimlmError(f"AWQ group_size={group!r}: slimlm reads 32, 64 or 128")
    return QuantArgs(bits=4, group_size=group, sym=False)


def from_tensors(t: dict[str, torch.Tensor], args: QuantArgs, name: str) -> QuantizedWeight:
    """A QuantizedWeight (signed codes and zeros, compressed-tensors convention) from one linear's tensors."""
    missing = [k for k in KEYS if k not in t]
    if missing:
        raise SlimlmError(f"the checkpoint has no {name}.{missing[0]}")
    flat = next((k for k in KEYS if t[k].dim() != 2), None)
    if flat is not None:
        raise SlimlmError(f"{name}.{flat} is {list(t[flat].shape)}; AWQ GEMM tensors are 2-D")
    in_f, out_f = t["qweight"].shape[0], t["scales"].shape[1]
    if in_f % args.group_size:
        raise SlimlmError(f"{name}: group_size {args.group_size} does not divide its input dim {in_f}")
    groups = args.groups(in_f)
    want = {"qweight": (in_f, out_f // 8), "qzeros": (groups, out_f // 8), "scales": (groups, out_f)}
    for key, shape in want.items():
        if tuple(t[key].shape) != shape:
            raise SlimlmError(f"{name}.{key} is {list(t[key].shape)}, the quantization_config implies {list(shape)}")
    codes = unpack_columns(t["qweight"]).T.contiguous()  # [out, in]
    zeros = unpack_columns(t["qzeros"]).T.contiguous()  # [out, groups]
    return QuantizedWeight(codes, t["scales"].T.contiguous(), zeros, args)
