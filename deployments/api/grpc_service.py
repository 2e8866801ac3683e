"""gRPC: the ``hetspec.v1.HetSpec`` methods, served by Serve's gRPC proxy (protos/hetspec/v1/hetspec.proto).

A component of the ingress deployment (deployments/app.py ``HetSpecServer`` holds one and forwards to it):
Serve calls ``Generate`` / ``GenerateStream`` on the deployment by name with the request message and a
``grpc_context``. Bad input is INVALID_ARGUMENT (field named in the details), a
missing or wrong API key UNAUTHENTICATED, a full server RESOURCE_EXHAUSTED (details end with "retry after
N s"), a request past ``limits.request_timeout_s`` DEADLINE_EXCEEDED.

Those client errors are *answered*, not raised: the method sets the code and details on the
``grpc_context`` and returns an empty ``GenerateResponse`` (a stream yields one as its last message), which
Serve's proxy copies onto the call with the message (``RayServegRPCContext._set_on_grpc_context`` in
``ray/serve/_private/proxy.py``). A unary client sees only the status; a stream's client also receives
that empty message (no request_id, no token ids, no finish_reason) just before the status, because the
proxy reads the context only as a message passes. Raising instead would make Serve log an ERROR with a
traceback per bad request (the replica's "Request failed.", the proxy's "Request failed with user-set gRPC
status code"). Server faults (a model actor lost: UNAVAILABLE) are still raised,
with their status set first, so they are logged with their traceback; any other failure is logged here and answered
INTERNAL with details that name nothing of the server (no traceback, pid or actor id).

A client's own deadline is honoured by gRPC itself: when it passes, the proxy's call is cancelled, Serve
cancels the replica's request, and the coordinator frees its sessions (the cancellation path).
"""

from __future__ import annotations

import logging
import math
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from pydantic import ValidationError

from hetspec.output import ResultBuilder, StreamEvent, TokenLogprob

from deployments.auth import GRPC_KEY_HOW, grpc_api_key
from deployments.serving.coordinator import Coordinator, Prepared
from deployments.serving.request import GenerationRequest, serve_request_id, validation_to_invalid
from deployments.errors import InvalidRequest, Overloaded, RequestTimeout, Unauthenticated, WorkerLost
from deployments.api.grpc_registration import UndecodableRequest
from protos.hetspec.v1 import hetspec_pb2 as pb

log = logging.getLogger("ray.serve")

# GenerationRequest's names -> the proto's, for error details.
FIELD_NAMES = {"params.": ""}


def to_generation(request: pb.GenerateRequest | UndecodableRequest, default_max_new_tokens: int) -> GenerationRequest:
    if isinstance(request, UndecodableRequest):
        raise InvalidRequest("request", f"is not a valid hetspec.v1.GenerateRequest: {request.reason}")
    params = {"max_new_tokens": request.max_new_tokens if request.HasField("max_new_tokens")
              else default_max_new_tokens, "stop": list(request.stop), "stop_token_ids": list(request.stop_token_ids)}
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs"):
        if request.HasField(name):
            params[name] = getattr(request, name)
    try:
        return GenerationRequest.model_validate({
            "prompt": request.prompt, "params": params, "algorithm": request.algorithm or None,
            "draft_tokens": request.draft_tokens if request.HasField("draft_tokens") else None,
            "pipelined": request.pipelined if request.HasField("pipelined") else None})
    except ValidationError as error:
        raise validation_to_invalid(error, FIELD_NAMES) from None


def _stats(event: StreamEvent) -> pb.SpeculationStats:
    values = event.stats.to_dict()
    return pb.SpeculationStats(**{field.name: values[field.name] for field in pb.SpeculationStats.DESCRIPTOR.fields})


def _logprobs(entries: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob,
                            top=[pb.TopLogprob(token_id=token_id, logprob=logprob) for token_id, logprob in entry.top])
            for entry in entries or []]


def _usage(event: StreamEvent) -> pb.Usage:
    stats = event.stats
    return pb.Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens,
                    total_tokens=stats.prompt_tokens + stats.generated_tokens)


