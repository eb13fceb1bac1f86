"""Round-to-nearest: the baseline every other method must beat. Needs no statistics."""

from __future__ import annotations

from typing import Any

from torch import nn

from slimlm.compress.quantize import QuantArgs, QuantizedWeight, quantize_rtn


class RTN:
    def __init__(self, args: QuantArgs):
        self.args = args

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        return []

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> dict[str, QuantizedWeight]:
        return {name: quantize_rtn(m.weight.data, self.args) for name, m in linears.items()}

    def arguments(self) -> dict[str, Any]:
        return {}
