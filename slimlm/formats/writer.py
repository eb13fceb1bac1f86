"""A checkpoint's contents: each quantized linear in its format's tensors, then config, tokenizer and manifest.

Callers own the directory: they get it from atomic.atomic_dir, which puts it in place only when complete.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from slimlm.errors import FieldError
from slimlm.formats import compressed_tensors, gptq_v1, manifest
from slimlm.formats.quantized import QuantArgs, QuantizedWeight

FORMATS = ("compressed-tensors", "gptq")


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, each stored once: tied weights (lm_head = embed_tokens) keep their first name."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().contiguous()
    return out


def quantization_config(
    fmt: str,
    args: QuantArgs | None,
    ignore: list[str],
    method_args: dict,
    named: dict[str, QuantArgs] | None = None,
    layers: dict[str, QuantArgs] | None = None,
) -> dict:
    """The config's quantization_config; `method_args` carries act_order, damp and kv_cache_scheme; `named`
    the modules with a scheme of their own rounded to nearest (an lm_head), `layers` the linears the method
    quantized at a scheme other than `args` (a budget's mix; compressed-tensors only)."""
    if fmt not in FORMATS:
        raise FieldError("format", f"{fmt} is not supported; use one of {', '.join(FORMATS)}")
    kv_scheme = method_args.get("kv_cache_scheme")
    if fmt == "gptq":
        if kv_scheme is not None:
            raise FieldError(
                "format",
                "{format} gptq has no place for KV-cache scales; use {format} compressed-tensors to quantize the KV "
                "cache too",
            )
        if any(own != args for own in [*(named or {}).values(), *(layers or {}).values()]):
            raise FieldError(
                "format",
                "{format} gptq stores one scheme for every linear; use {format} compressed-tensors for an lm_head of "
                "other bits or a budget's mix",
            )
        return gptq_v1.quantization_config(args, method_args.get("act_order"), method_args.get("damp"))
    return compressed_tensors.quantization_config(args, ignore, method_args.get("act_order"), kv_scheme, named, layers)


def quantized_tensors(
    quantized: dict[str, QuantizedWeight], float_tensors: dict[str, torch.Tensor], fmt: str
) -> dict[str, torch.Tensor]:
    """Float tensors as they are, each quantized linear's weight replaced by its format's tensors."""
    per_linear = gptq_v1.to_tensors if fmt == "gptq" else compressed_tensors.to_tensors
    tensors = dict(float_tensors)
    for name, q in quantized.items():
        tensors.pop(f"{name}.weight", None)
        tensors.update({f"{name}.{key}": t.cpu() for key, t in per_linear(q).items()})
    return tensors


def write_metadata(
    out: Path,
    files: list[str],
    config,
    tokenizer,
    meta: dict,
    config_patch: dict | None = None,
    generation_config=None,
) -> None:
    """Everything but the weights, which `files` (in `out`, from shards.write or a ShardWriter) already hold:
    config, tokenizer, manifest. `config` is a transformers PretrainedConfig; `config_patch` is merged into
    its config.json (a quantization_config, or the fields a pruned or GQA-converted model changes)."""
    out = Path(out)
    config.save_pretrained(out)
    if config_patch:
        data = json.loads((out / "config.json").read_text())
        data.update(config_patch)
        (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if generation_config is not None:
        generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    manifest.write(out, meta, files)
