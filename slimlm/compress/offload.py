"""Keep the model on disk and bring one decoder layer at a time into memory.

The source checkpoint's safetensors files are the offload store: a quantization job builds the model with
empty (meta) weights, loads the embeddings, and then, for each decoder layer in turn, reads that layer's
tensors, compresses it, hands it to the checkpoint writer and drops it again. Peak memory is one float
decoder layer (as read, and its dequantized copy) plus the calibration activations plus at most one shard
waiting to be written, whatever the model's size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.formats import reader, shards


class LazyWeights:
    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files: dict[str, Path] = {}
        self.dtypes: dict[str, torch.dtype] = {}  # as stored
        for path in shards.weight_files(model_dir):
            with safe_open(path, framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), path))
                self.dtypes.update({k: shards.DTYPES[f.get_slice(k).get_dtype()] for k in f.keys()})

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the named tensors. Files are opened per call so their pages never stay mapped."""
        out = {}
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        for path, keys in by_file.items():
            with safe_open(path, framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in keys})
        for name, t in out.items():  # every job reads its source here: one check for all of them
            if not reader.all_finite(t):
                raise SlimlmError(f"{self.model_dir}: tensor {name} holds NaN or Inf; the source model is broken")
        return out

    def names_outside(self, prefix: str) -> list[str]:
        return [n for n in self.files if not n.startswith(prefix)]

    def materialize(self, module: nn.Module, prefix: str, dtype: torch.dtype, device: torch.device | str) -> None:
        """Give a meta-device module its real weights from disk."""
        wanted = [f"{prefix}.{k}" for k in module.state_dict()]
        tensors = self.read([n for n in wanted if n in self.files])
        state = {
            k[len(prefix) + 1 :]: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
            for k, v in tensors.items()
        }
        missing = set(module.state_dict()) - set(state)
        if missing:
            raise SlimlmError(f"the checkpoint lacks {prefix}.{sorted(missing)[0]} (and maybe more)")
        module.load_state_dict(state, assign=True)
