"""slimlm: post-training compression for LLMs, with its own serving runtime."""

from slimlm.cache import cache_dir
from slimlm.errors import SlimlmError
from slimlm.version import __version__

__all__ = ["LLM", "SamplingParams", "SlimlmError", "__version__", "cache_dir"]


def __getattr__(name: str):
    # `from slimlm import LLM, SamplingParams`, where vLLM users look, without making `import slimlm`
    # (which every module does, for slimlm.errors) load the runtime.
    if name == "LLM":
        from slimlm.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from slimlm.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'slimlm' has no attribute {name!r}")
