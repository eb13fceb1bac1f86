"""One sequence being generated: its tokens, how many of them have KV in the cache, its blocks, its clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from slimlm.runtime.kv_policy import KVPolicy
from slimlm.runtime.sampling import SamplingParams


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """How many tokens a and b share from the start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Status(Enum):
    WAITING = "waiting"  # no KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose K/V were computed (kv_policy may have evicted some since)
    num_evicted: int = 0  # of those, how many are no longer in the cache (kv_policy)
    kv_policy: KVPolicy = KVPolicy()
    kv_tokens: int = 0  # tokens whose K/V it held after its last step's evictions (what its policy kept)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block, in order
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_drafted: int = 0  # speculative tokens proposed for this sequence and verified
    num_accepted: int = 0  # of those, accepted by the target

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_resident(self) -> int:
        """Tokens whose K/V are in the sequence's blocks, in order: what its attention reads."""
        return self.num_computed - self.num_evicted

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def scores_prompt(self) -> bool:
        """Asks for its prompt's log-probabilities: its prompt runs exact and shares blocks only with its kind."""
        return self.params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
