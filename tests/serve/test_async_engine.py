"""The event-loop side of the engine thread: the waiting bound counts a request from the moment it is admitted."""

import asyncio

import pytest

from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.sampling import SamplingParams
from slimlm.serve.async_engine import AsyncEngine, Overloaded


def test_the_waiting_bound_counts_requests_not_yet_read(tiny_llama):
    """Handlers admit and queue their requests before reading any output, and other handlers run in between:
    a request must count against max_waiting from its generate() call, not from its first read (a burst
    once slipped 4 requests past a bound of 2 that way). Nothing is read here, and the engine never steps."""
    engine = Engine(str(tiny_llama), EngineConfig(kv_cache_memory=8 << 20))
    aengine = AsyncEngine(engine, max_waiting=2, own_thread=False)

    async def burst() -> int:
        aengine.start()  # no engine thread: nothing takes the queued requests
        admitted = 0
        for i in range(5):
            try:
                aengine.admit()
            except Overloaded:
                continue
            aengine.generate([1, 2, 3], SamplingParams(max_tokens=1), f"r{i}")
            admitted += 1
        return admitted

    assert asyncio.run(burst()) == 2
    assert aengine.in_flight == 2
    with pytest.raises(Overloaded, match="the waiting queue is full"):
        aengine.admit()
