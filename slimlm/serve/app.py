"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine, served by uvicorn.

Every request is checked before anything is queued (model name, prompt tokens, context length, sampling
parameters), so bad input is a 400 with an OpenAI-style error body and never reaches the engine loop; a
full waiting queue or a draining server is a 503 with Retry-After. A client that disconnects, streaming or
not, has its request aborted and its KV blocks freed. SIGTERM drains: new requests get 503, running ones
finish (up to a bound), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from slimlm.errors import SlimlmError
from slimlm.runtime.engine import Engine
from slimlm.serve import chat, completions
from slimlm.serve import protocol as p
from slimlm.serve.async_engine import AsyncEngine, EngineFailed, Overloaded
from slimlm.serve.chat import ChatServing
from slimlm.serve.completions import CompletionServing
from slimlm.serve.serving import ClientGone, authorize

log = logging.getLogger("slimlm.serve")


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


ERRORS = {code: {"model": p.ErrorResponse} for code in (400, 401, 404, 500, 503)}
router = APIRouter()


@router.get("/health", responses={503: {"model": p.ErrorResponse}})
async def health(request: Request) -> JSONResponse:
    if request.app.state.engine.draining:
        return _error(503, "the server is shutting down", "service_unavailable")
    return JSONResponse({"status": "ok"})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    aengine = request.app.state.engine
    text = aengine.metrics.render(aengine.snapshot, aengine.in_flight)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@router.get("/v1/models", dependencies=[Depends(authorize)])
async def models(request: Request) -> p.ModelList:
    serving = request.app.state.completions
    card = p.ModelCard(
        id=serving.served_model_name, created=int(time.time()), owned_by="slimlm", max_model_len=serving.max_model_len
    )
    return p.ModelList(data=[card])


def build_app(
    engine: Engine, served_model_name: str, api_key: str | None = None, max_waiting: int = 256, own_thread: bool = True
) -> FastAPI:
    """`own_thread`: the engine loop gets a thread of its own; else the caller runs app.state.engine.run()."""
    aengine = AsyncEngine(engine, max_waiting, own_thread)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        yield
        await aengine.stop()

    app = FastAPI(
        title="slimlm",
        version="0.1.0",
        lifespan=lifespan,
        responses=ERRORS,
        description="OpenAI-compatible completions and chat over the slimlm runtime",
    )
    app.state.engine, app.state.api_key = aengine, api_key
    app.state.completions = CompletionServing(aengine, served_model_name)
    app.state.chat = ChatServing(aengine, served_model_name)
    for routes in (router, completions.router, chat.router):
        app.include_router(routes)
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure as an OpenAI-style error body: bad input 400, overload 503, a bug 500 (and the server
    keeps serving)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc))

    @app.exception_handler(SlimlmError)
    async def _bad_request(request: Request, exc: SlimlmError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        return _error(503, f"{exc}; retry later", "service_unavailable", {"Retry-After": "1"})

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
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


class Server(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT draining first: the engine refuses new requests (503) and the server
    stops once the requests in flight are done or `drain_timeout` seconds have passed; a second signal
    stops at once. Exits normally (code 0) either way."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float, print_address: bool = False
    ) -> None:
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


def serve(
    engine: Engine,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 256,
    drain_timeout: float = 30.0,
) -> None:
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
    print(f"model '{served_model_name}', max context {engine.max_model_len} tokens; {engine.arithmetic()}", flush=True)
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
