"""The bench's settings, and the engine and KV pool they give each measured model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from slimlm.errors import FieldError
from slimlm.eval import plan


@dataclass
class BenchConfig:
    batch: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    context: int = 512
    prefill_len: int = 512
    steps: int = 5  # decode steps timed per batch size (the median is kept)
    rounds: int = 3  # measurements of each system, in turn (offline: each figure's median; online: the median run)
    kv_cache_memory: int | None = None  # None: what the largest decode batch at `context` needs
    dtype: str = "auto"
    activations: str = "auto"  # EngineConfig.activations
    requests: int = 24
    rate: float = 2.0  # Poisson arrivals per second
    prompt_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (16, 64)
    slo_ttft: float = 2.0
    slo_itl: float = 0.2
    seed: int = 0
    http: bool = False  # also send the workload to `compress serve` over HTTP


def baseline_of(model_dir: Path) -> str:
    """The float source a checkpoint names in its slimlm.json, or a one-line error saying to pass one."""
    manifest = Path(model_dir) / "slimlm.json"
    source = json.loads(manifest.read_text()).get("source_model", {}) if manifest.exists() else {}
    spec = source.get("spec") or source.get("path")
    if not spec:
        raise FieldError("baseline", f"{model_dir} names no source model in a slimlm.json; pass {{baseline}} DIR")
    return spec


def pool_bytes(model: str, config: BenchConfig) -> int:
    """The KV pool: as given, or enough for the largest decode batch at `context` (4 bytes per element, the
    most any cache dtype takes) and at least 512 MiB for the online workload."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    from slimlm import models

    dims = plan.Dims.from_config(models.read_config(models.resolve(model)))
    blocks = max(config.batch) * -(-(config.context + 1) // 16) + 1  # the engine's 16-token blocks
    return max(512 << 20, blocks * 16 * plan.kv_bytes_per_token(dims, "fp32"))


def max_seqs(config: BenchConfig) -> int:
    return max(64, max(config.batch))


def engine_for(model: str, config: BenchConfig, max_len: int):
    from slimlm.runtime.engine import Engine, EngineConfig

    return Engine(
        model,
        EngineConfig(
            dtype=config.dtype,
            activations=config.activations,
            kv_cache_memory=pool_bytes(model, config),
            max_model_len=max_len,
            max_num_seqs=max_seqs(config),
            max_num_batched_tokens=max(512, config.prefill_len),
        ),
    )
