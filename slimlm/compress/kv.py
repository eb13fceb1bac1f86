"""KV-cache quantization: static K and V scales calibrated on data, one per KV head or one per layer.

The scale of a head is the largest |K| (after the rotary embedding: what the cache holds) or |V| it produces
on the calibration data, divided by the KV dtype's largest value (448 for fp8 e4m3, 127 for int8): the
min-max observer llm-compressor's KV schemes use. The step changes no weight; it observes the layer as the
earlier steps left it (after GPTQ, K and V come from the quantized k_proj/v_proj, as they will when served).
It also keeps each layer's mean key (after RoPE) per KV head and channel, the offsets a runtime cache that
centers its keys subtracts (formats/kv_cache.py: fp8 and 4-bit caches; without them the runtime measures
them at load on a short fixed text).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slimlm.compress.pipeline import StepResult
from slimlm.formats import kv_cache


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding on x [B, T, H, D] with cos/sin [B, T, D] (half-split convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class KVCache:
    needs_data = True
    changes_layer = False
    float_target = 0.0  # the pipeline's float chain: not wanted (pipeline.Step)

    def __init__(self, kv_dtype: str, strategy: str = "tensor") -> None:
        self.scheme = kv_cache.scheme(kv_dtype, strategy)
        self.kv_dtype, self.strategy = kv_dtype, strategy
        self._amax: dict[str, torch.Tensor] = {}
        self._key_sum, self._keys = None, 0  # this layer's sum of keys [Hkv, D] (float64) and their count
        self.key_offsets: list[torch.Tensor] = []  # each finished layer's mean key [Hkv, D]

    def observe(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> list[Any]:
        attn = layer.self_attn
        head_dim = attn.head_dim
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._amax, self._key_sum, self._keys = {}, None, 0

        def grab_rope(_module, args, kwargs) -> None:
            rope["cos_sin"] = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]

        def record(which: str):
            def hook(_module, _inputs, out: torch.Tensor) -> None:
                x = out.float().unflatten(-1, (-1, head_dim))  # [B, T, Hkv, D]
                if which == "k":
                    x = _rotate(x, *(t.float() for t in rope["cos_sin"]))
                    total = x.double().sum(dim=(0, 1))
                    self._key_sum = total if self._key_sum is None else self._key_sum + total
                    self._keys += x.shape[0] * x.shape[1]
                amax = x.abs().amax(dim=(0, 1, 3))
                self._amax[which] = torch.maximum(self._amax[which], amax) if which in self._amax else amax

            return hook

        return [
            attn.register_forward_pre_hook(grab_rope, with_kwargs=True),
            attn.k_proj.register_forward_hook(record("k")),
            attn.v_proj.register_forward_hook(record("v")),
        ]

    def apply(self, layer: nn.Module, linears: dict[str, nn.Linear]) -> StepResult:
        tensors = {
            f"self_attn.{which}_scale": kv_cache.scale_tensor(kv_cache.scale_for(amax, self.kv_dtype), self.strategy)
            for which, amax in self._amax.items()
        }
        self.key_offsets.append((self._key_sum / self._keys).float().cpu())
        return StepResult(tensors=tensors)

    def arguments(self) -> dict[str, Any]:
        return {"kv_cache_scheme": self.scheme}
