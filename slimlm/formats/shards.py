"""Safetensors shards: writing them, finding them, reading them, and checking they are intact."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import safe_open, save_file

from slimlm import SlimlmError

MAX_SHARD_BYTES = 2 * 1024**3
INDEX = "model.safetensors.index.json"


class ShardWriter:
    """Writes tensors as they arrive: a file each time `max_bytes` of them have gathered, so a compression
    job holds at most one shard in memory, not the whole checkpoint. finish() names the files as
    transformers does (model.safetensors, or model-0000i-of-0000n.safetensors plus the index)."""

    def __init__(self, out: Path, max_bytes: int | None = None):
        self.out = Path(out)
        self.max_bytes = MAX_SHARD_BYTES if max_bytes is None else max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (file name so far, tensor names)
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + nbytes > self.max_bytes:
                self._flush()
            self.pending[name] = t.contiguous()
            self.pending_bytes += nbytes
            self.total += nbytes

    def _flush(self) -> None:
        fname = f"part-{len(self.written) + 1:05d}.safetensors"
        save_file(self.pending, self.out / fname, metadata={"format": "pt"})
        self.written.append((fname, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """The weight files' final names, in order."""
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            (self.out / self.written[0][0]).rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        names = [f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors" for i in range(len(self.written))]
        weight_map = {}
        for fname, (part, keys) in zip(names, self.written, strict=True):
            (self.out / part).rename(self.out / fname)
            weight_map.update(dict.fromkeys(keys, fname))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


def write(out: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Write `tensors` as model.safetensors, or as numbered shards plus an index past MAX_SHARD_BYTES."""
    shard_writer = ShardWriter(out)
    shard_writer.add(tensors)
    return shard_writer.finish()


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
    index = model_dir / INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise SlimlmError(f"{index} is corrupt; re-create or re-download the checkpoint") from None
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SlimlmError(f"{model_dir} has no .safetensors weights (pickle .bin files are not loaded, for safety)")
    return files


def total_size(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in weight_files(model_dir))


def check_layout(path: Path) -> None:
    """Header and length of one safetensors file, without reading its data."""
    bad = f"{path} is truncated or corrupt"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SlimlmError(f"{bad} (file is {size} bytes); re-create or re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SlimlmError(f"{bad} (header length {n} exceeds file size {size}); re-create or re-download it")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        raise SlimlmError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError):
        raise SlimlmError(f"{bad} (unreadable header); re-create or re-download it") from None
    if 8 + n + end != size:
        raise SlimlmError(f"{bad} (expected {8 + n + end} bytes, found {size}); re-create or re-download it")


def read(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    tensors[k] = f.get_tensor(k)
        except OSError as e:
            raise SlimlmError(f"cannot read {path}: {e.strerror or e}") from None
    return tensors
