"""The online workload sent to `compress serve` in its own process by an open-loop streaming client."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

from slimlm.errors import SlimlmError
from slimlm.perf.config import BenchConfig, max_seqs, pool_bytes
from slimlm.perf.workload import latency_figures


@contextlib.contextmanager
def served(model: str, *options: str) -> Iterator[str]:
    """`compress serve MODEL OPTIONS` in its own process on a free port: yields its base URL."""
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "slimlm.cli", "serve", model, "--port", "0", *options]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving on" not in line:
            line = server.stdout.readline()
            if not line:
                raise SlimlmError(f"compress serve did not start: {server.stderr.read()[-300:].strip()}")
        yield line.split()[-1].removesuffix("/v1")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def online_http(model: str, config: BenchConfig, requests: list[dict]) -> dict:
    """The same workload sent to `compress serve` (its own process) by an open-loop streaming client."""
    longest = max(len(r["prompt"]) + r["output_len"] for r in requests)
    pool = str(pool_bytes(model, config))
    with served(
        model,
        "--dtype",
        config.dtype,
        "--activations",
        config.activations,
        "--max-num-seqs",
        str(max_seqs(config)),
        "--max-model-len",
        str(longest),
        "--kv-cache-memory",
        pool,
    ) as url:
        times, wall = http_client(url, requests)
    return latency_figures(requests, times, wall, config)


def http_client(url: str, requests: list[dict]) -> tuple[dict[str, list[float]], float]:
    """Open-loop: each request is sent at its arrival time whatever the others are doing; streamed, with
    logprobs=0 so every chunk says how many tokens it carries (a chunk's text can hold back a partial
    character); a token's time is when its chunk arrived. Returns the token times and the wall time."""
    import asyncio

    import httpx

    async def one(http, r: dict, start: float) -> list[float]:
        await asyncio.sleep(max(0.0, r["arrival"] - (time.perf_counter() - start)))
        body = {
            "prompt": r["prompt"],
            "max_tokens": r["output_len"],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,
        }
        times = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter() - start
                    times += [now] * len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
        return times

    async def run() -> tuple[dict, float]:
        limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
            await one(http, {"arrival": 0, "prompt": requests[0]["prompt"][:32], "output_len": 4}, 0.0)  # warm-up
            start = time.perf_counter()
            times = await asyncio.gather(*(one(http, r, start) for r in requests))
            wall = time.perf_counter() - start
        return {r["id"]: t for r, t in zip(requests, times, strict=True)}, wall

    return asyncio.run(run())
