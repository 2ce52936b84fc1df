"""The HTTP routes: OpenAI's chat and text completions, models, health, /metrics and the live stats.

Every answer is JSON in OpenAI's shapes (errors too: {"error": {message, type, param, code}}); a bad
request costs one log line and the next request is answered as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from moechat.app.engine_api import ServingEngine
from moechat.app.serve import wire
from moechat.app.serve.jobs import Finished, Jobs, Piece
from moechat.app.serve.metrics import ServerCollector, metrics_text
from moechat.app.serve.wire import ApiError
from moechat.engine.events import SamplingParams
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

logger = logging.getLogger(__name__)

MAX_BODY = 8 * 2**20  # bytes: far above any prompt a context holds, far below what hurts the server
MAX_WAITING = 8  # requests queued per slot behind the running ones before a new one is refused (429)
RETRY_AFTER_S = 2


def build_app(engine: ServingEngine, defaults: SamplingParams, api_key: str | None = None,
              max_waiting: int | None = None, parallel: int = 1) -> Starlette:  # fmt: skip
    """The routes over `engine`, which serves `parallel` requests at once (a server's engine process, `slots`);
    beyond `max_waiting` waiting requests (MAX_WAITING per slot) a new one is refused."""
    n_ctx = engine.info.n_ctx
    model_id = engine.info.name
    jobs = Jobs(engine, n_ctx, MAX_WAITING * parallel if max_waiting is None else max_waiting, parallel)
    requests: Counter[tuple[str, int]] = Counter()
    collector = ServerCollector(jobs, requests, engine.snapshot, engine.batch_status)
    created = int(time.time())
    cache_setting = engine.cache()  # asked once: a streaming reply holds the engine's pipe

    def guarded(endpoint: str, handler: Callable[[Request], Awaitable[Response]], auth: bool = True
                ) -> Callable[[Request], Awaitable[Response]]:  # fmt: skip
        async def run(request: Request) -> Response:
            try:
                if auth and api_key is not None:
                    # The scheme is case-insensitive (RFC 9110): "bearer KEY" is as good as "Bearer KEY".
                    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
                    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
                        raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                                       code="invalid_api_key")  # fmt: skip
                response = await handler(request)
            except ApiError as e:
                logger.warning("%s %s: %d %s", request.method, request.url.path, e.status, e.message)
                headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else e.headers
                response = JSONResponse(e.body(), status_code=e.status, headers=headers)
            requests[(endpoint, response.status_code)] += 1
            return response

        return run

    async def body_of(request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY // 2**20} MiB", code="request_too_large")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY // 2**20} MiB", code="request_too_large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None

    def check_model(req: wire.Request) -> None:
        if req.model is not None and req.model not in (model_id, "moechat"):
            raise ApiError(404, f"the model '{req.model}' does not exist here (this server has '{model_id}')",
                           param="model", code="model_not_found")  # fmt: skip

    async def complete(request: Request, chat: bool) -> Response:
        req = wire.read_request(await body_of(request), defaults, n_ctx, chat)
        check_model(req)
        jobs.admit()
        stop = threading.Event()
        out: asyncio.Queue[Any] = asyncio.Queue()
        jobs.run(req, stop, out)
        rid = wire.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            first = await out.get()  # an error before the first piece is still an HTTP status
            if isinstance(first, ApiError):
                raise first
            return StreamingResponse(_events(first, out, stop, rid, model_id, chat, req.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})  # fmt: skip
        text = []
        try:
            while True:
                item = await out.get()
                if isinstance(item, Piece):
                    text.append(item.text)
                elif isinstance(item, ApiError):
                    raise item
                elif isinstance(item, Finished):
                    use = wire.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                    return JSONResponse(wire.completion(rid, model_id, "".join(text), item.finish_reason, use, chat))
                else:
                    raise ApiError(503, "the request was cancelled before it ran", kind="server_error")
        finally:
            stop.set()

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                                         "owned_by": "moechat"}]})  # fmt: skip

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_id})

    async def metrics(request: Request) -> Response:
        text = await asyncio.get_running_loop().run_in_executor(None, metrics_text, collector)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats(request: Request) -> Response:
        loop = asyncio.get_running_loop()
        snap = await loop.run_in_executor(None, engine.snapshot)
        batch = await loop.run_in_executor(None, engine.batch_status)
        return JSONResponse({"snapshot": asdict(snap) if snap is not None else None, "queue_depth": jobs.waiting,
                             "running": jobs.running, "tokens": jobs.live_tokens, "tps": jobs.live_tps,
                             "batch": asdict(batch) if batch is not None else None})  # fmt: skip

    async def info(request: Request) -> Response:
        return JSONResponse({"model": asdict(engine.info), "cache": list(cache_setting)})

    async def not_found(request: Request) -> Response:
        allowed = takes.get(request.url.path)
        if allowed is not None:  # a route that takes another method: 405, with the method it takes
            raise ApiError(405, f"{request.url.path} takes {allowed}, not {request.method}",
                           code="method_not_allowed", headers={"Allow": allowed})  # fmt: skip
        raise ApiError(404, f"no route {request.method} {request.url.path}", code="not_found")

    routes = [
        Route("/v1/chat/completions", guarded("chat", chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded("completions", completions), methods=["POST"]),
        Route("/v1/models", guarded("models", models), methods=["GET"]),
        Route("/health", guarded("health", health, auth=False), methods=["GET"]),
        Route("/metrics", guarded("metrics", metrics), methods=["GET"]),
        Route("/moechat/stats", guarded("stats", stats), methods=["GET"]),
        Route("/moechat/info", guarded("info", info), methods=["GET"]),
        Route("/{path:path}", guarded("other", not_found), methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
    # Each route's path and the methods it takes: another method there is a 405 that names them.
    takes = {r.path: ", ".join(sorted((r.methods or set()) - {"HEAD"})) for r in routes[:-1]}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        jobs.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.jobs = jobs
    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, bound before the model loads; a port in use is one clear error."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses a port in TIME_WAIT
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is in use (another server?); pick another port, "
                             "or --port 0 for any free one") from None  # fmt: skip
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


class Gate:
    """The server's ASGI app from the moment the port is bound: while the model loads, /health answers
    503 {"status": "loading"} (as llama-server's does) and every other route 503 with an OpenAI error;
    once `open(app)` is called, everything goes to `app`."""

    def __init__(self) -> None:
        self.app: Starlette | None = None

    def open(self, app: Starlette) -> None:
        self.app = app

    def close(self) -> None:
        if self.app is not None:
            self.app.state.jobs.close()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            response: Response = JSONResponse({"status": "loading"}, status_code=503)
        else:
            err = ApiError(503, "the model is loading; try again shortly", kind="server_error", code="loading")
            response = JSONResponse(err.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        await response(scope, receive, send)


async def _events(first: Any, out: asyncio.Queue[Any], stop: threading.Event, rid: str, model: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:  # fmt: skip
    """The server-sent events of one streamed answer. A client that goes away cancels this generator:
    its stop ends the generation before the engine's next token, and the next request starts."""
    created = int(time.time())

    def sse(obj: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    try:
        if chat:
            yield sse(wire.chunk(rid, model, created, chat, role=True))
        item = first
        while True:
            if isinstance(item, Piece):
                yield sse(wire.chunk(rid, model, created, chat, text=item.text))
            elif isinstance(item, Finished):
                yield sse(wire.chunk(rid, model, created, chat, finish=item.finish_reason))
                if include_usage:
                    use = wire.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                    yield sse(wire.chunk(rid, model, created, chat, use=use, no_choice=True))
                yield b"data: [DONE]\n\n"
                return
            elif isinstance(item, ApiError):  # mid-stream: the status is sent already; an error event
                yield sse(item.body())
                return
            else:
                return
            item = await out.get()
    finally:
        stop.set()
