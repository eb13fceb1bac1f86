"""Reading a checkpoint: its config, then its tensors, split into quantized linears and float tensors by
the reader that its `quant_method` names (one module per format), every tensor checked against the
config and against the shapes the model expects before anything is built from it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from slimlm.errors import SlimlmError
from slimlm.formats import awq_gemm, compressed_tensors, gptq_v1, kv_cache, shards
from slimlm.formats.quantized import QuantizedWeight

READERS: dict[str, ModuleType] = {"compressed-tensors": compressed_tensors, "gptq": gptq_v1, "awq": awq_gemm}


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SlimlmError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise SlimlmError(f"{path} is not a JSON object; re-create or re-download the checkpoint")
    return config


def quantization(config: dict, where: Path) -> tuple[ModuleType, object] | None:
    """(reader module, QuantArgs) for a quantized checkpoint's config, None for a float one; QuantArgs is
    None when only the KV cache is quantized."""
    if "quantization_config" not in config:
        return None
    qcfg = config["quantization_config"]
    if not isinstance(qcfg, dict):
        raise SlimlmError(f"{where}/config.json: quantization_config is {qcfg!r}, not an object")
    method = qcfg.get("quant_method")
    if method not in READERS:
        raise SlimlmError(f"{where}: quant_method '{method}' is not supported; slimlm reads {', '.join(READERS)}")
    try:
        return READERS[method], READERS[method].args_from_config(qcfg)
    except SlimlmError as e:
        raise SlimlmError(f"{where}/config.json quantization_config: {e}") from None


def kv_cache_scheme(config: dict, where: Path) -> dict | None:
    """The checkpoint's kv_cache_scheme (checked: one slimlm serves), None when its KV cache is not quantized."""
    qcfg = config.get("quantization_config")
    scheme = qcfg.get("kv_cache_scheme") if isinstance(qcfg, dict) else None
    if scheme is not None:
        try:
            kv_cache.kv_dtype_of(scheme)
        except SlimlmError as e:
            raise SlimlmError(f"{where}/config.json: {e}") from None
    return scheme


def read_checkpoint(
    model_dir: Path,
    expected: dict[str, tuple[int, ...]] | None = None,
    optional: set[str] = frozenset(),
    convert: Callable[[QuantizedWeight], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(quantized linears by module name, float tensors by name).

    With `expected` (parameter name -> shape, what the model built from config.json holds), every one of
    them must be present, as a float tensor or as a quantized linear of that shape, except those in
    `optional` (a tied lm_head); nothing else may be; float tensors, scales and zero points must be finite.
    KV-cache scales stay among the float tensors (kv_cache.read_scales checks and takes them).
    `convert` turns each linear into what the caller keeps (the kernels' layout) as soon as it is read, so
    no more than one linear's unpacked codes exist at a time: the loader's peak memory is the file's size."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    q = quantization(config, model_dir)
    tensors = shards.read(model_dir)
    quantized: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    if q is not None and q[1] is not None:
        reader, args = q
        named = compressed_tensors.named_args(config["quantization_config"]) if reader is compressed_tensors else {}
        names = [k[: -len(reader.MARKER) - 1] for k in tensors if k.endswith("." + reader.MARKER)]
        for name in names:
            parts = {key: tensors.pop(f"{name}.{key}") for key in reader.KEYS if f"{name}.{key}" in tensors}
            try:
                weight = reader.from_tensors(parts, named.get(name, args), name)
            except SlimlmError as e:
                raise SlimlmError(f"{model_dir}: {e}") from None
            del parts  # the file's packed copy: freed once `convert` has made its own
            _check_finite(model_dir, f"{name}.weight_scale", weight.scale)
            shapes[f"{name}.weight"] = tuple(weight.codes.shape)
            quantized[name] = weight if convert is None else convert(weight)
            del weight
    for name, t in tensors.items():
        _check_finite(model_dir, name, t)
    if expected is not None:
        if kv_cache_scheme(config, model_dir) is not None:
            expected = {**expected, **{k: tuple(t.shape) for k, t in tensors.items() if k.endswith(kv_cache.SUFFIXES)}}
        _check_against_model(model_dir, shapes, tensors, expected, optional)
    return quantized, tensors


def _check_finite(model_dir: Path, name: str, t: torch.Tensor) -> None:
    if not all_finite(t):
        raise SlimlmError(f"{model_dir}: tensor {name} holds NaN or Inf; the checkpoint is broken")


def all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """No NaN or Inf in a float tensor (any other dtype passes). In slices: torch.isfinite on a whole bf16
    embedding table made ~0.9 GB of temporaries, the loader's peak."""
    if not t.is_floating_point():
        return True
    flat = t.reshape(-1)
    return all(torch.isfinite(flat[i : i + chunk]).all() for i in range(0, flat.numel(), chunk))


def _check_against_model(model_dir, quantized_shapes, tensors, expected, optional) -> None:
    found = {**{k: tuple(v.shape) for k, v in tensors.items()}, **quantized_shapes}
    missing = sorted(set(expected) - set(found) - set(optional))
    if missing:
        hint = (
            " (a quantized checkpoint whose quantization_config was removed?)"
            if any(k.endswith((".weight_packed", ".qweight")) for k in found)
            else ""
        )
        raise SlimlmError(
            f"{model_dir} has no tensor {missing[0]} ({len(missing)} missing){hint}; the checkpoint is incomplete"
        )
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise SlimlmError(
            f"{model_dir} holds tensor {unexpected[0]} that its config.json does not describe "
            f"({len(unexpected)} unexpected); the checkpoint does not match its config"
        )
    for name, shape in expected.items():
        if name in found and found[name] != tuple(shape):
            raise SlimlmError(f"{model_dir}: {name} is {list(found[name])}, config.json implies {list(shape)}")
