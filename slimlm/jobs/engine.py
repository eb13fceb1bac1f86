"""The runtime's options, declared once: generate, serve and eval take them from here, and they become an
`EngineConfig` (whose own checks still apply: the engine is usable without any of this)."""

from __future__ import annotations

from typing import Annotated

from slimlm.formats.kv_cache import CACHE_DTYPES
from slimlm.jobs.options import Job, Opt, Switch, parse_size, positive_int
from slimlm.kernels.cpu_gemm import ACTIVATIONS

DTYPES = ("auto", "float32", "bfloat16", "float16")
Dtype = Annotated[
    str,
    Opt(
        "activations: auto = bf16 where this machine multiplies bf16 fast (AVX-512 BF16, AMX, GPUs), else fp32",
        choices=DTYPES,
    ),
]
Device = Annotated[str | None, Opt("cpu or cuda[:N] (default: cuda when available, else cpu)")]
Activations = Annotated[
    str,
    Opt(
        "how the CPU kernels multiply: auto = the fastest loop (on AVX2 a 4-bit linear takes x rounded to int8 per "
        "32 inputs, as llama.cpp does: +0.1-0.2% perplexity); exact = the checkpoint's arithmetic, what "
        "transformers and vLLM compute",
        choices=ACTIVATIONS,
    ),
]


class EngineMemory(Job):
    """What every engine a command builds needs: its dtype, KV pool, KV dtype and device."""

    dtype: Dtype = "auto"
    kv_cache_memory: Annotated[int, Opt("KV block pool size (e.g. 512M, 2G)", parse=parse_size)] = 512 << 20
    kv_cache_dtype: Annotated[
        str, Opt("KV cache storage: auto = the checkpoint's kv_cache_scheme, else --dtype", choices=CACHE_DTYPES)
    ] = "auto"
    device: Device = None
    activations: Activations = "auto"

    def engine_config(self, **more):
        """The options as the runtime's EngineConfig, plus the command's own (`more`)."""
        from slimlm.runtime.engine import EngineConfig

        fields = EngineConfig.__dataclass_fields__
        own = {name: getattr(self, name) for name in type(self).model_fields if name in fields}
        return EngineConfig(**own, **more)


class EngineOptions(EngineMemory):
    """The runtime's options, the same for generate and serve."""

    max_model_len: Annotated[
        int | None,
        Opt(
            "context length (default: the model's, or what the KV cache pool holds if that is less)", parse=positive_int
        ),
    ] = None
    speculative: Annotated[
        str | None,
        Opt(
            "speculative decoding: ngram (prompt lookup) or a draft model with the same tokenizer (asset, directory "
            "or hub id)",
            metavar="ngram|DRAFT",
        ),
    ] = None
    num_speculative_tokens: Annotated[int, Opt("drafted tokens per target pass", parse=positive_int)] = 4
    kv_policy: Annotated[
        str,
        Opt(
            "what a sequence keeps of its KV history: full; window (the first block and the newest tokens); snapkv "
            "(the prompt positions its last queries attend to most)",
            choices=("full", "window", "snapkv"),
        ),
    ] = "full"
    kv_budget: Annotated[
        int, Opt("tokens a window or snapkv sequence keeps (window: rounded up to whole blocks)", parse=positive_int)
    ] = 1024
    prefix_caching: Annotated[
        bool,
        Opt(
            flag=None,
            switches=(
                Switch("--no-prefix-caching", False, "do not share KV blocks between prompts with a common prefix"),
            ),
        ),
    ] = True
