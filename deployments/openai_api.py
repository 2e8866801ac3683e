"""HTTP: the OpenAI-compatible routes, a health route and a stats route, as a FastAPI app.

``build_openai_app`` is handed to ``serve.ingress`` as a builder: each replica builds its own app, and the
routes reach the replica's ``Coordinator`` through ``get_coordinator`` (a FastAPI dependency, so tests
can serve an in-process coordinator with no Ray at all).
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from deployments.admission import Ticket
from deployments.auth import OPEN_HTTP_PATHS, Unauthenticated, bearer_token
from deployments.config import CorsConfig
from deployments.coordinator import (Coordinator, InvalidRequest, Overloaded, Prepared, RequestTimeout,
                                     serve_request_id, validation_to_invalid)
from deployments.openai_protocol import (FIELD_NAMES, ChatCompletion, ChatCompletionRequest, Completion,
                                         CompletionRequest, ResponseWriter, error_body, generation_responses,
                                         request_error, sse)
from deployments.pipeline import WorkerLost

log = logging.getLogger("ray.serve")


def current_coordinator() -> Coordinator:
    from ray import serve

    return serve.get_replica_context().servable_object.coordinator


def _invalid(error: InvalidRequest) -> JSONResponse:
    return JSONResponse(request_error(error), status_code=400)


def _busy_body(error: Overloaded) -> dict:
    return error_body(str(error), None, "rate_limit_exceeded", "server_busy")


def _busy(error: Overloaded, retry_after: str) -> JSONResponse:
    return JSONResponse(_busy_body(error), status_code=429, headers={"Retry-After": retry_after})


def _timeout_body(error: RequestTimeout) -> dict:
    return error_body(str(error), None, "timeout_error", "request_timeout")


class RequireApiKey:
    """ASGI middleware: with API keys configured, every route but /health needs ``Authorization: Bearer <key>``
    (the official ``openai`` client sends its ``api_key`` so); otherwise 401 the way OpenAI answers one."""

    def __init__(self, app, get_coordinator: Callable[[], Coordinator]):
        self.app = app
        self.get_coordinator = get_coordinator

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):  # served under a route prefix
                path = path[len(root):] or "/"
            if path not in OPEN_HTTP_PATHS:
                headers = dict(scope["headers"])
                presented = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
                try:
                    self.get_coordinator().api_keys.check(presented, "the header 'Authorization: Bearer <key>'")
                except Unauthenticated as error:
                    response = JSONResponse(error_body(str(error), None, "invalid_request_error", "invalid_api_key"),
                                            status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class _ClosingStreamingResponse(StreamingResponse):
    """A stream that gives its admission back even if the body never starts (client gone before it)."""

    def __init__(self, content, ticket: Ticket, **options):
        super().__init__(content, **options)
        self.ticket = ticket

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # no-op if it ran to the end; else frees what it holds
            self.ticket.release()  # no-op if the stream ran (the coordinator released it)


async def _on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    if first["type"] == "json_invalid":  # its location is a character offset, not a field
        return JSONResponse(error_body(f"body: {first['msg']}", "body"), status_code=400)
    location = [str(part) for part in first["loc"] if part != "body"]
    # a union's branch name (str, list[str], ...) is not a field: keep the field names only
    param = ".".join(part for part in location if not any(mark in part for mark in "[]")) or "body"
    return JSONResponse(error_body(f"{param}: {first['msg']}", param), status_code=400)


async def _on_http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method, a body that is not UTF-8) in OpenAI's shape."""
    client_error = error.status_code < 500
    param = "body" if error.status_code == 400 else None  # FastAPI's 400: "error parsing the body"
    return JSONResponse(error_body(str(error.detail), param, "invalid_request_error" if client_error
                                   else "server_error"), status_code=error.status_code, headers=error.headers)


def _prepare(coordinator: Coordinator, body: CompletionRequest | ChatCompletionRequest,
             request_id: str | None) -> Prepared:
    if body.model != coordinator.config.model_id:
        raise InvalidRequest("model", f"unknown model {body.model!r}; this server serves "
                                      f"{coordinator.config.model_id!r}")
    try:
        generation = body.to_generation(coordinator.config.limits.default_max_new_tokens)
    except ValidationError as error:
        raise validation_to_invalid(error, FIELD_NAMES) from None
    return coordinator.prepare(generation, request_id)


