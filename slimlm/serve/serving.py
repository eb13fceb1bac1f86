"""What every OpenAI endpoint shares: the checks a request passes before it is queued, and the ways its
outputs come back (merged streams, final outputs, the text a stream may send yet). An endpoint's serving class
works without HTTP: give it a request body, get a response model or an iterator of chunk models."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import RequestOutput
from slimlm.serve import protocol as p
from slimlm.serve.async_engine import AsyncEngine, EngineFailed, Overloaded

log = logging.getLogger("slimlm.serve")


class ClientGone(Exception):
    """The client disconnected before its response was ready: its requests were aborted."""


@dataclass
class Serving:
    engine: AsyncEngine
    served_model_name: str

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise SlimlmError(f"model '{name}' is not served here; this server serves '{self.served_model_name}'")

    def check_length(self, ids: list[int], max_tokens: int) -> None:
        limit = self.max_model_len
        if len(ids) + max_tokens > limit:
            raise SlimlmError(
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate): "
                "shorten the prompt or lower max_tokens"
            )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.engine.engine.prompt_ids(prompt)


def usage(outs: list[RequestOutput]) -> p.Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    return p.Usage(**p.usage(prompt, sum(len(c.token_ids) for o in outs for c in o.outputs)))


def streamable(choice, body, finished: bool) -> str:
    """The text a stream may send so far: while a stop string could still be completing, its possible start
    is held back (as vLLM does), so text that the stop string later cuts is never sent."""
    if finished or choice.finish_reason is not None or not body.stop:
        return choice.text
    stops = [body.stop] if isinstance(body.stop, str) else body.stop
    hold = max(map(len, stops)) - 1
    return choice.text[: max(0, len(choice.text) - hold)]


async def merge(gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, each with its request's position; leaving early (or
    failing) cancels the rest, which aborts them."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(gens: list, disconnected: Callable[[], Awaitable[None]] | None = None) -> list[RequestOutput]:
    """Each request's final output; if `disconnected()` returns first (the client left), the requests are
    aborted and ClientGone is raised."""
    finals: dict[int, RequestOutput] = {}

    async def run() -> None:
        async for i, out in merge(gens):
            if out.finished:
                finals[i] = out

    work = asyncio.create_task(run())
    watch = asyncio.create_task(disconnected() if disconnected else asyncio.Event().wait())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
    if not work.done() or work.cancelled():
        await asyncio.gather(work, return_exceptions=True)
        raise ClientGone()
    work.result()  # re-raises what the generation raised
    return [finals[i] for i in range(len(gens))]


def disconnect_of(request: Request) -> Callable[[], Awaitable[None]]:
    """What returns once the HTTP client has gone."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected


async def authorize(request: Request) -> None:
    """With an API key (app.state.api_key), /v1 wants 'Authorization: Bearer KEY'."""
    api_key = request.app.state.api_key
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # the scheme is case-insensitive (RFC 7235); the key is compared in constant time
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise HTTPException(401, "missing or wrong API key (send Authorization: Bearer KEY)")


def event_stream(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events: each chunk (the fields it was given: `usage` only where set), then [DONE]."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk.model_dump(exclude_unset=True))}\n\n"
        except Exception as e:  # after the 200 went out, an error is an event in the stream
            status = 400 if isinstance(e, SlimlmError) else 503 if isinstance(e, Overloaded) else 500
            if status == 500 and not isinstance(e, EngineFailed):
                log.exception("unhandled error while streaming")
            kind = "invalid_request_error" if status == 400 else "server_error"
            yield f"data: {json.dumps(p.error_body(str(e), kind, status))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
