"""OpenAI completions and chat completions: request models, their translation, response bodies.

Only what the official ``openai`` client sends is accepted; an unknown field, or a known one this server
does not implement (n > 1, logprobs, penalties, echo, ...), is a 400 naming the field, never silently
ignored. Speculation options travel in the ``hetspec`` extension object (``extra_body`` in the client),
statistics come back in a ``hetspec`` field of the response. Defaults follow OpenAI's (temperature 1),
except max_tokens: the server's default_max_new_tokens.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field, field_validator

from hetspec.config import Algorithm as AlgorithmName
from hetspec.config import StrictModel
from hetspec.output import StreamEvent

from deployments.coordinator import ChatMessage, GenerationRequest, InvalidRequest

# Our SamplingParams names -> the OpenAI request's, for error messages (the coordinator's own limit check
# names a bare max_new_tokens).
FIELD_NAMES = {"params.max_new_tokens": "max_tokens", "params.": "", "max_new_tokens": "max_tokens"}


class HetspecOptions(StrictModel):
    algorithm: AlgorithmName | None = Field(None, description="auto, ar, sd, slem, tli or slrs.")
    draft_tokens: int | None = Field(None, ge=1, le=64, description="Draft length k.")
    pipelined: bool | None = Field(None, description="Draft the next chunk while the target verifies.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="Send a last chunk with usage.")


class TextPart(StrictModel):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class OpenAIMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer"] = Field(description="Who speaks.")
    content: str | list[TextPart] = Field(description="Text, or text parts.")
    name: str | None = Field(None, description="Ignored.")

    def to_chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


def _unsupported(value: Any, default: Any) -> Any:
    if value not in (None, default):
        raise ValueError(f"only {default!r} is supported by this server")
    return value


class _OpenAIRequest(StrictModel):
    model: str = Field(description="Must be the served model id (GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens (0: all).")
    n: int | None = Field(None, description="Only 1.")
    stream: bool | None = Field(False, description="Server-sent events, one per decoding step.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: str | list[str] | None = Field(None, description="Stop strings.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed of the per-position random stream.")
    presence_penalty: float | None = Field(None, description="Only 0.")
    frequency_penalty: float | None = Field(None, description="Only 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported.")
    user: str | None = Field(None, description="Ignored.")
    hetspec: HetspecOptions | None = Field(None, description="Speculation options (extension).")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        return _unsupported(value, 1)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        return _unsupported(value, 0.0)

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("is not supported by this server")
        return value

    def _stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _generation(self, default_max_tokens: int, max_tokens: int | None, **prompt) -> GenerationRequest:
        options = self.hetspec or HetspecOptions()
        params = {"max_new_tokens": max_tokens or default_max_tokens,
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": self.top_k or 0,
                  "seed": self.seed, "stop": self._stop_list(), "ignore_eos": options.ignore_eos}
        return GenerationRequest.model_validate({
            **prompt, "params": params, "algorithm": options.algorithm, "draft_tokens": options.draft_tokens,
            "pipelined": options.pipelined})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] = Field(description="The prompt (a list must hold exactly one string).")
    echo: bool | None = Field(None, description="Only false.")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, description="Only 1.")
    logprobs: int | None = Field(None, description="Not supported.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("must be a string or a list of exactly one string")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        return _unsupported(value, False)

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value):
        return _unsupported(value, 1)

    @field_validator("suffix", "logprobs")
    @classmethod
    def _none(cls, value):
        if value is not None:
            raise ValueError("is not supported by this server")
        return value

    def to_generation(self, default_max_tokens: int) -> GenerationRequest:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return self._generation(default_max_tokens, self.max_tokens, prompt=prompt)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[OpenAIMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (newer name).")
    logprobs: bool | None = Field(None, description="Only false.")
    top_logprobs: int | None = Field(None, description="Not supported.")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        return _unsupported(value, False)

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value):
        if value is not None:
            raise ValueError("is not supported by this server")
        return value

    def to_generation(self, default_max_tokens: int) -> GenerationRequest:
        messages = [message.to_chat_message().model_dump() for message in self.messages]
        return self._generation(default_max_tokens, self.max_completion_tokens or self.max_tokens,
                                messages=messages)


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ErrorDetail(StrictModel):
    message: str = Field(description="What is wrong; starts with the field's name when a field is at fault.")
    type: str = Field(description="invalid_request_error, authentication_error, server_busy, server_unavailable, ...")
    param: str | None = Field(description="The request field at fault (dotted path), if any.")
    code: str | None = Field(description="A machine-readable code (e.g. overloaded), if any.")


class ErrorResponse(StrictModel):
    """OpenAI's error body: every 4xx/5xx of this API has it."""

    error: ErrorDetail = Field(description="The error.")


