"""The HTTP server: OpenAI's routes over one :class:`~mha_onnx.serve.service.Service`
(FastAPI on uvicorn), with ``/health``, ``/ready`` and Prometheus' ``/metrics``.

Every refusal is OpenAI's error body with one line: 400 for a body the server does not take
(malformed JSON, unknown or unsupported fields, a prompt past the row), 404 for a model it
does not serve, 429 (with ``Retry-After``) when the queue is full, 503 while shutting down,
504 past ``--request-timeout``, 500 when ONNX Runtime fails on the request (the server
serves on). A client that goes away ends its request: its row is freed before the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request as HttpRequest  # (module level: FastAPI reads the annotations)

from mha_onnx.errors import MhaOnnxError
from mha_onnx.serve import openai
from mha_onnx.serve.requests import (
    CANCELLED,
    ERROR,
    SHUTDOWN,
    TIMEOUT,
    Completion,
    NotAdmitting,
    QueueFull,
    Request,
)
from mha_onnx.serve.service import Service
from mha_onnx.serve.text import TextStream

log = logging.getLogger(__name__)
STOPPED = "stop string"  # a request ended by its stop string (finish_reason "stop")
_ENDED = {ERROR: 500, TIMEOUT: 504, SHUTDOWN: 503}


def status_of(exc: Exception) -> int:
    if isinstance(exc, QueueFull):
        return 429
    if isinstance(exc, NotAdmitting):
        return 503
    return getattr(exc, "status", 400)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


class _Generation:
    """One generation request in flight: its call, handle, events and text."""

    def __init__(self, service: Service, call: openai.Call) -> None:
        self.service, self.call = service, call
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
            except RuntimeError:  # (the loop is closed: nobody listens any more)
                pass

        engine = service.engine
        room = engine.max_length - len(call.prompt)
        self.handle = engine.submit(Request(call.prompt, call.max_tokens or max(1, room),
                                            call.sampling, () if call.ignore_eos else None),
                                    on_event)
        self.text = TextStream(service.text, call.stop)
        self.id = openai.new_id(call.kind)
        self.tokens: list[int] = []

    def take(self, token: int) -> str:
        """Text after ``token``; a stop string ends the request."""
        if self.text.stopped:
            return ""
        self.tokens.append(token)
        piece = self.text.push(token)
        if self.text.stopped:
            self.handle.cancel(STOPPED)
        return piece

    def reason(self, done: Completion) -> str:
        return "stop" if self.text.stopped else done.finish_reason

    async def watch(self, request) -> None:
        """Cancels the request when its client goes away."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.handle.cancel(CANCELLED)
                return

    async def whole(self, request) -> tuple[int, dict]:
        watcher = asyncio.create_task(self.watch(request))
        try:
            parts = []
            while True:
                kind, value = await self.events.get()
                if kind == "token":
                    parts.append(self.take(value))
                else:
                    break
        finally:
            watcher.cancel()
        if value.finish_reason in _ENDED and not self.text.stopped:
            return _ENDED[value.finish_reason], openai.error(
                value.error or f"the request ended: {value.finish_reason}",
                _ENDED[value.finish_reason])
        parts.append(self.text.flush())
        return 200, openai.body(self.call.kind, self.id, self.service.name, "".join(parts),
                                self.tokens, self.reason(value), len(self.call.prompt))

    async def stream(self):
        call, name, first = self.call, self.service.name, True
        try:
            while True:
                kind, value = await self.events.get()
                if kind == "token":
                    if self.text.stopped:
                        continue
                    piece = self.take(value)
                    yield _sse(openai.chunk(call.kind, self.id, name, piece, [value], None, first))
                    first = False
                    continue
                if value.finish_reason in _ENDED and not self.text.stopped:
                    yield _sse(openai.error(value.error or f"the request ended: "
                                            f"{value.finish_reason}", _ENDED[value.finish_reason]))
                else:
                    yield _sse(openai.chunk(call.kind, self.id, name, self.text.flush(), [],
                                            self.reason(value), first))
                if call.include_usage:
                    yield _sse({"id": self.id, "object": "chat.completion.chunk" if call.kind ==
                                "chat" else "text_completion", "model": name, "choices": [],
                                "usage": openai.usage(len(call.prompt), len(self.tokens))})
                yield _sse("[DONE]")
                return
        finally:
            if not self.handle.done:
                self.handle.cancel(CANCELLED)


