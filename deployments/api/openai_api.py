"""HTTP: the OpenAI-compatible routes, a health route and a stats route, as a FastAPI app.

``build_openai_app`` is handed to ``serve.ingress`` as a builder: each replica builds its own app, and the
routes reach the replica's ``Coordinator`` through ``get_coordinator`` (a FastAPI dependency, so tests
can serve an in-process coordinator with no Ray at all).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from deployments.auth import RequireApiKey
from deployments.body_limit import LimitBody
from deployments.serving.admission import Ticket
from deployments.config import CorsConfig
from hetspec.config import require_unicode
from hetspec.output import GenerationResult, ResultBuilder, StreamEvent

from deployments.serving.coordinator import Coordinator, Prepared
from deployments.serving.request import GenerationRequest, serve_request_id, validation_to_invalid
from deployments.errors import InvalidRequest, Overloaded, RequestTimeout, WorkerLost
from deployments.api.openai_protocol import (FIELD_NAMES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             TokenizeRequest, request_error)
from deployments.api.openai_responses import (ChatCompletion, Completion, Detokenized, ResponseWriter, Tokenized,
                                              TokenStrings, error_body, generation_responses, sse, tokenizer_responses)

log = logging.getLogger("ray.serve")


def current_coordinator() -> Coordinator:
    from ray import serve

    return serve.get_replica_context().servable_object.coordinator


def _invalid(error: InvalidRequest) -> JSONResponse:
    return JSONResponse(request_error(error), status_code=400)


def _busy_body(error: Overloaded) -> dict:
    return error_body(str(error), None, "rate_limit_exceeded", "server_busy")


def _busy(error: Overloaded) -> JSONResponse:
    return JSONResponse(_busy_body(error), status_code=429, headers={"Retry-After": error.retry_after_header})


def _timeout_body(error: RequestTimeout) -> dict:
    return error_body(str(error), None, "timeout_error", "request_timeout")


class _ClosingStreamingResponse(StreamingResponse):
    """A stream that gives its admissions back even if the body never starts (client gone before it)."""

    def __init__(self, content, tickets: list[Ticket], **options):
        super().__init__(content, **options)
        self.tickets = tickets

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # no-op if it ran to the end; else frees what it holds
            for ticket in self.tickets:
                ticket.release()  # no-op if the stream ran (the coordinator released it)


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


async def _on_server_error(request: Request, error: Exception) -> JSONResponse:
    """Any other failure: a 500 in OpenAI's shape that names nothing of the server (no traceback, process or
    actor); Starlette re-raises the error after it, so Serve logs it with its traceback."""
    return JSONResponse(error_body("internal server error", None, "server_error"), status_code=500)


def _check_model(coordinator: Coordinator, model: str | None) -> None:
    if model is not None and model != coordinator.config.model_id:
        raise InvalidRequest("model", f"unknown model {model!r}; this server serves {coordinator.config.model_id!r}")


async def _prepare(coordinator: Coordinator, body: CompletionRequest | ChatCompletionRequest,
                   request_id: str) -> list[Prepared]:
    """The request's runs: one per choice (request ids ``<request_id>-<index>``), or one greedy run whose
    output every choice copies. Tokenized off the event loop (``Coordinator.prepare_async``)."""
    _check_model(coordinator, body.model)
    try:
        generation = body.to_generation(coordinator.config.limits.default_max_new_tokens)
    except ValidationError as error:
        raise validation_to_invalid(error, FIELD_NAMES) from None
    runs = 1 if generation.params.greedy else body.choices
    if runs == 1:
        return [await coordinator.prepare_async(generation, request_id, body.choices)]
    return [await coordinator.prepare_async(_choice(generation, index), f"{request_id}-{index}", body.choices)
            for index in range(runs)]


def _choice(generation: GenerationRequest, index: int) -> GenerationRequest:
    """Choice ``index`` of a sampled request: seed s gives it s + index; no seed, a fresh one of its own."""
    seed = generation.params.seed
    if seed is None:
        return generation
    params = generation.params.model_copy(update={"seed": (seed + index) % 2**63})
    return generation.model_copy(update={"params": params})


def _admit_all(coordinator: Coordinator, runs: list[Prepared]) -> list[Ticket]:
    """Every run admitted (or in line), or ``Overloaded`` with none: a request gets all its choices or none."""
    tickets: list[Ticket] = []
    try:
        for prepared in runs:
            tickets.append(coordinator.admit("http", prepared))
    except Overloaded:
        for ticket in tickets:
            ticket.release()
        raise
    return tickets


def _failure(error: Exception) -> JSONResponse:
    """A generation's server-side failure before any of its body was sent."""
    if isinstance(error, Overloaded):
        return _busy(error)
    if isinstance(error, RequestTimeout):
        return JSONResponse(_timeout_body(error), status_code=408)
    if isinstance(error, WorkerLost):
        return JSONResponse(error_body(str(error), None, "server_unavailable", "worker_lost"), status_code=503)
    raise error