async def _respond(coordinator: Coordinator, body: CompletionRequest | ChatCompletionRequest, chat: bool):
    try:
        prepared = _prepare(coordinator, body, serve_request_id())
    except InvalidRequest as error:
        return _invalid(error)
    writer = ResponseWriter(chat, coordinator.config.model_id, prepared.request_id)
    retry_after = coordinator.config.limits.retry_after_header
    if body.stream:
        try:  # admitted (or told to come back) before the 200 and the first event are sent
            ticket = coordinator.admit("http", prepared)
        except Overloaded as error:
            return _busy(error, retry_after)
        return _ClosingStreamingResponse(_stream(coordinator, prepared, writer, body.include_usage, ticket),
                                         ticket, media_type="text/event-stream")
    pieces: list[str] = []
    token_ids: list[int] = []
    try:
        async with aclosing(coordinator.run(prepared, "http")) as events:
            async for event in events:
                pieces.append(event.text)
                token_ids.extend(event.token_ids)
                if event.finish_reason:
                    return writer.whole("".join(pieces), token_ids, event)
    except Overloaded as error:
        return _busy(error, retry_after)
    except RequestTimeout as error:
        return JSONResponse(_timeout_body(error), status_code=408)
    except WorkerLost as error:
        return JSONResponse(error_body(str(error), None, "server_unavailable", "worker_lost"), status_code=503)
    raise AssertionError("the decode loop ended without a finish reason")


async def _stream(coordinator: Coordinator, prepared: Prepared, writer: ResponseWriter,
                  include_usage: bool, ticket: Ticket) -> AsyncIterator[str]:
    try:
        async with aclosing(coordinator.run(prepared, "http", ticket)) as events:
            async for event in events:
                yield sse(writer.chunk(event))
                if event.finish_reason and include_usage:
                    yield sse(writer.usage_chunk(event))
    except Overloaded as error:
        # headers are sent already: the error travels as an event, the way OpenAI's streams report one
        yield sse(_busy_body(error))
    except RequestTimeout as error:
        yield sse(_timeout_body(error))
    except WorkerLost as error:
        yield sse(error_body(str(error), None, "server_unavailable", "worker_lost"))
    except Exception as error:  # noqa: BLE001 -- report, don't leave the client waiting on a cut stream
        log.exception("stream failed request_id=%s", prepared.request_id)
        yield sse(error_body(f"internal error: {type(error).__name__}", None, "server_error"))
    yield sse("[DONE]")


def build_openai_app(get_coordinator: Callable[[], Coordinator] = current_coordinator,
                     cors: CorsConfig | None = None) -> FastAPI:
    app = FastAPI(title="hetspec", description="Lossless heterogeneous speculative decoding, OpenAI-compatible.")
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_middleware(RequireApiKey, get_coordinator=get_coordinator)
    if cors is not None and cors.allow_origins:  # added last, so it runs first: a preflight needs no API key
        app.add_middleware(CORSMiddleware, allow_origins=cors.allow_origins, allow_methods=cors.allow_methods,
                           allow_headers=cors.allow_headers, allow_credentials=cors.allow_credentials)

    @app.post("/v1/completions", responses=generation_responses(Completion))
    async def completions(body: CompletionRequest, coordinator: Coordinator = Depends(get_coordinator)):
        return await _respond(coordinator, body, chat=False)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, coordinator: Coordinator = Depends(get_coordinator)):
        return await _respond(coordinator, body, chat=True)

    def model_card(coordinator: Coordinator) -> dict:
        return {"id": coordinator.config.model_id, "object": "model", "created": 0, "owned_by": "hetspec"}

    @app.get("/v1/models")
    async def models(coordinator: Coordinator = Depends(get_coordinator)):
        return {"object": "list", "data": [model_card(coordinator)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, coordinator: Coordinator = Depends(get_coordinator)):
        if model_id != coordinator.config.model_id:  # what OpenAI answers for a model it does not have
            return JSONResponse(error_body(f"The model '{model_id}' does not exist", "model",
                                           "invalid_request_error", "model_not_found"), status_code=404)
        return model_card(coordinator)

    @app.get("/health")
    async def health(coordinator: Coordinator = Depends(get_coordinator)):
        try:
            await coordinator.check_health()
        except WorkerLost as error:  # an actor is being replaced
            return JSONResponse({"status": "unavailable", "detail": str(error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/stats")
    async def stats(coordinator: Coordinator = Depends(get_coordinator)):
        return await coordinator.stats()

    return app
