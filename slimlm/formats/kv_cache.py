"""KV-cache quantization on disk: compressed-tensors' `kv_cache_scheme` and its k_scale/v_scale tensors.

A cached key or value x is stored as q = x / scale and read back as q · scale: fp8 e4m3 rounds to the
nearest fp8 and saturates at ±448, int8 rounds to the nearest integer in ±127. The scales are static
(calibrated on data, written once): one per attention module for all its KV heads (strategy "tensor", what
vLLM reads) or one per KV head ("attn_head"). Per decoder layer i:
    model.layers.{i}.self_attn.k_scale, .v_scale   float, [1] (tensor) or [kv_heads, 1, 1] (attn_head)
"""

from __future__ import annotations

import math

import torch

from slimlm.errors import SlimlmError

KV_DTYPES: dict[str, tuple[torch.dtype, float]] = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}
STRATEGIES = ("tensor", "attn_head")
# what a runtime's KV cache may hold; int4 is formats.kv_int4's (rounded per row as written: no scales on disk)
CACHE_DTYPES = ("auto", *KV_DTYPES, "int4", "float32", "bfloat16", "float16")
SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")


def scheme(kv_dtype: str, strategy: str) -> dict:
    """The `kv_cache_scheme` of quantization_config for a KV dtype and scale strategy."""
    if kv_dtype not in KV_DTYPES:
        raise SlimlmError(f"KV dtype '{kv_dtype}' is not supported; use one of {', '.join(KV_DTYPES)}")
    if strategy not in STRATEGIES:
        raise SlimlmError(f"KV scale strategy '{strategy}' is not supported; use one of {', '.join(STRATEGIES)}")
    kind = "float" if kv_dtype == "fp8" else "int"
    return {"num_bits": 8, "type": kind, "strategy": strategy, "dynamic": False, "symmetric": True}


def kv_dtype_of(kv_scheme: dict) -> str:
    """'fp8' or 'int8' for a kv_cache_scheme slimlm serves; anything else is named."""
    if not isinstance(kv_scheme, dict):
        raise SlimlmError(f"kv_cache_scheme is {kv_scheme!r}, not an object")
    bits, kind, strategy = kv_scheme.get("num_bits"), kv_scheme.get("type", "float"), kv_scheme.get("strategy")
    if bits != 8 or kind not in ("float", "int"):
        raise SlimlmError(
            f"kv_cache_scheme num_bits={bits} type={kind} is not supported; slimlm serves 8-bit "
            "float (fp8 e4m3) or int KV caches"
        )
    if strategy not in STRATEGIES or kv_scheme.get("dynamic") or not kv_scheme.get("symmetric", True):
        raise SlimlmError(
            f"kv_cache_scheme strategy={strategy} dynamic={kv_scheme.get('dynamic')} "
            f"symmetric={kv_scheme.get('symmetric')} is not supported; slimlm serves static symmetric "
            f"scales, strategy {' or '.join(STRATEGIES)}"
        )
    return "fp8" if kind == "float" else "int8"


def scale_for(amax: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """The scale that maps |x| <= amax onto the KV dtype's full range (a zero amax keeps scale 1)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / KV_DTYPES[kv_dtype][1], torch.ones_like(amax))


def scale_tensor(per_head: torch.Tensor, strategy: str) -> torch.Tensor:
    """Per-KV-head scales [Hkv] in the stored shape of `strategy` (the largest for "tensor")."""
    return per_head.max().reshape(1) if strategy == "tensor" else per_head.reshape(-1, 1, 1)


def scale_names(layer: int, prefix: str = "model.layers") -> tuple[str, str]:
    return tuple(f"{prefix}.{layer}{suffix}" for suffix in SUFFIXES)


def read_scales(
    tensors: dict[str, torch.Tensor], kv_scheme: dict, layers: int, kv_heads: int, where: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pop every layer's k_scale/v_scale out of `tensors`, checked, as fp32 [kv_heads] per (K, V)."""
    strategy = kv_scheme.get("strategy")
    shape = (1,) if strategy == "tensor" else (kv_heads, 1, 1)
    out = []
    for i in range(layers):
        pair = []
        for name in scale_names(i):
            t = tensors.pop(name, None)
            if t is None:
                raise SlimlmError(
                    f"{where}: kv_cache_scheme is set but {name} is missing; the checkpoint is "
                    "incomplete (re-run compress kv)"
                )
            if t.numel() != math.prod(shape) or not t.is_floating_point():
                raise SlimlmError(
                    f"{where}: {name} is {list(t.shape)} {t.dtype}; strategy {strategy} with "
                    f"{kv_heads} KV heads implies a float {list(shape)}"
                )
            if not torch.isfinite(t).all() or (t <= 0).any():
                raise SlimlmError(
                    f"{where}: {name} holds {t.flatten().tolist()[:4]}; KV scales must be finite "
                    "and positive (re-run compress kv)"
                )
            pair.append(t.float().flatten().expand(kv_heads).contiguous())
        out.append((pair[0], pair[1]))
    return out