async def _respond(coordinator: Coordinator, body: CompletionRequest | ChatCompletionRequest, chat: bool):
    request_id = serve_request_id() or uuid.uuid4().hex
    try:
        runs = await _prepare(coordinator, body, request_id)
    except InvalidRequest as error:
        return _invalid(error)
    echo = body.prompt_text if not chat and body.echo else ""
    writer = ResponseWriter(chat, coordinator.config.model_id, request_id, body.choices,
                            TokenStrings(coordinator.maps.target_table, coordinator.target_model.tokenizer), echo)
    try:  # admitted (or told to come back) before the 200 and the first event are sent
        tickets = _admit_all(coordinator, runs)
    except Overloaded as error:
        return _failure(error)
    if body.stream:
        return _ClosingStreamingResponse(_stream(coordinator, runs, tickets, writer, body), tickets,
                                         media_type="text/event-stream")
    try:
        results = await _whole(coordinator, runs, tickets)
    except (Overloaded, RequestTimeout, WorkerLost) as error:
        return _failure(error)
    return writer.whole(results * body.choices if len(results) == 1 else results)


async def _whole(coordinator: Coordinator, runs: list[Prepared], tickets: list[Ticket]) -> list[GenerationResult]:
    """Each run's result; the first failure stops the others (their sessions are freed) and is raised."""
    started: set[int] = set()

    async def result(index: int) -> GenerationResult:
        started.add(index)
        builder = ResultBuilder(runs[index].target_prompt_ids)
        async with aclosing(coordinator.run(runs[index], "http", tickets[index])) as events:
            async for event in events:
                if (whole := builder.add(event)) is not None:
                    return whole
        raise AssertionError("the decode loop ended without a finish reason")

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(result(index)) for index in range(len(runs))]
    except BaseExceptionGroup as errors:
        raise errors.exceptions[0] from None
    finally:
        for index, ticket in enumerate(tickets):
            if index not in started:  # cancelled before it ran: the coordinator never took its ticket
                ticket.release()
    return [task.result() for task in tasks]


