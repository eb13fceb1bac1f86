"""Round-to-nearest: the baseline every other method must beat. Needs no calibration data."""

from __future__ import annotations

from typing import Any

from torch import nn

from slimlm.compress.pipeline import StepResult
from slimlm.compress.quantize import quantize_rtn
from slimlm.formats.quantized import QuantArgs, stored_scale


class RTN:
    needs_data = False
    changes_layer = True
    float_target = 0.0  # the pipeline's float chain: not wanted (pipeline.Step)

    def __init__(self, args: QuantArgs):
        self.args = args
        self.schemes: dict[str, QuantArgs] = {}

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        return []

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        out = {}
        for name, m in linears.items():
            q = quantize_rtn(m.weight.data, self.schemes.get(name, self.args))
            q.scale = stored_scale(q.scale, m.weight.dtype)
            out[name] = q
        return StepResult(quantized=out)

    def arguments(self) -> dict[str, Any]:
        return {}
