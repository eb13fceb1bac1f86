"""slimlm.json: how a checkpoint was made and what it measured; one schema, written here only.

method          "rtn", "gptq", "awq+gptq", "float", ...
arguments       the method's settings
calibration     {source, num_samples, seq_len, seed} or null
source_model    {spec, path, sha256}
source_size_bytes, compress_seconds, layers (per-layer report)
tool            "slimlm <version>"
size_bytes      bytes of the weight files
files           {weight file name: sha256}: what `verify` checks before anything is loaded
"""

from __future__ import annotations

import json
from pathlib import Path

from slimlm.errors import SlimlmError
from slimlm.formats import shards
from slimlm.version import __version__

NAME = "slimlm.json"


def write(checkpoint_dir: Path, meta: dict, files: list[str]) -> None:
    meta = dict(meta)
    meta["tool"] = f"slimlm {__version__}"
    meta["size_bytes"] = sum((checkpoint_dir / f).stat().st_size for f in files)
    meta["files"] = {f: shards.sha256(checkpoint_dir / f) for f in files}
    (checkpoint_dir / NAME).write_text(json.dumps(meta, indent=2) + "\n")


def read(checkpoint_dir: Path) -> dict | None:
    """The manifest, or None for a checkpoint slimlm did not write."""
    path = Path(checkpoint_dir) / NAME
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SlimlmError(f"{path} is unreadable ({e}); re-create the checkpoint") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
        raise SlimlmError(f"{path} is not a slimlm manifest; re-create the checkpoint")
    return meta


def verify(checkpoint_dir: Path) -> None:
    """Every weight file's header and length, and its sha256 where the manifest records one."""
    checkpoint_dir = Path(checkpoint_dir)
    for path in shards.weight_files(checkpoint_dir):
        if not path.exists():
            raise SlimlmError(f"checkpoint {checkpoint_dir} is missing {path.name}; re-create or re-download it")
        shards.check_layout(path)
    meta = read(checkpoint_dir)
    for fname, digest in (meta or {}).get("files", {}).items():
        if not (checkpoint_dir / fname).exists():
            raise SlimlmError(f"checkpoint {checkpoint_dir} is missing {fname}; re-create it")
        if shards.sha256(checkpoint_dir / fname) != digest:
            raise SlimlmError(f"{checkpoint_dir / fname} does not match the sha256 in {NAME} (corrupted); re-create it")
