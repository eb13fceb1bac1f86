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


def test_the_text_is_valid_prometheus_and_counters_accumulate():
    m = Metrics()
    choice = CompletionOutput(0, "a", [5, 6], None, None, 1.0, [1.0, 1.5], num_drafted=2, num_accepted=1)
    for _ in range(2):
        m.finish(RequestOutput("r", [1, 2], [choice], 0.0, True, num_cached_tokens=1))
    m.ttft.observe(0.02)
    text = m.render(EngineSnapshot(total_blocks=4, free_blocks=4), in_flight=0)
    kinds, helps = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            kinds[name] = kind
        elif line.startswith("# HELP "):
            helps.add(line.split()[2])
        else:
            name = line.split("{")[0].split()[0]
            family = next(f for f in kinds if name == f or name.startswith(f + "_"))
            assert kinds[family] in ("counter", "gauge", "histogram") and family in helps, line
    assert kinds["slimlm_time_to_first_token_seconds"] == kinds["slimlm_inter_token_latency_seconds"] == "histogram"
    assert all(kinds[n] == "counter" for n in kinds if n.endswith("_total"))
    assert metric(text, "slimlm_prompt_tokens_total") == 4 and metric(text, "slimlm_generation_tokens_total") == 4
    assert metric(text, "slimlm_spec_decode_draft_tokens_total") == 4
    assert metric(text, "slimlm_spec_decode_accepted_tokens_total") == 2
    assert metric(text, "slimlm_prefix_cache_hit_tokens_total") == 2
    assert 'slimlm_requests_finished_total{finish_reason="abort"} 2' in text
    assert 'slimlm_time_to_first_token_seconds_bucket{le="0.025"} 1' in text
    assert metric(Metrics().render(EngineSnapshot(), 0), "slimlm_prefix_cache_hit_rate") == 0.0
