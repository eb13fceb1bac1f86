"""What `/metrics` reports, in Prometheus' text format: latency histograms, queue and KV-pool gauges, counters.

Request-level numbers (TTFT, inter-token latency, finish reasons, prefix-cache hits, speculative acceptance)
are recorded on the event loop as outputs arrive; the engine's own state (queues, free blocks, preemptions)
is a snapshot the engine thread publishes after every step, so reading it never races the scheduler.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {running}"]


@dataclass
class EngineSnapshot:
    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    preemptions: int = 0
    aborted: int = 0  # requests the engine stopped because their client disconnected


@dataclass
class Metrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejected_overloaded: int = 0  # 503s: the waiting queue was full, or the server was draining

    def finish(self, output) -> None:
        """A finished RequestOutput: its counts."""
        self.prompt_tokens += len(output.prompt_token_ids)
        self.cached_prompt_tokens += output.num_cached_tokens
        for choice in output.outputs:
            reason = choice.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.generation_tokens += len(choice.token_ids)
            self.drafted_tokens += choice.num_drafted
            self.accepted_tokens += choice.num_accepted

    def render(self, engine: EngineSnapshot, in_flight: int) -> str:
        def one(name: str, kind: str, help_: str, value) -> list[str]:
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]

        lines = [
            "# HELP slimlm_time_to_first_token_seconds Request arrival to its first token.",
            "# TYPE slimlm_time_to_first_token_seconds histogram",
            *self.ttft.lines("slimlm_time_to_first_token_seconds"),
            "# HELP slimlm_inter_token_latency_seconds Time between consecutive tokens of a sequence.",
            "# TYPE slimlm_inter_token_latency_seconds histogram",
            *self.itl.lines("slimlm_inter_token_latency_seconds"),
            "# HELP slimlm_requests_finished_total Finished sequences by finish reason.",
            "# TYPE slimlm_requests_finished_total counter",
        ]
        for reason, n in sorted(self.finished.items()):
            lines.append(f'slimlm_requests_finished_total{{finish_reason="{reason}"}} {n}')
        hit_rate = self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        acceptance = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        for args in [
            ("slimlm_requests_in_flight", "gauge", "Requests the server is answering.", in_flight),
            ("slimlm_num_requests_running", "gauge", "Sequences in the running batch.", engine.running),
            ("slimlm_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", engine.waiting),
            ("slimlm_kv_blocks_pool", "gauge", "KV cache blocks in the pool.", engine.total_blocks),
            ("slimlm_kv_blocks_free", "gauge", "KV cache blocks no sequence holds.", engine.free_blocks),
            (
                "slimlm_kv_blocks_used",
                "gauge",
                "KV cache blocks held by sequences.",
                engine.total_blocks - engine.free_blocks,
            ),
            (
                "slimlm_requests_aborted_total",
                "counter",
                "Requests stopped because the client disconnected.",
                engine.aborted,
            ),
            ("slimlm_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.", engine.preemptions),
            ("slimlm_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
            (
                "slimlm_prefix_cache_hit_tokens_total",
                "counter",
                "Of those, served from the prefix cache.",
                self.cached_prompt_tokens,
            ),
            ("slimlm_prefix_cache_hit_rate", "gauge", "Prefix-cache hit tokens / prompt tokens.", hit_rate),
            ("slimlm_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
            (
                "slimlm_spec_decode_draft_tokens_total",
                "counter",
                "Speculative tokens drafted and verified.",
                self.drafted_tokens,
            ),
            ("slimlm_spec_decode_accepted_tokens_total", "counter", "Of those, accepted.", self.accepted_tokens),
            ("slimlm_spec_decode_acceptance_rate", "gauge", "Accepted / drafted.", acceptance),
            ("slimlm_requests_rejected_total", "counter", "Requests answered 503.", self.rejected_overloaded),
        ]:
            lines += one(*args)
        return "\n".join(lines) + "\n"
