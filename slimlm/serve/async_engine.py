"""The engine on its own thread, driven from the event loop.

The engine is synchronous and a step takes tens of milliseconds of compute, so it runs on one thread that
owns it outright: only that thread calls add_request, abort and step. `compress serve` runs it on the main
thread and the event loop on another (measured here: torch steps run ~30% slower on a secondary thread);
tests and benchmarks may give it a thread of its own (`own_thread`). The event loop talks to it through
an inbox of commands, and the thread hands each step's outputs back with `call_soon_threadsafe`, into one
asyncio queue per request. A request that raises (bad input) fails only its own future; a step that raises
(a bug) fails the requests that were in it and the loop goes on, so no client can stop the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import Engine, RequestOutput
from slimlm.runtime.sampling import SamplingParams
from slimlm.serve.metrics import EngineSnapshot, Metrics

log = logging.getLogger("slimlm.serve")


class Overloaded(Exception):
    """The server will not take the request now (queue full, or draining): a 503 with a retry hint."""


class EngineFailed(Exception):
    """The engine raised while running the request: a 500 (a bug on our side, never the client's input)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    arrival: float
    streaming: bool
    tokens_seen: dict[int, int] = field(default_factory=dict)  # per choice index: token times already counted
    first_token: bool = False


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 256, own_thread: bool = True) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = Metrics()
        stats = engine.stats()
        self.snapshot = EngineSnapshot(total_blocks=stats.total_blocks, free_blocks=stats.free_blocks)
        self.draining = False
        self._streams: dict[str, _Stream] = {}  # event-loop thread only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending_adds = 0  # adds posted but not yet taken by the engine thread (event-loop thread only)
        self._num_streaming = 0  # streaming requests in flight (written on the event loop, read by the engine)
        self._aborted = 0  # requests aborted in the engine (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads = torch.get_num_threads()  # an OpenMP setting is per thread: the engine thread needs it too
        self._own_thread = own_thread
        self._ready, self._done = threading.Event(), threading.Event()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        """Called on the event loop (the app's startup): the engine loop may begin."""
        self._loop = asyncio.get_running_loop()
        self._ready.set()
        if self._own_thread:
            threading.Thread(target=self.run, name="slimlm-engine", daemon=True).start()

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """The engine loop, on the calling thread, from the event loop's start() until stop(), or until
        `alive()` turns false (the server's thread ended without a shutdown: a forced exit, a failed start)."""
        while not self._ready.wait(0.5):  # a timed wait: the main thread stays responsive to signals
            if not alive():
                return
        try:
            self._run(alive)
        finally:
            self._done.set()

    async def stop(self) -> None:
        """Abort whatever is left and end the engine loop."""
        if self._ready.is_set() and not self._done.is_set():
            self._inbox.put(("stop",))
            await asyncio.to_thread(self._done.wait)

    # ---- the event loop side ---------------------------------------------------------------------

    def admit(self) -> None:
        """Raise Overloaded when the server takes no more requests now: it is draining, or the waiting
        queue is at its bound. Called before a response starts, so the answer can still be a 503."""
        if self.draining:
            self.metrics.rejected_overloaded += 1
            raise Overloaded("the server is shutting down")
        if self.snapshot.waiting + self._pending_adds >= self.max_waiting:
            self.metrics.rejected_overloaded += 1
            raise Overloaded(f"the waiting queue is full ({self.max_waiting} requests)")

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, streaming: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Queue one request for the engine now, and return its outputs as it grows, the last one finished
        (call admit() first). Queued at the call, in the same step of the event loop as admit(), so that a
        burst cannot slip past the waiting bound before the first output is read. Iterating raises
        SlimlmError (bad request) or EngineFailed; leaving the iteration early (a disconnect) aborts it, and
        an iterator nobody reads is forgotten when its request finishes."""
        stream = _Stream(asyncio.Queue(), time.perf_counter(), streaming)
        added = self._loop.create_future()
        self._streams[request_id] = stream
        self._num_streaming += streaming
        self._pending_adds += 1
        self._inbox.put(("add", request_id, prompt, params, added))
        return self._outputs(request_id, stream, added)

    async def _outputs(self, request_id: str, stream: _Stream, added: asyncio.Future) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            await added
            while True:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._forget(request_id)
            if not finished:
                self._inbox.put(("abort", request_id))

    def _forget(self, request_id: str) -> None:
        """Once per request: when its last output (or its failure) is delivered, or its reader leaves."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._num_streaming -= stream.streaming

    def _added(self, future: asyncio.Future, error: BaseException | None) -> None:
        self._pending_adds -= 1
        if future.done():  # the caller went away before the engine took the request
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _deliver(self, outputs: list[RequestOutput], snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        now = time.perf_counter()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            self._record_latency(stream, out, now)
            if out.finished:
                self.metrics.finish(out)
                self._forget(out.request_id)  # the reader has the queue; a request nobody reads ends here
            stream.queue.put_nowait(out)

    def _record_latency(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        for choice in out.outputs:
            times = choice.token_times
            seen = stream.tokens_seen.get(choice.index, 0)
            if times and not stream.first_token:
                stream.first_token = True
                self.metrics.ttft.observe(now - stream.arrival)
            for a, b in zip(times[max(0, seen - 1) : -1], times[max(1, seen) :], strict=True):
                self.metrics.itl.observe(b - a)
            stream.tokens_seen[choice.index] = len(times)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for r in request_ids:
            stream = self._streams.get(r)
            if stream is not None:
                self._forget(r)
                stream.queue.put_nowait(error)

    # ---- the engine thread -----------------------------------------------------------------------

    def _run(self, alive: Callable[[], bool]) -> None:
        torch.set_num_threads(self._threads)
        engine = self.engine
        while alive():
            commands = []
            try:  # block for a command only when there is nothing to compute (timed: signals get through)
                commands.append(self._inbox.get(block=not engine.has_unfinished(), timeout=0.5))
                while True:
                    commands.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if any(command[0] == "stop" for command in commands):
                break
            for command in commands:
                self._command(command)
            if not engine.has_unfinished():
                self._publish([])
                continue
            try:  # text so far is decoded every step only while someone streams it
                outputs = engine.step(detokenize=self._num_streaming > 0)
            except Exception as e:  # a bug, not the client's input: fail the requests in the engine, go on
                log.exception("engine step failed")
                ids = list(engine.requests)
                for r in ids:
                    engine.abort(r, report=False)
                self._loop.call_soon_threadsafe(self._fail, ids, EngineFailed(f"the engine failed: {e}"))
                continue
            self._publish(outputs)
        for r in list(engine.requests):  # stopped: nothing stays queued
            engine.abort(r, report=False)

    def _command(self, command: tuple) -> None:
        if command[0] == "abort":
            if command[1] in self.engine.requests:  # still running: the client left before it finished
                self.engine.abort(command[1], report=False)
                self._aborted += 1
            return
        _, request_id, prompt, params, future = command
        error = None
        try:
            self.engine.add_request(prompt, params, request_id)
        except SlimlmError as e:
            error = e
        except Exception as e:  # e.g. the tokenizer choking on odd text: still the request's problem only
            log.exception("add_request failed")
            error = SlimlmError(f"the prompt could not be processed: {e}")
        self._loop.call_soon_threadsafe(self._added, future, error)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        s = self.engine.stats()
        snapshot = EngineSnapshot(s.waiting, s.running, s.free_blocks, s.total_blocks, s.preemptions, self._aborted)
        self._loop.call_soon_threadsafe(self._deliver, outputs, snapshot)
