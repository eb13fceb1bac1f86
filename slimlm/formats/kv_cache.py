"""KV-cache quantization on disk: compressed-tensors' `kv_cache_scheme` and its k_scale/v_scale tensors.

A cached key or value x is stored as q = x / scale and read back as q · scale: fp8 e4m3 rounds to the
nearest fp8 and saturates at ±448, int8 rounds to the nearest integer in ±127. The scales are static
(calibrated on data, written once): one per attention module for all its KV heads (strategy "tensor", what
vLLM reads) or one per KV head ("attn_head"). Per decoder layer i:
    model.layers.{i}.self_attn.k_scale, .v_scale   float, [1] (tensor) or [kv_heads, 1, 1] (attn_head)

In the runtime's fp8 cache (head dimensions that are powers of two) a key is stored less its layer's mean key μ
and rotated, (k − μ)·H with H formats.kv_int4's orthonormal Hadamard matrix, and every query is rotated alike:
q·k − q·μ = (q·H)·((k − μ)·H), and no softmax sees q·μ. fp8 rounds each value relative to itself, so a key's few
large channels (the ones a query weighs most) lose the most; rotated, every channel carries a share of them
(SmolLM2, wiki perplexity over a float cache, 16K tokens through the runtime: +1.15% -> +0.44-0.63%). A rotated
value reaches at most √D·max|k − μ| <= 2√D·max|k|, so keys are stored at 2√D times their calibrated scale
(key_scale_factor): never clipped, and fp8's relative precision does not depend on the scale.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from slimlm.errors import SlimlmError
from slimlm.formats import kv_int4

KV_DTYPES: dict[str, tuple[torch.dtype, float]] = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}
STRATEGIES = ("tensor", "attn_head")
# what a runtime's KV cache may hold; int4 is formats.kv_int4's (rounded per row as written: no scales on disk)
CACHE_DTYPES = ("auto", *KV_DTYPES, "int4", "float32", "bfloat16", "float16")
SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale")


def key_rotation(cache_dtype: torch.dtype, head_dim: int, device: str = "cpu") -> torch.Tensor | None:
    """H [D, D] fp32 for the keys and queries of a cache that stores rotated keys (fp8), else None."""
    if cache_dtype != torch.float8_e4m3fn or head_dim & (head_dim - 1):
        return None
    return kv_int4.rotation(head_dim, device)


def key_scale_factor(head_dim: int) -> float:
    """What a rotated cache's key scales are multiplied by (module docstring): 2√D."""
    return 2 * head_dim**0.5


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


# Key offsets calibrated by compress kv: each layer's mean key (after RoPE) per KV head and channel over the
# calibration windows, what a cache that centers its keys (fp8, 4-bit) subtracts. A file beside the weights,
# named in slimlm.json, since neither vLLM nor transformers accept an unknown tensor in the safetensors:
#     key_offsets.json   {"key_offsets": [layer][kv_head][head_dim] floats}
KEY_OFFSETS_FILE = "key_offsets.json"


def write_key_offsets(checkpoint_dir: Path, offsets: list[torch.Tensor]) -> dict:
    """Write offsets [layers × [kv_heads, head_dim]]; returns slimlm.json's record of them."""
    values = [[[float(f"{v:.7g}") for v in head] for head in layer.tolist()] for layer in offsets]
    (Path(checkpoint_dir) / KEY_OFFSETS_FILE).write_text(json.dumps({"key_offsets": values}) + "\n")
    return {"key_offsets": KEY_OFFSETS_FILE, "key_offsets_are": "mean key after RoPE over the calibration windows"}


def read_key_offsets(checkpoint_dir: Path, meta: dict | None, layers: int, kv_heads: int, head_dim: int):
    """The checkpoint's calibrated key offsets as fp32 [kv_heads, head_dim] per layer, or None without them."""
    record = (meta or {}).get("kv_cache") or {}
    if "key_offsets" not in record:
        return None
    path = Path(checkpoint_dir) / KEY_OFFSETS_FILE
    try:
        offsets = torch.tensor(json.loads(path.read_text(encoding="utf-8"))["key_offsets"], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SlimlmError(f"{path}: unreadable key offsets ({e}); re-run compress kv") from None
    if offsets.shape != (layers, kv_heads, head_dim) or not torch.isfinite(offsets).all():
        raise SlimlmError(
            f"{path}: key offsets of shape {list(offsets.shape)} (finite: {bool(torch.isfinite(offsets).all())}); "
            f"this model needs finite [{layers}, {kv_heads}, {head_dim}] (re-run compress kv)"
        )
    return list(offsets)