class Usage(StrictModel):
    prompt_tokens: int = Field(description="Prompt tokens (the target's).")
    completion_tokens: int = Field(description="Generated tokens (the target's).")
    total_tokens: int = Field(description="Their sum.")


class HetspecResult(StrictModel):
    token_ids: list[int] = Field(description=(
        "The generated target token ids; after a stop string, those that start before it (docs/stop-strings.md)."))
    stats: dict[str, Any] = Field(description="Speculation statistics (acceptance, forwards, seconds, ...).")


class CompletionChoice(StrictModel):
    index: int = Field(description="Always 0.")
    text: str = Field(description="The generated text.")
    finish_reason: Literal["stop", "length"] = Field(description="Why generation ended.")
    logprobs: None = Field(description="Not supported: always null.")


class Completion(StrictModel):
    """A whole completion (``stream: false``); documents the 200 response, checked by the fuzz test."""

    id: str = Field(description="cmpl-<request id>.")
    object: Literal["text_completion"] = Field(description="The object type.")
    created: int = Field(description="Unix time.")
    model: str = Field(description="The served model id.")
    choices: list[CompletionChoice] = Field(min_length=1, max_length=1, description="One choice.")
    usage: Usage = Field(description="Token counts.")
    hetspec: HetspecResult = Field(description="Token ids and speculation statistics (extension).")


class AssistantMessage(StrictModel):
    role: Literal["assistant"] = Field(description="Who speaks.")
    content: str = Field(description="The generated text.")


class ChatChoice(StrictModel):
    index: int = Field(description="Always 0.")
    message: AssistantMessage = Field(description="The reply.")
    finish_reason: Literal["stop", "length"] = Field(description="Why generation ended.")


class ChatCompletion(StrictModel):
    """A whole chat completion (``stream: false``); documents the 200 response."""

    id: str = Field(description="chatcmpl-<request id>.")
    object: Literal["chat.completion"] = Field(description="The object type.")
    created: int = Field(description="Unix time.")
    model: str = Field(description="The served model id.")
    choices: list[ChatChoice] = Field(min_length=1, max_length=1, description="One choice.")
    usage: Usage = Field(description="Token counts.")
    hetspec: HetspecResult = Field(description="Token ids and speculation statistics (extension).")


# The error statuses the generation routes declare in the OpenAPI document (FastAPI's default 422 entry,
# a list of pydantic errors, is replaced: validation errors are 400 with the body above).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when the server requires one)."},
    408: {"model": ErrorResponse, "description": "The request ran past the server's request timeout."},
    422: {"model": ErrorResponse, "description": "Not sent by this server (validation errors are 400); "
                                                 "declared with the error body in place of FastAPI's default."},
    429: {"model": ErrorResponse, "description": "Too many requests in flight or queued; retry after "
                                                 "`Retry-After` seconds."},
    503: {"model": ErrorResponse, "description": "A model actor is being replaced; retry."},
}


def generation_responses(whole: type[StrictModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route's responses: ``whole`` as JSON, or server-sent events with ``stream: true``."""
    events = {"schema": {"type": "string", "description": "data: <chunk JSON> events, ending with data: [DONE]"}}
    return {200: {"model": whole, "description": "The completion, or its event stream.",
                  "content": {"text/event-stream": events}}, **ERROR_RESPONSES}


def usage(event: StreamEvent) -> dict:
    stats = event.stats
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def statistics(event: StreamEvent) -> dict:
    return event.stats.to_dict()


class ResponseWriter:
    """OpenAI response bodies for one request (completion or chat, whole or streamed)."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.sent_role = False

    def _envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": f"{kind}.chunk" if chunk and self.chat else kind,
                "created": self.created, "model": self.model}

    def whole(self, text: str, token_ids: list[int], last: StreamEvent) -> dict:
        choice: dict = {"index": 0, "finish_reason": last.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {**self._envelope(False), "choices": [choice], "usage": usage(last),
                "hetspec": {"token_ids": token_ids, "stats": statistics(last)}}

    def chunk(self, event: StreamEvent) -> dict:
        choice: dict = {"index": 0, "finish_reason": event.finish_reason}
        if self.chat:
            delta = {"content": event.text}
            if not self.sent_role:
                delta["role"], self.sent_role = "assistant", True
            choice["delta"] = delta
        else:
            choice.update(text=event.text, logprobs=None)
        extension: dict = {"token_ids": event.token_ids}
        if event.finish_reason:
            extension["stats"] = statistics(event)
        return {**self._envelope(True), "choices": [choice], "hetspec": extension}

    def usage_chunk(self, last: StreamEvent) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(last)}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def request_error(error: InvalidRequest) -> dict:
    param = error.field
    for ours, theirs in FIELD_NAMES.items():
        param = param.replace(ours, theirs)
    return error_body(f"{param}: {error.message}", param)
