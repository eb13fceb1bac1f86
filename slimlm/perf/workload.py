"""The online part: a seeded Poisson workload through the engine, arrivals on the wall clock, and the
latency figures of any run of it (here or over HTTP)."""

from __future__ import annotations

import random
import statistics
import time

from slimlm.perf.config import BenchConfig, engine_for


def workload(config: BenchConfig, tokenizer) -> list[dict]:
    """The seeded Poisson arrivals: prompts cut at random places from the owt text joined in order."""
    from slimlm.data import passages, token_stream

    rng = random.Random(config.seed)
    texts = passages("owt")
    rng.shuffle(texts)
    stream = token_stream(texts, tokenizer, max_tokens=60_000)
    t, out = 0.0, []
    for i in range(config.requests):
        t += rng.expovariate(config.rate)
        n = rng.randint(*config.prompt_len)
        start = rng.randrange(0, len(stream) - n)
        out.append(
            {
                "id": f"r{i}",
                "arrival": t,
                "prompt": stream[start : start + n],
                "output_len": rng.randint(*config.output_len),
            }
        )
    return out


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def online(model: str, config: BenchConfig, requests: list[dict]) -> dict:
    """The workload through the engine, arrivals on the wall clock: throughput, latencies, goodput."""
    from slimlm.runtime.sampling import SamplingParams

    longest = max(len(r["prompt"]) + r["output_len"] for r in requests)
    engine = engine_for(model, config, longest)
    engine.add_request(requests[0]["prompt"][:16], SamplingParams(max_tokens=2, temperature=0), "warm-up")
    while engine.has_unfinished():
        engine.step(detokenize=False)
    pending, times = list(requests), {}
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0]["arrival"] <= now:
            r = pending.pop(0)
            engine.add_request(
                r["prompt"], SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True), r["id"]
            )
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0]["arrival"] - (time.perf_counter() - start)))
            continue
        for out in engine.step(detokenize=False):
            if out.finished:
                times[out.request_id] = [t - start for t in out.outputs[0].token_times]
    return latency_figures(requests, times, time.perf_counter() - start, config)


def latency_figures(requests: list[dict], times: dict[str, list[float]], wall: float, config: BenchConfig) -> dict:
    """Throughput, TTFT and inter-token latency percentiles and goodput from each request's token times
    (seconds from the workload's start)."""
    ttft, itl, good = [], [], 0
    for r in requests:
        t = times[r["id"]]
        first = t[0] - r["arrival"]
        gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
        ttft.append(first)
        itl += gaps
        good += first <= config.slo_ttft and (not gaps or statistics.mean(gaps) <= config.slo_itl)
    tokens = sum(len(times[r["id"]]) for r in requests)
    return {
        "output_tok_s": tokens / wall,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "goodput_req_s": good / wall,
        "slo_met": good / len(requests),
        "wall_s": wall,
    }
