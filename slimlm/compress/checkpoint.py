"""compressed-tensors `pack-quantized` checkpoints: write them atomically, verify them, read them back.

Layout per quantized linear `name` (what vLLM and transformers' compressed-tensors loader expect):
    name.weight_packed      int32 [out, ceil(in·b/32)]  codes + 2^(b−1), a dense little-endian bit stream per row
    name.weight_scale       float [out, groups]
    name.weight_zero_point  int32 [ceil(out·b/32), groups]  asymmetric only; packed the same way along dim 0
    name.weight_shape       int64 [2]
    name.weight_g_idx       int32 [in]  act-order only
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import safe_open, save_file

from slimlm import SlimlmError, __version__
from slimlm.compress import awq_gemm, gptq_v1
from slimlm.compress.memory import return_freed_memory
from slimlm.compress.packing import pack_int32, unpack_int32
from slimlm.compress.quantize import QuantArgs, QuantizedWeight

MAX_SHARD_BYTES = 2 * 1024**3
FORMATS = ("compressed-tensors", "gptq")
SLIMLM_JSON = "slimlm.json"


# ---- config --------------------------------------------------------------------------------------------


def quantization_config(args: QuantArgs, ignore: list[str], act_order: str | None = None) -> dict:
    weights = {
        "num_bits": args.bits,
        "type": "int",
        "symmetric": args.sym,
        "group_size": None if args.group_size == -1 else args.group_size,
        "strategy": "channel" if args.group_size == -1 else "group",
        "dynamic": False,
        "actorder": act_order,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def _args_from_config(qcfg: dict) -> QuantArgs:
    if qcfg.get("quant_method") != "compressed-tensors" or qcfg.get("format") != "pack-quantized":
        raise SlimlmError(
            f"quantization config {qcfg.get('quant_method')}/{qcfg.get('format')} is not supported yet; "
            "slimlm reads compressed-tensors pack-quantized, GPTQ v1 and AWQ GEMM checkpoints"
        )
    groups = list(qcfg.get("config_groups", {}).values())
    if len(groups) != 1 or not groups[0].get("weights"):
        raise SlimlmError("only checkpoints with one weight quantization group are supported")
    if groups[0].get("input_activations"):
        raise SlimlmError("activation quantization (W·A· schemes) is not supported; slimlm serves weight-only schemes")
    w = groups[0]["weights"]
    if w.get("type", "int") != "int" or w.get("strategy") not in (None, "group", "channel"):
        raise SlimlmError(f"weight scheme type={w.get('type')} strategy={w.get('strategy')} is not supported; "
                          "slimlm serves integer per-group or per-channel weights")  # fmt: skip
    return QuantArgs(bits=w["num_bits"], group_size=w.get("group_size") or -1, sym=w["symmetric"])


# ---- write -------------------------------------------------------------------------------------------


def prepare_output(out_dir: Path, overwrite: bool) -> None:
    """Fail before any work is done if the output exists and may not be replaced."""
    if out_dir.exists() and not overwrite:
        raise SlimlmError(f"output directory {out_dir} exists; pass --overwrite to replace it")


@contextmanager
def atomic_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp dir beside `out_dir`; on success it replaces `out_dir`, on failure it vanishes."""
    out_dir = Path(out_dir).resolve()
    prepare_output(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        yield tmp
        if out_dir.exists():
            trash = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
            os.replace(out_dir, trash / "old")
            os.replace(tmp, out_dir)
            shutil.rmtree(trash)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def compressed_tensors(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    out = {
        "weight_packed": pack_int32(q.codes, q.args.bits, dim=1),
        "weight_scale": q.scale.contiguous(),
        "weight_shape": torch.tensor(q.codes.shape, dtype=torch.int64),
    }
    if q.zero is not None:
        out["weight_zero_point"] = pack_int32(q.zero, q.args.bits, dim=0)
    if q.g_idx is not None:
        out["weight_g_idx"] = q.g_idx.to(torch.int32).contiguous()
    return out


def save(
    out_dir: Path,
    model: torch.nn.Module,
    tokenizer,
    quantized: dict[str, QuantizedWeight],
    float_tensors: dict[str, torch.Tensor],
    args: QuantArgs,
    ignore: list[str],
    meta: dict,
    overwrite: bool = False,
    fmt: str = "compressed-tensors",
) -> Path:
    """Write a checkpoint (compressed-tensors, or GPTQ v1 with fmt="gptq") plus slimlm.json, atomically.

    `float_tensors` are the tensors stored as they are; `model` supplies the config and generation config.
    """
    if fmt not in FORMATS:
        raise SlimlmError(f"--format {fmt} is not supported; use one of {', '.join(FORMATS)}")
    method_args = meta.get("arguments", {})
    if fmt == "gptq":
        qconfig = gptq_v1.quantization_config(args, method_args.get("act_order"), method_args.get("damp"))
    else:
        qconfig = quantization_config(args, ignore, method_args.get("act_order"))
    per_linear = gptq_v1.to_tensors if fmt == "gptq" else compressed_tensors
    tensors = dict(float_tensors)
    for name, q in quantized.items():
        tensors.pop(f"{name}.weight", None)
        for key, t in per_linear(q).items():
            tensors[f"{name}.{key}"] = t.cpu()
    return_freed_memory()
    out_dir = Path(out_dir).resolve()
    with atomic_dir(out_dir, overwrite) as tmp:
        files = _write_shards(tmp, tensors)
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = dict(meta)
        meta["tool"] = f"slimlm {__version__}"
        meta["size_bytes"] = sum((tmp / f).stat().st_size for f in files)
        meta["files"] = {f: sha256(tmp / f) for f in files}
        (tmp / SLIMLM_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def _write_shards(out: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def sha256(*paths: Path) -> str:
    """sha256 over the files' bytes, in order, read in chunks."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the model: per the shard index, else model.safetensors, else all."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError):
            raise SlimlmError(f"{index} is corrupt; re-create or re-download the checkpoint") from None
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SlimlmError(f"{model_dir} has no .safetensors weights (pickle .bin files are not loaded, for safety)")
    return files


def checkpoint_size(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in weight_files(model_dir))


# ---- verify and read -----------------------------------------------------------------------------------


def verify(model_dir: Path) -> None:
    """Check every safetensors file's header and length, and its sha256 when slimlm.json records one."""
    model_dir = Path(model_dir)
    for path in weight_files(model_dir):
        if not path.exists():
            raise SlimlmError(f"checkpoint {model_dir} is missing {path.name}; re-create or re-download it")
        _check_safetensors_layout(path)
    meta_path = model_dir / SLIMLM_JSON
    if meta_path.exists():
        try:
            recorded = json.loads(meta_path.read_text()).get("files", {})
        except json.JSONDecodeError as e:
            raise SlimlmError(f"{meta_path} is not valid JSON ({e}); re-create the checkpoint") from None
        for fname, digest in recorded.items():
            if not (model_dir / fname).exists():
                raise SlimlmError(f"checkpoint {model_dir} is missing {fname}; re-create it")
            if sha256(model_dir / fname) != digest:
                raise SlimlmError(
                    f"{model_dir / fname} does not match the sha256 in slimlm.json (corrupted); re-create it"
                )


def _check_safetensors_layout(path: Path) -> None:
    size = path.stat().st_size
    bad = f"{path} is truncated or corrupt"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SlimlmError(f"{bad} (file is {size} bytes); re-create or re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SlimlmError(f"{bad} (header length {n} exceeds file size {size}); re-create or re-download it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SlimlmError(f"{bad} (unreadable header); re-create or re-download it") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise SlimlmError(f"{bad} (expected {8 + n + end} bytes, found {size}); re-create or re-download it")


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weight_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    return tensors


def read_quantized(model_dir: Path) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Split a checkpoint (compressed-tensors, GPTQ v1 or AWQ GEMM) into its quantized linears and the float rest."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qcfg = config["quantization_config"]
    tensors = read_tensors(model_dir)
    if qcfg.get("quant_method") in ("gptq", "awq"):
        v1 = qcfg["quant_method"] == "gptq"
        fmt = gptq_v1 if v1 else awq_gemm
        args = fmt.args_from_config(qcfg)
        names = [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]
        keys = ("qweight", "qzeros", "scales", "g_idx") if v1 else ("qweight", "qzeros", "scales")
        return {n: fmt.from_tensors({k: tensors.pop(f"{n}.{k}") for k in keys}, args) for n in names}, tensors
    args = _args_from_config(qcfg)
    names = [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]
    quantized = {}
    for name in names:
        shape = tensors.pop(f"{name}.weight_shape").tolist()
        packed = tensors.pop(f"{name}.weight_packed")
        scale = tensors.pop(f"{name}.weight_scale")
        zp = tensors.pop(f"{name}.weight_zero_point", None)
        g_idx = tensors.pop(f"{name}.weight_g_idx", None)
        codes = unpack_int32(packed, args.bits, shape[1], dim=1)
        zero = None if zp is None else unpack_int32(zp, args.bits, shape[0], dim=0)
        quantized[name] = QuantizedWeight(codes, scale, zero, args, g_idx)
    return quantized, tensors


def load_compressed(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A float transformers model holding the dequantized weights of a compressed checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quantized, tensors = read_quantized(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    state.update({f"{n}.weight": q.dequantize(dtype) for n, q in quantized.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SlimlmError(
            f"checkpoint {model_dir} does not match its config: missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    if tied:
        model.tie_weights()
    return model