class _Routes:
    """The handlers, over one service."""

    def __init__(self, service: Service) -> None:
        self.service, self.metrics = service, service.metrics

    def refuse(self, route: str, exc: Exception):
        from fastapi.responses import JSONResponse

        status = status_of(exc)
        self.metrics.requests.labels(route, str(status)).inc()
        headers = {"Retry-After": "1"} if status == 429 else None
        hint = getattr(exc, "hint", None)
        message = f"{exc}" + (f" ({hint})" if hint and status == 400 else "")
        return JSONResponse(openai.error(message, status), status, headers=headers)

    @staticmethod
    async def body_of(request: HttpRequest) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise openai.BadRequest(f"the body is not JSON: {exc}") from None

    async def generation(self, request: HttpRequest, kind: str, route: str):
        from fastapi.responses import JSONResponse, StreamingResponse

        service = self.service
        try:
            body = await self.body_of(request)
            if service.engine is None:
                raise openai.BadRequest(f"{service.name} is an encoder: it serves "
                                        "/v1/embeddings")
            flight = _Generation(service, openai.read_call(body, kind, service.name,
                                                           service.text))
        except (MhaOnnxError, ValueError) as exc:
            return self.refuse(route, exc)
        if flight.call.stream:
            self.metrics.requests.labels(route, "200").inc()
            return StreamingResponse(flight.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        status, answer = await flight.whole(request)
        self.metrics.requests.labels(route, str(status)).inc()
        return JSONResponse(answer, status)

    async def completions(self, request: HttpRequest):
        return await self.generation(request, "completion", "/v1/completions")

    async def chat(self, request: HttpRequest):
        return await self.generation(request, "chat", "/v1/chat/completions")

    async def embeddings(self, request: HttpRequest):
        from fastapi.responses import JSONResponse

        from mha_onnx.serve.embed_route import embed

        route = "/v1/embeddings"
        try:
            answer = await embed(self.service, await self.body_of(request))
        except (MhaOnnxError, ValueError) as exc:
            return self.refuse(route, exc)
        except Exception as exc:  # noqa: BLE001 - ORT failing on this request: a 500, no more
            log.warning("an embedding request failed: %s", exc)
            self.metrics.requests.labels(route, "500").inc()
            return JSONResponse(openai.error(f"the model failed on the request: "
                                             f"{' '.join(str(exc).split())[:300]}", 500), 500)
        self.metrics.requests.labels(route, "200").inc()
        return JSONResponse(answer)

    async def models(self):
        return {"object": "list", "data": [self.service.card()]}

    async def health(self):
        from fastapi.responses import JSONResponse

        ok = self.service.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    async def ready(self):
        from fastapi.responses import JSONResponse

        ok = self.service.alive and self.service.admitting
        return JSONResponse({"ready": ok}, 200 if ok else 503)

    async def prometheus(self):
        from fastapi.responses import Response

        data, kind = self.metrics.text()
        return Response(data, media_type=kind)


class _NamedMiddleware:
    """Every answer with an ``x-mha-onnx-server: HOST:PID`` header (which replica served it,
    behind a proxy); plain ASGI, so that streams and disconnects pass untouched."""

    def __init__(self, app) -> None:
        self.app, self.asgi = app, _named(app)

    async def __call__(self, scope, receive, send):
        await self.asgi(scope, receive, send)


def _named(app):
    """``app`` with an ``x-mha-onnx-server: HOST:PID`` header on every answer (which replica
    served it, behind a proxy)."""
    import os
    import socket

    name = f"{socket.gethostname()}:{os.getpid()}".encode()

    async def asgi(scope, receive, send):
        async def named_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-mha-onnx-server", name)]}
            await send(message)

        await app(scope, receive, named_send if scope["type"] == "http" else send)

    return asgi


def create_app(service: Service):
    """The FastAPI application serving ``service``."""
    from fastapi import FastAPI

    app = FastAPI(title="mha-onnx", summary="OpenAI-compatible routes over ONNX Runtime")
    routes = _Routes(service)
    for path, handler, methods in (
            ("/v1/completions", routes.completions, ["POST"]),
            ("/v1/chat/completions", routes.chat, ["POST"]),
            ("/v1/embeddings", routes.embeddings, ["POST"]),
            ("/v1/models", routes.models, ["GET"]), ("/health", routes.health, ["GET"]),
            ("/ready", routes.ready, ["GET"]), ("/metrics", routes.prometheus, ["GET"])):
        app.add_api_route(path, handler, methods=methods)
    app.add_middleware(_NamedMiddleware)
    return app
