"""The quantized-weight types every format reads and writes, and every method and kernel shares.

    x̂ = s · (z − z0)

Codes live in the signed range [−2^(b−1), 2^(b−1) − 1], which is how compressed-tensors stores them, so a
symmetric weight has z0 = 0 and an asymmetric one a signed zero point. Scales and zero points are per
output row and per group of `group_size` consecutive input columns (−1: one group per row), unless an
act-order `g_idx` says which group each column belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimlm.errors import FieldError

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
FP16_NORMAL = (2.0**-14, 65504.0)  # the range where fp16 keeps its full 11 bits of precision


def stored_scale(scale: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """A linear's scales as its checkpoint stores them: in the weight's dtype, except that an fp32 weight's are
    stored in fp16 when every one is a normal fp16 number (AutoRound's choice too). The runtime's kernels read
    fp16 scales anyway; a scale's rounding (2^-12 of it) moves a weight by under 0.3% of a rounding step, and
    fp32 scales cost 16 bits a group more (0.25 bits a weight at groups of 64). A scale out of that range
    (an all-but-zero group) keeps fp32 rather than rounding its codes' meaning away."""
    if weight_dtype != torch.float32:
        return scale.to(weight_dtype)
    magnitude = scale.abs()
    if scale.numel() and FP16_NORMAL[0] <= magnitude.min() and magnitude.max() <= FP16_NORMAL[1]:
        return scale.to(torch.float16)
    return scale.to(torch.float32)


def scale_bytes(weight_dtype: torch.dtype) -> int:
    """Bytes a checkpoint stores per scale of a weight of `weight_dtype` (stored_scale; fp16 for fp32)."""
    return 2 if weight_dtype == torch.float32 else weight_dtype.itemsize


@dataclass(frozen=True)
class QuantArgs:
    bits: int = 4
    group_size: int = 128
    sym: bool = True

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise FieldError("bits", f"{self.bits} is not supported; use one of {', '.join(map(str, SUPPORTED_BITS))}")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            sizes = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
            raise FieldError("group_size", f"{self.group_size} is not supported; use one of {sizes} (-1 = per channel)")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size


@dataclass
class QuantizedWeight:
    """One quantized linear weight: integer codes plus what it takes to turn them back into floats."""

    codes: torch.Tensor  # int8 [out, in], signed range
    scale: torch.Tensor  # [out, groups], in the weight's float dtype
    zero: torch.Tensor | None  # int8 [out, groups]; None when symmetric
    args: QuantArgs
    g_idx: torch.Tensor | None = None  # int32 [in]: group of each input column, when act-order reorders them

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weights, in `dtype` (default the scales'). Computed in the wider of the two, as transformers
        and vLLM do once they hold an fp16 scale in an fp32 model's parameter: exact for codes of ≤ 8 bits."""
        idx = group_index(self.codes.shape[1], self.args, self.g_idx, self.codes.device)
        wide = self.scale.dtype if dtype is None else torch.promote_types(self.scale.dtype, dtype)
        z = self.codes.to(wide)
        if self.zero is not None:
            z = z - self.zero.to(wide)[:, idx]
        w = z * self.scale.to(wide)[:, idx]
        return w if dtype is None else w.to(dtype)


def group_index(
    in_features: int, args: QuantArgs, g_idx: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The group of each input column: consecutive runs of `group_size`, unless act-order gave a g_idx."""
    if g_idx is not None:
        return g_idx.long()
    size = in_features if args.group_size == -1 else args.group_size
    return torch.arange(in_features, device=device) // size
