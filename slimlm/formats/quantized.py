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
        idx = group_index(self.codes.shape[1], self.args, self.g_idx, self.codes.device)
        z = self.codes.to(self.scale.dtype)
        if self.zero is not None:
            z = z - self.zero.to(self.scale.dtype)[:, idx]
        w = z * self.scale[:, idx]
        return w if dtype is None else w.to(dtype)


def group_index(
    in_features: int, args: QuantArgs, g_idx: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The group of each input column: consecutive runs of `group_size`, unless act-order gave a g_idx."""
    if g_idx is not None:
        return g_idx.long()
    size = in_features if args.group_size == -1 else args.group_size
    return torch.arange(in_features, device=device) // size
