"""Where slimlm keeps what it downloads and builds."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where assets and built kernels are cached (SLIMLM_CACHE, default ~/.cache/slimlm)."""
    return Path(os.environ.get("SLIMLM_CACHE", Path.home() / ".cache" / "slimlm"))