# Answered with a status (client_status), never raised to Serve: see the module docstring.
CLIENT_ERRORS = (Unauthenticated, InvalidRequest, Overloaded, RequestTimeout)


def client_status(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details that answer one of CLIENT_ERRORS."""
    if isinstance(error, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(error)
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{_proto_field(error.field)}: {error.message}"
    if isinstance(error, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, _with_retry_hint(str(error), error.retry_after_s)
    if isinstance(error, RequestTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    raise TypeError(f"not a client error: {error!r}")


class GrpcMethods:
    """The gRPC methods of one replica, on its coordinator."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def _prepare(self, request: pb.GenerateRequest, grpc_context) -> Prepared:
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else []
        # first: an unauthenticated client learns nothing about its request
        self.coordinator.api_keys.check(grpc_api_key(metadata), GRPC_KEY_HOW)
        generation = to_generation(request, self.coordinator.config.limits.default_max_new_tokens)
        return await self.coordinator.prepare_async(generation, serve_request_id())

    async def _events(self, prepared: Prepared, grpc_context) -> AsyncIterator[StreamEvent]:
        try:
            async with aclosing(self.coordinator.run(prepared, "grpc")) as events:
                async for event in events:
                    yield event
        except WorkerLost as error:
            _set_status(grpc_context, grpc.StatusCode.UNAVAILABLE, str(error))
            raise

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:  # noqa: N802
        try:
            prepared = await self._prepare(request, grpc_context)
            builder = ResultBuilder()
            async with aclosing(self._events(prepared, grpc_context)) as events:
                async for event in events:
                    if (result := builder.add(event)) is not None:
                        return pb.GenerateResponse(request_id=prepared.request_id, text=result.text,
                                                   token_ids=result.token_ids, finish_reason=result.finish_reason,
                                                   usage=_usage(event), stats=_stats(event),
                                                   logprobs=_logprobs(result.logprobs))
        except CLIENT_ERRORS as error:
            if grpc_context is None:  # a Python caller, not the proxy: the typed error is its answer
                raise
            _set_status(grpc_context, *client_status(error))
            return pb.GenerateResponse()
        except WorkerLost:
            raise  # its status is set (_events): UNAVAILABLE, with a message that names no process
        except Exception:
            if grpc_context is None:
                raise
            _answer_internal(grpc_context)
            return pb.GenerateResponse()
        raise AssertionError("the decode loop ended without a finish reason")

    async def GenerateStream(self, request: pb.GenerateRequest,  # noqa: N802
                             grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        try:
            prepared = await self._prepare(request, grpc_context)
            async with aclosing(self._events(prepared, grpc_context)) as events:
                async for event in events:
                    response = pb.GenerateResponse(request_id=prepared.request_id, text=event.text,
                                                   token_ids=event.token_ids, logprobs=_logprobs(event.logprobs))
                    if event.finish_reason:
                        response.finish_reason = event.finish_reason
                        response.usage.CopyFrom(_usage(event))
                        response.stats.CopyFrom(_stats(event))
                    yield response
        except CLIENT_ERRORS as error:
            if grpc_context is None:
                raise
            _set_status(grpc_context, *client_status(error))
            yield pb.GenerateResponse()  # carries the status to the proxy (module docstring)
        except WorkerLost:
            raise
        except Exception:
            if grpc_context is None:
                raise
            _answer_internal(grpc_context)
            yield pb.GenerateResponse()


def _proto_field(field: str) -> str:
    for ours, theirs in FIELD_NAMES.items():
        field = field.replace(ours, theirs)
    return field


def _with_retry_hint(message: str, retry_after_s: float) -> str:
    return f"{message}; retry after {math.ceil(retry_after_s)} s"


def _answer_internal(grpc_context) -> None:
    """Any other failure: logged here with its traceback, answered INTERNAL with details that name nothing of the
    server (raised to Serve, the details would be the exception's text: a Ray traceback, pid and actor id)."""
    log.exception("request failed request_id=%s", serve_request_id())
    _set_status(grpc_context, grpc.StatusCode.INTERNAL, "internal server error")


def _set_status(grpc_context, code: grpc.StatusCode, details: str) -> None:
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
