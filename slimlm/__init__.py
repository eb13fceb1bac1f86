"""slimlm: post-training compression for LLMs, with its own serving runtime."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """Where assets and built kernels are cached (SLIMLM_CACHE, default ~/.cache/slimlm)."""
    return Path(os.environ.get("SLIMLM_CACHE", Path.home() / ".cache" / "slimlm"))


class SlimlmError(Exception):
    """A problem the user can fix. The CLI prints its message as one line and exits non-zero."""


def __getattr__(name: str):
    # `from slimlm import LLM, SamplingParams`, where vLLM users look, without making `import slimlm`
    # (which the formats and kernels do for SlimlmError) load the runtime.
    if name == "LLM":
        from slimlm.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from slimlm.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'slimlm' has no attribute {name!r}")
