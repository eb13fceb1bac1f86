"""Load: 240 requests from 40 concurrent clients, streaming and not, a sixth of them hanging up mid-stream.
Every request that was not cancelled completes with the offline API's greedy text, none gets a 5xx, and
afterwards no request is in flight and every KV block is free."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from slimlm.runtime.sampling import SamplingParams
from tests.conftest import WORDS
from tests.serve.conftest import metric

CLIENTS, REQUESTS = 40, 240


def test_many_concurrent_clients_get_the_offline_text_and_leak_nothing(server, offline):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(24)]
    lengths = [rng.choice([4, 16, 40]) for _ in prompts]
    expected = [
        o.outputs[0].text
        for o in offline.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    ]
    jobs = [
        (i % len(prompts), ["plain", "stream", "stream", "plain", "hangup", "stream"][i % 6]) for i in range(REQUESTS)
    ]
    rng.shuffle(jobs)
    counts = {"completed": 0, "cancelled": 0, "5xx": 0, "wrong": 0}

    async def one(http: httpx.AsyncClient, k: int, kind: str) -> None:
        body = {"prompt": prompts[k], "max_tokens": lengths[k], "temperature": 0}
        if kind == "plain":
            r = await http.post("/v1/completions", json=body)
            counts["5xx"] += r.status_code >= 500
            text = r.json()["choices"][0]["text"]
        else:
            text = ""
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                counts["5xx"] += r.status_code >= 500
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if kind == "hangup":  # leave after the first piece of text
                        counts["cancelled"] += 1
                        return
        counts["completed"] += 1
        counts["wrong"] += text != expected[k]

    async def client(http: httpx.AsyncClient, queue: asyncio.Queue) -> None:
        while not queue.empty():
            await one(http, *queue.get_nowait())

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server, timeout=120, limits=limits) as http:
            await asyncio.gather(*(client(http, queue) for _ in range(CLIENTS)))

    asyncio.run(run())
    print(counts)
    assert counts["5xx"] == 0 and counts["wrong"] == 0, counts
    assert counts["completed"] + counts["cancelled"] == REQUESTS and counts["cancelled"] >= REQUESTS // 6 - 1, counts
    import time

    for _ in range(200):  # the hang-ups are aborted within a step or two
        text = httpx.get(f"{server}/metrics").text
        if metric(text, "slimlm_requests_in_flight") == 0:
            break
        time.sleep(0.05)
    assert metric(text, "slimlm_requests_in_flight") == 0
    assert metric(text, "slimlm_kv_blocks_free") == metric(text, "slimlm_kv_blocks_pool")
    assert metric(text, "slimlm_prefix_cache_hit_rate") > 0  # each prompt came ten times
