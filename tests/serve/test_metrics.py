"""Prometheus text: cumulative `le` buckets (a value on a bound counts in it), sums, counts and gauges."""

from slimlm.runtime.outputs import CompletionOutput, RequestOutput
from slimlm.serve.metrics import EngineSnapshot, Histogram, Metrics
from tests.serve.conftest import metric


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.lines("x") == [
        'x_bucket{le="0.1"} 2',
        'x_bucket{le="1.0"} 3',
        'x_bucket{le="+Inf"} 4',
        "x_sum 3.65",
        "x_count 4",
    ]


def test_finished_requests_and_the_engine_snapshot_are_reported():
    m = Metrics()
    choice = CompletionOutput(0, "ab", [5, 6, 7], "length", None, 1.0, [1.0, 1.5, 2.0], num_drafted=4, num_accepted=3)
    m.finish(RequestOutput("r", [1, 2, 3, 4], [choice], 0.0, True, num_cached_tokens=3))
    text = m.render(EngineSnapshot(waiting=2, running=1, free_blocks=7, total_blocks=10, preemptions=4), in_flight=3)
    expected = {
        "slimlm_num_requests_waiting": 2,
        "slimlm_num_requests_running": 1,
        "slimlm_kv_blocks_used": 3,
        "slimlm_kv_blocks_free": 7,
        "slimlm_preemptions_total": 4,
        "slimlm_requests_in_flight": 3,
        "slimlm_prefix_cache_hit_rate": 0.75,
        "slimlm_generation_tokens_total": 3,
        "slimlm_spec_decode_acceptance_rate": 0.75,
    }
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
    empty = Metrics().render(EngineSnapshot(), 0)  # nothing served: rates are 0, not a division by zero or 1
    assert metric(empty, "slimlm_prefix_cache_hit_rate") == metric(empty, "slimlm_spec_decode_acceptance_rate") == 0.0


# What a scraper reads, whole: every family's name, type and help text, in a fixed order. Dashboards and alerts
# key on these strings, so any change to them must show up here.
EXPOSITION = """\
# HELP slimlm_time_to_first_token_seconds Request arrival to its first token.
# TYPE slimlm_time_to_first_token_seconds histogram
slimlm_time_to_first_token_seconds_bucket{le="0.1"} 1
slimlm_time_to_first_token_seconds_bucket{le="+Inf"} 1
slimlm_time_to_first_token_seconds_sum 0.05
slimlm_time_to_first_token_seconds_count 1
# HELP slimlm_inter_token_latency_seconds Time between consecutive tokens of a sequence.
# TYPE slimlm_inter_token_latency_seconds histogram
slimlm_inter_token_latency_seconds_bucket{le="0.01"} 0
slimlm_inter_token_latency_seconds_bucket{le="+Inf"} 1
slimlm_inter_token_latency_seconds_sum 0.5
slimlm_inter_token_latency_seconds_count 1
# HELP slimlm_requests_finished_total Finished sequences by finish reason.
# TYPE slimlm_requests_finished_total counter
slimlm_requests_finished_total{finish_reason="length"} 1
slimlm_requests_finished_total{finish_reason="stop"} 2
# HELP slimlm_requests_in_flight Requests the server is answering.
# TYPE slimlm_requests_in_flight gauge
slimlm_requests_in_flight 9
# HELP slimlm_num_requests_running Sequences in the running batch.
# TYPE slimlm_num_requests_running gauge
slimlm_num_requests_running 2
# HELP slimlm_num_requests_waiting Sequences waiting to be scheduled.
# TYPE slimlm_num_requests_waiting gauge
slimlm_num_requests_waiting 1
# HELP slimlm_kv_blocks_pool KV cache blocks in the pool.
# TYPE slimlm_kv_blocks_pool gauge
slimlm_kv_blocks_pool 10
# HELP slimlm_kv_blocks_free KV cache blocks no sequence holds.
# TYPE slimlm_kv_blocks_free gauge
slimlm_kv_blocks_free 3
# HELP slimlm_kv_blocks_used KV cache blocks held by sequences.
# TYPE slimlm_kv_blocks_used gauge
slimlm_kv_blocks_used 7
# HELP slimlm_requests_aborted_total Requests stopped because the client disconnected.
# TYPE slimlm_requests_aborted_total counter
slimlm_requests_aborted_total 7
# HELP slimlm_preemptions_total Sequences preempted for lack of KV blocks.
# TYPE slimlm_preemptions_total counter
slimlm_preemptions_total 4
# HELP slimlm_prompt_tokens_total Prompt tokens of finished requests.
# TYPE slimlm_prompt_tokens_total counter
slimlm_prompt_tokens_total 8
# HELP slimlm_prefix_cache_hit_tokens_total Of those, served from the prefix cache.
# TYPE slimlm_prefix_cache_hit_tokens_total counter
slimlm_prefix_cache_hit_tokens_total 2
# HELP slimlm_prefix_cache_hit_rate Prefix-cache hit tokens / prompt tokens.
# TYPE slimlm_prefix_cache_hit_rate gauge
slimlm_prefix_cache_hit_rate 0.25
# HELP slimlm_generation_tokens_total Tokens generated.
# TYPE slimlm_generation_tokens_total counter
slimlm_generation_tokens_total 5
# HELP slimlm_spec_decode_draft_tokens_total Speculative tokens drafted and verified.
# TYPE slimlm_spec_decode_draft_tokens_total counter
slimlm_spec_decode_draft_tokens_total 4
# HELP slimlm_spec_decode_accepted_tokens_total Of those, accepted.
# TYPE slimlm_spec_decode_accepted_tokens_total counter
slimlm_spec_decode_accepted_tokens_total 1
# HELP slimlm_spec_decode_acceptance_rate Accepted / drafted.
# TYPE slimlm_spec_decode_acceptance_rate gauge
slimlm_spec_decode_acceptance_rate 0.25
# HELP slimlm_requests_rejected_total Requests answered 503.
# TYPE slimlm_requests_rejected_total counter
slimlm_requests_rejected_total 6
"""


def test_the_exposition_text_is_exactly_the_documented_one():
    m = Metrics(
        ttft=Histogram((0.1,)),
        itl=Histogram((0.01,)),
        finished={"stop": 2, "length": 1},
        prompt_tokens=8,
        cached_prompt_tokens=2,
        generation_tokens=5,
        drafted_tokens=4,
        accepted_tokens=1,
        rejected_overloaded=6,
    )
    m.ttft.observe(0.05)
    m.itl.observe(0.5)
    engine = EngineSnapshot(waiting=1, running=2, free_blocks=3, total_blocks=10, preemptions=4, aborted=7)
    assert m.render(engine, in_flight=9) == EXPOSITION