async def _merged(streams: list[AsyncIterator[StreamEvent]]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(stream index, event) of every stream as they come; the first failure stops the others and is raised."""
    if len(streams) == 1:  # the common case, without tasks
        async with aclosing(streams[0]) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamEvent]) -> None:
        try:
            async with aclosing(stream) as events:
                async for event in events:
                    await queue.put((index, event, None))
        except Exception as error:  # noqa: BLE001 -- handed to the consumer, which raises it
            await queue.put((index, None, error))
        else:
            await queue.put((index, None, None))

    tasks = [asyncio.get_running_loop().create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                running -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # a stream whose task never started still holds its admission


async def _stream(coordinator: Coordinator, runs: list[Prepared], tickets: list[Ticket], writer: ResponseWriter,
                  body: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[str]:
    copies = body.choices if len(runs) == 1 else 1  # greedy n > 1: one run, its events sent for every choice
    if writer.echo:
        for index in range(body.choices):
            yield sse(writer.echo_chunk(index))
    last_events: list[StreamEvent] = []
    try:
        streams = [coordinator.run(prepared, "http", ticket) for prepared, ticket in zip(runs, tickets)]
        async for run, event in _merged(streams):
            for copy in range(copies):
                yield sse(writer.chunk(run + copy, event))
            if event.finish_reason:
                last_events += [event] * copies
        if body.include_usage:
            yield sse(writer.usage_chunk(last_events))
    except Overloaded as error:
        # headers are sent already: the error travels as an event, the way OpenAI's streams report one
        yield sse(_busy_body(error))
    except RequestTimeout as error:
        yield sse(_timeout_body(error))
    except WorkerLost as error:
        yield sse(error_body(str(error), None, "server_unavailable", "worker_lost"))
    except Exception as error:  # noqa: BLE001 -- report, don't leave the client waiting on a cut stream
        log.exception("stream failed request_id=%s", runs[0].request_id)
        yield sse(error_body(f"internal error: {type(error).__name__}", None, "server_error"))
    yield sse("[DONE]")


def _tokenize(coordinator: Coordinator, generation: GenerationRequest, add_special_tokens: bool) -> list[int]:
    """/tokenize's ids: a prompt's bare text without special tokens, else what a generation route feeds."""
    if generation.prompt is not None and not add_special_tokens:
        try:
            return coordinator.target_model.encode(require_unicode(generation.prompt))
        except ValueError as error:
            raise InvalidRequest("prompt", str(error)) from None
    return coordinator.target_prompt_ids(generation)


def build_openai_app(get_coordinator: Callable[[], Coordinator] = current_coordinator,
                     cors: CorsConfig | None = None) -> FastAPI:
    app = FastAPI(title="hetspec", description="Lossless heterogeneous speculative decoding, OpenAI-compatible.")
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_server_error)
    app.add_middleware(LimitBody, get_limit=lambda: get_coordinator().config.limits.max_request_bytes,
                       setting="limits.max_request_bytes")
    # added later, so it runs first (the proxy may have checked the key already: deployments/proxy.py)
    app.add_middleware(RequireApiKey, get_api_keys=lambda: get_coordinator().api_keys)
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
        # bit_exact: the target's load-time self-check (hetspec/exact.py); where true, a greedy or seeded
        # output does not depend on load, batch or draft length even at a tie in the last bit
        return {"id": coordinator.config.model_id, "object": "model", "created": 0, "owned_by": "hetspec",
                "bit_exact": coordinator.bit_exact}

    @app.get("/v1/models")
    async def models(coordinator: Coordinator = Depends(get_coordinator)):
        return {"object": "list", "data": [model_card(coordinator)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, coordinator: Coordinator = Depends(get_coordinator)):
        if model_id != coordinator.config.model_id:  # what OpenAI answers for a model it does not have
            return JSONResponse(error_body(f"The model '{model_id}' does not exist", "model",
                                           "invalid_request_error", "model_not_found"), status_code=404)
        return model_card(coordinator)

    @app.post("/tokenize", responses=tokenizer_responses(Tokenized))
    async def tokenize(body: TokenizeRequest, coordinator: Coordinator = Depends(get_coordinator)):
        try:
            _check_model(coordinator, body.model)
            generation = GenerationRequest.model_validate({**body.generation_prompt(), "params": {}})
            coordinator.check_prompt_size(generation)
            tokens = await asyncio.get_running_loop().run_in_executor(
                coordinator.tokenizer_thread, _tokenize, coordinator, generation, body.add_special_tokens)
        except InvalidRequest as error:
            return _invalid(error)
        return {"count": len(tokens), "tokens": tokens,
                "max_prompt_tokens": coordinator.config.limits.max_prompt_tokens}

    @app.post("/detokenize", responses=tokenizer_responses(Detokenized))
    async def detokenize(body: DetokenizeRequest, coordinator: Coordinator = Depends(get_coordinator)):
        try:
            _check_model(coordinator, body.model)
            vocab_size = coordinator.target_model.vocab_size
            for index, token_id in enumerate(body.tokens):
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequest(f"tokens.{index}", f"{token_id} is not a token id of the target "
                                                            f"(its vocabulary has {vocab_size})")
        except InvalidRequest as error:
            return _invalid(error)
        return {"prompt": coordinator.target_model.tokenizer.decode(body.tokens)}

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
