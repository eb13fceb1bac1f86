"""Prometheus text: cumulative `le` buckets (a value on a bound counts in it), sums, counts and gauges."""

from slimlm.runtime.outputs import CompletionOutput, RequestOutput
from slimlm.serve.metrics import EngineSnapshot, Histogram, Metrics
from tests.serve.conftest import metric


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.lines("x") == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4',
                            "x_sum 3.65", "x_count 4"]  # fmt: skip


def test_finished_requests_and_the_engine_snapshot_are_reported():
    m = Metrics()
    choice = CompletionOutput(0, "ab", [5, 6, 7], "length", None, 1.0, [1.0, 1.5, 2.0], num_drafted=4, num_accepted=3)
    m.finish(RequestOutput("r", [1, 2, 3, 4], [choice], 0.0, True, num_cached_tokens=3))
    text = m.render(EngineSnapshot(waiting=2, running=1, free_blocks=7, total_blocks=10, preemptions=4), in_flight=3)
    expected = {"slimlm_num_requests_waiting": 2, "slimlm_num_requests_running": 1, "slimlm_kv_blocks_used": 3,
                "slimlm_kv_blocks_free": 7, "slimlm_preemptions_total": 4, "slimlm_requests_in_flight": 3,
                "slimlm_prefix_cache_hit_rate": 0.75, "slimlm_generation_tokens_total": 3,
                "slimlm_spec_decode_acceptance_rate": 0.75}  # fmt: skip
    assert {k: metric(text, k) for k in expected} == expected
    assert 'slimlm_requests_finished_total{finish_reason="length"} 1' in text
