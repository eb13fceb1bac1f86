"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine, served by uvicorn.

Every request is checked before anything is queued (model name, prompt tokens, context length, sampling
parameters), so bad input is a 400 with an OpenAI-style error body and never reaches the engine loop; a
full waiting queue or a draining server is a 503 with Retry-After. A client that disconnects, streaming or
not, has its request aborted and its KV blocks freed. SIGTERM drains: new requests get 503, running ones
finish (up to a bound), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import Engine, RequestOutput
from slimlm.serve import protocol as p
from slimlm.serve.async_engine import AsyncEngine, EngineFailed, Overloaded

log = logging.getLogger("slimlm.serve")


class _ClientGone(Exception):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(message, kind, status), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def build_app(engine: Engine, served_model_name: str, api_key: str | None = None, max_waiting: int = 256,
              own_thread: bool = True) -> FastAPI:  # fmt: skip
    """`own_thread`: the engine loop gets a thread of its own; else the caller runs app.state.engine.run()."""
    aengine = AsyncEngine(engine, max_waiting, own_thread)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        await aengine.stop()

    app = FastAPI(title="slimlm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat over the slimlm runtime")  # fmt: skip
    app.state.engine = aengine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc))

    @app.exception_handler(SlimlmError)
    async def _bad_request(request: Request, exc: SlimlmError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        return _error(503, f"{exc}; retry later", "service_unavailable", {"Retry-After": "1"})

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the request was aborted

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        return _error(exc.status_code, str(exc.detail), kind, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:  # a bug: say so, keep serving
        if not isinstance(exc, EngineFailed):
            log.exception("unhandled error in %s", request.url.path)
        return _error(500, f"internal server error: {exc}", "server_error")

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 7235); the key is compared in constant time
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise HTTPException(401, "missing or wrong API key (send Authorization: Bearer KEY)")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise SlimlmError(f"model '{name}' is not served here; this server serves '{served_model_name}'")

    def check_length(ids: list[int], max_tokens: int) -> None:
        limit = engine.max_model_len
        if len(ids) + max_tokens > limit:
            raise SlimlmError(f"this model's maximum context length is {limit} tokens; the request asks for "
                              f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate): "
                              "shorten the prompt or lower max_tokens")  # fmt: skip

    @app.get("/health")
    async def health() -> JSONResponse:
        if aengine.draining:
            return _error(503, "the server is shutting down", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = aengine.metrics.render(aengine.snapshot, aengine.in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "slimlm",
                "max_model_len": engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: p.CompletionRequest, request: Request):
        check_model(body.model)
        prompts = p.prompt_batch(body.prompt)
        if not prompts or len(prompts) > p.MAX_PROMPTS:
            raise SlimlmError(f"a request takes 1 to {p.MAX_PROMPTS} prompts, got {len(prompts)}")
        prompt_ids = [engine.prompt_ids(x) for x in prompts]
        for ids in prompt_ids:
            check_length(ids, body.max_tokens)
        echo_logprobs = body.logprobs if body.echo else None
        params = body.sampling_params(body.max_tokens, body.logprobs, echo_logprobs)
        aengine.admit()
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = [aengine.generate(ids, params, f"{rid}-{i}", body.stream) for i, ids in enumerate(prompt_ids)]
        header = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}
        if body.stream:
            return _sse(_completion_chunks(gens, body, header))
        outs = await _collect(gens, request)
        choices = []
        for i, out in enumerate(outs):
            prompt_text = tokenizer.decode(out.prompt_token_ids) if body.echo else ""  # once for its n choices
            choices += [_completion_choice(out, c, body, i * body.n + c.index, prompt_text) for c in out.outputs]
        return {**header, "choices": choices, "usage": _usage(outs)}

    def _completion_choice(out: RequestOutput, choice, body: p.CompletionRequest, index: int, prompt_text: str) -> dict:
        text, logprobs = choice.text, None
        if body.logprobs is not None:
            ids, lps, tops = _completion_tokens(out, choice, body, 0, len(choice.token_ids), first=True)
            logprobs = p.completion_logprobs(tokenizer, ids, lps, tops, 0)
        return {"index": index, "text": prompt_text + text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason}  # fmt: skip

    def _completion_tokens(out, choice, body, start: int, end: int, first: bool):
        """Token ids, log-probabilities and top lists of a choice's tokens [start, end), and with echo in the
        first piece, of the prompt before them."""
        lps, tops = p.choice_logprobs(choice, start, end, body.logprobs)
        ids = choice.token_ids[start:end]
        if body.echo and first:
            prompt_tops = out.prompt_top_logprobs or [[] for _ in out.prompt_logprobs]
            ids = out.prompt_token_ids + ids
            lps = [None, *out.prompt_logprobs, *lps]
            tops = [None, *prompt_tops, *tops]
        return ids, lps, tops

    async def _completion_chunks(gens, body: p.CompletionRequest, header: dict) -> AsyncIterator[dict]:
        sent_text: dict[int, int] = {}  # per choice: characters sent
        sent_tokens: dict[int, int] = {}  # tokens whose log-probabilities were sent
        offsets: dict[int, int] = {}  # text_offset of the next token
        prompt_texts: dict[int, str] = {}  # echo: per prompt
        finals = []
        async for i, out in _merge(gens):
            finals += [out] if out.finished else []
            for choice in out.outputs:
                index = i * body.n + choice.index
                first = index not in sent_text
                text = _streamable(choice, body, out.finished)
                delta = text[sent_text.get(index, 0) :]
                if first and body.echo:
                    if i not in prompt_texts:  # once for the prompt's n choices
                        prompt_texts[i] = tokenizer.decode(out.prompt_token_ids)
                    delta = prompt_texts[i] + delta
                elif not delta and choice.finish_reason is None:
                    continue
                logprobs = None
                if body.logprobs is not None:
                    start, end = sent_tokens.get(index, 0), len(choice.token_ids)
                    ids, lps, tops = _completion_tokens(out, choice, body, start, end, first)
                    logprobs = p.completion_logprobs(tokenizer, ids, lps, tops, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                    sent_tokens[index] = end
                sent_text[index] = len(text)
                yield {**header, "choices": [{"index": index, "text": delta, "logprobs": logprobs,
                                              "finish_reason": choice.finish_reason}]}  # fmt: skip
        if body.include_usage:
            yield {**header, "choices": [], "usage": _usage(finals)}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: p.ChatRequest, request: Request):
        check_model(body.model)
        ids = _chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, engine.max_model_len - len(ids))
        check_length(ids, max_tokens)
        top = body.top_logprobs or 0
        params = body.sampling_params(max_tokens, top if body.logprobs else None, None)
        aengine.admit()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        header = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name}
        gens = [aengine.generate(ids, params, rid, body.stream)]
        if body.stream:
            return _sse(_chat_chunks(gens, body, {**header, "object": "chat.completion.chunk"}))
        out = (await _collect(gens, request))[0]
        choices = []
        for choice in out.outputs:
            logprobs = None
            if body.logprobs:
                lps, tops = p.choice_logprobs(choice, 0, len(choice.token_ids), top)
                logprobs = p.chat_logprobs(tokenizer, choice.token_ids, lps, tops)
            choices.append({"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                            "logprobs": logprobs, "finish_reason": choice.finish_reason})  # fmt: skip
        return {**header, "choices": choices, "usage": _usage([out])}

    def _chat_prompt(body: p.ChatRequest) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise SlimlmError(f"'{served_model_name}' has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own checks (roles, order) speak for themselves
            raise SlimlmError(f"the messages do not fit the model's chat template: {e}") from None
        return engine.prompt_ids(tokenizer.encode(text, add_special_tokens=False))

    async def _chat_chunks(gens, body: p.ChatRequest, header: dict) -> AsyncIterator[dict]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        top = body.top_logprobs or 0
        last = None
        async for _, out in _merge(gens):
            last = out
            for choice in out.outputs:
                if choice.index not in sent_text:
                    sent_text[choice.index] = 0
                    yield {**header, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}  # fmt: skip
                text = _streamable(choice, body, out.finished)
                delta = text[sent_text[choice.index] :]
                start, end = sent_tokens.get(choice.index, 0), len(choice.token_ids)
                if not delta and choice.finish_reason is None:
                    continue
                logprobs = None
                if body.logprobs:
                    lps, tops = p.choice_logprobs(choice, start, end, top)
                    logprobs = p.chat_logprobs(tokenizer, choice.token_ids[start:end], lps, tops)
                sent_text[choice.index], sent_tokens[choice.index] = len(text), end
                message = {"content": delta} if delta else {}
                yield {**header, "choices": [{"index": choice.index, "delta": message, "logprobs": logprobs,
                                              "finish_reason": choice.finish_reason}]}  # fmt: skip
        if body.include_usage and last is not None:
            yield {**header, "choices": [], "usage": _usage([last])}

    return app


def _streamable(choice, body, finished: bool) -> str:
    """The text a stream may send so far: while a stop string could still be completing, its possible start
    is held back (as vLLM does), so text that the stop string later cuts is never sent."""
    if finished or choice.finish_reason is not None or not body.stop:
        return choice.text
    stops = [body.stop] if isinstance(body.stop, str) else body.stop
    hold = max(map(len, stops)) - 1
    return choice.text[: max(0, len(choice.text) - hold)]


def _usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    return p.usage(prompt, sum(len(c.token_ids) for o in outs for c in o.outputs))


async def _merge(gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _collect(gens: list, request: Request) -> list[RequestOutput]:
    """Each request's final output; if the client disconnects first, the requests are aborted."""
    finals: dict[int, RequestOutput] = {}

    async def run() -> None:
        async for i, out in _merge(gens):
            if out.finished:
                finals[i] = out

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(run()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()
    if not work.done() or work.cancelled():
        await asyncio.gather(work, return_exceptions=True)
        raise _ClientGone()
    work.result()  # re-raises what the generation raised
    return [finals[i] for i in range(len(gens))]


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # after the 200 went out, an error is an event in the stream
            status = 400 if isinstance(e, SlimlmError) else 503 if isinstance(e, Overloaded) else 500
            if status == 500 and not isinstance(e, EngineFailed):
                log.exception("unhandled error while streaming")
            kind = "invalid_request_error" if status == 400 else "server_error"
            yield f"data: {json.dumps(p.error_body(str(e), kind, status))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT draining first: the engine refuses new requests (503) and the server
    stops once the requests in flight are done or `drain_timeout` seconds have passed; a second signal
    stops at once. Exits normally (code 0) either way."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float,
                 print_address: bool = False) -> None:  # fmt: skip
        super().__init__(config)
        self.aengine = engine
        self.drain_timeout = drain_timeout
        self.print_address = print_address
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early_signals = 0  # signals that came before the event loop ran: handled once it does
        self._signal_lock = threading.RLock()  # reentrant: a second signal may interrupt the first's handler

    async def startup(self, sockets=None) -> None:
        with self._signal_lock:
            self._loop = asyncio.get_running_loop()
            early = self._early_signals
        for _ in range(early):
            self._on_signal()
        await super().startup(sockets)
        if self.started and self.print_address:  # the bound port: --port 0 picks a free one
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"serving on http://{host}:{port}/v1", flush=True)

    @contextmanager
    def capture_signals(self):  # signals are the main thread's: serve() forwards them to on_signal
        yield

    def on_signal(self, sig: int, frame=None) -> None:
        """From any thread, at any point of start-up: start draining, or on the second signal stop now."""
        with self._signal_lock:
            if self._loop is None:
                self._early_signals += 1
                return
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self.aengine.draining:
            self.should_exit = self.force_exit = True
            return
        log.info("draining: %d requests in flight, new requests get 503", self.aengine.in_flight)
        self.aengine.draining = True
        self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.aengine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def serve(engine: Engine, served_model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_waiting: int = 256, drain_timeout: float = 30.0) -> None:  # fmt: skip
    app = build_app(engine, served_model_name, api_key, max_waiting, own_thread=False)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = Server(config, app.state.engine, drain_timeout, print_address=True)
    try:  # bound here, so a taken port or a bad address is one clear line
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise SlimlmError(f"could not serve on {host}:{port}: {e.strerror or e}") from None
    # The engine loop runs here, on the main thread (torch steps run slower on another one); uvicorn's event
    # loop gets a thread; signals arrive here and are handed to it, from before anything is announced.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.on_signal)
    print(f"model '{served_model_name}', max context {engine.max_model_len} tokens", flush=True)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="slimlm-server", daemon=True)
    with sock:
        thread.start()
        app.state.engine.run(alive=thread.is_alive)  # until the server's shutdown stops it
        thread.join()
    if not server.started:
        raise SlimlmError(f"could not serve on {host}:{port}")


@contextmanager
def serve_in_thread(engine: Engine, served_model_name: str, **options):
    """A server on a free loopback port in a background thread, for tests and benchmarks: yields its base URL."""
    app = build_app(engine, served_model_name, **options)
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), app.state.engine, 5.0)
    thread = threading.Thread(target=server.run, name="slimlm-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SlimlmError("the server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()
