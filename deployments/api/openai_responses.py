"""OpenAI response bodies: the models that document them (OpenAPI, checked by tests/test_fuzz_http.py) and
``ResponseWriter``, which writes them from a request's stream events, whole or as server-sent events.

Log-probabilities are the target's raw ones (``hetspec.output.TokenLogprob``) in OpenAI's two shapes: the
completions API's legacy object (parallel lists) and the chat API's ``content`` list with UTF-8 bytes. A token
whose bytes end inside a UTF-8 character shows U+FFFD in ``token`` (its ``bytes`` are exact); -inf is sent as
-9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field

from hetspec.config import StrictModel
from hetspec.output import GenerationResult, StreamEvent, TokenLogprob

LOWEST_LOGPROB = -9999.0


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
    prompt_tokens: int = Field(description="Prompt tokens (the target's), counted once for all choices.")
    completion_tokens: int = Field(description="Generated tokens (the target's), summed over the choices.")
    total_tokens: int = Field(description="Their sum.")


class HetspecResult(StrictModel):
    token_ids: list[int] = Field(description=(
        "The generated target token ids; after a stop string, those that start before it (docs/stop-strings.md)."))
    stats: dict[str, Any] = Field(description="Speculation statistics (acceptance, forwards, seconds, seed, ...).")


class CompletionLogprobs(StrictModel):
    tokens: list[str] = Field(description="Each generated token's text.")
    token_logprobs: list[float] = Field(description="Its log-probability under the target.")
    top_logprobs: list[dict[str, float]] = Field(description="The most likely tokens at its position, and itself.")
    text_offset: list[int] = Field(description="Where the token's text starts in the choice's text.")


class CompletionChoice(StrictModel):
    index: int = Field(ge=0, description="The choice's index (0 .. n-1).")
    text: str = Field(description="The generated text (after the prompt with echo).")
    finish_reason: Literal["stop", "length"] = Field(description="Why generation ended.")
    logprobs: CompletionLogprobs | None = Field(description="With `logprobs` in the request, else null.")
    hetspec: HetspecResult | None = Field(None, description="This choice's ids and statistics when n > 1.")


class Completion(StrictModel):
    """A whole completion (``stream: false``); documents the 200 response, checked by the fuzz test."""

    id: str = Field(description="cmpl-<request id>.")
    object: Literal["text_completion"] = Field(description="The object type.")
    created: int = Field(description="Unix time.")
    model: str = Field(description="The served model id.")
    choices: list[CompletionChoice] = Field(min_length=1, description="n choices.")
    usage: Usage = Field(description="Token counts.")
    hetspec: HetspecResult = Field(description="Choice 0's token ids and speculation statistics (extension).")


class TopLogprob(StrictModel):
    token: str = Field(description="The token's text.")
    logprob: float = Field(description="Its log-probability under the target.")
    bytes: list[int] = Field(description="The token's UTF-8 bytes (exact where the text shows U+FFFD).")


class TokenLogprobs(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="The `top_logprobs` most likely tokens at this position.")


class ChatLogprobs(StrictModel):
    content: list[TokenLogprobs] = Field(description="One entry per generated token.")


class AssistantMessage(StrictModel):
    role: Literal["assistant"] = Field(description="Who speaks.")
    content: str = Field(description="The generated text.")


class ChatChoice(StrictModel):
    index: int = Field(ge=0, description="The choice's index (0 .. n-1).")
    message: AssistantMessage = Field(description="The reply.")
    finish_reason: Literal["stop", "length"] = Field(description="Why generation ended.")
    logprobs: ChatLogprobs | None = Field(description="With `logprobs: true` in the request, else null.")
    hetspec: HetspecResult | None = Field(None, description="This choice's ids and statistics when n > 1.")


class ChatCompletion(StrictModel):
    """A whole chat completion (``stream: false``); documents the 200 response."""

    id: str = Field(description="chatcmpl-<request id>.")
    object: Literal["chat.completion"] = Field(description="The object type.")
    created: int = Field(description="Unix time.")
    model: str = Field(description="The served model id.")
    choices: list[ChatChoice] = Field(min_length=1, description="n choices.")
    usage: Usage = Field(description="Token counts.")
    hetspec: HetspecResult = Field(description="Choice 0's token ids and speculation statistics (extension).")


class Tokenized(StrictModel):
    """``POST /tokenize``'s answer."""

    count: int = Field(description="How many ids.")
    tokens: list[int] = Field(description="The target ids the generation routes would feed.")
    max_prompt_tokens: int = Field(description="This server's limit on a prompt's ids (limits.max_prompt_tokens).")


class Detokenized(StrictModel):
    """``POST /detokenize``'s answer."""

    prompt: str = Field(description="The ids' text (the target tokenizer's decode, special tokens included).")


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


def tokenizer_responses(body: type[StrictModel]) -> dict[int | str, dict[str, Any]]:
    """/tokenize and /detokenize: ``body``, or an error before any work."""
    return {200: {"model": body, "description": "The answer."},
            **{status: ERROR_RESPONSES[status] for status in (400, 401, 422)}}


def generation_responses(whole: type[StrictModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route's responses: ``whole`` as JSON, or server-sent events with ``stream: true``."""
    events = {"schema": {"anyOf": [{"type": "object"}, {"type": "string", "enum": ["[DONE]"]}],
                         "description": "data: <chunk JSON> events (or an error body), ending with data: [DONE]"}}
    return {200: {"model": whole, "description": "The completion, or its event stream.",
                  "content": {"text/event-stream": events}}, **ERROR_RESPONSES}


class TokenStrings:
    """A target token's text and bytes as log-probabilities show them: its bytes, or a special token's name."""

    def __init__(self, table: list[bytes | None], tokenizer: Any):
        self.table = table
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        piece = self.table[token_id] if token_id < len(self.table) else None
        if piece is None:  # a special token stands for no text: show its name, as vLLM does
            name = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            return name, name.encode()
        return piece.decode("utf-8", errors="replace"), piece


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _usage(results: list[StreamEvent | GenerationResult]) -> dict:
    prompt = results[0].stats.prompt_tokens
    completion = sum(result.stats.generated_tokens for result in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseWriter:
    """OpenAI response bodies for one request of ``choices`` choices (completion or chat, whole or streamed).

    ``echo``: the prompt text put before each completion choice's text (completions with ``echo``)."""

    def __init__(self, chat: bool, model: str, request_id: str, choices: int, token_strings: TokenStrings,
                 echo: str = ""):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.choices = choices
        self.token_strings = token_strings
        self.echo = echo
        self.sent_role = [False] * choices
        self.text_offset = [len(echo)] * choices  # completions' logprobs: where the next token's text starts

    def _envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": f"{kind}.chunk" if chunk and self.chat else kind,
                "created": self.created, "model": self.model}

    def whole(self, results: list[GenerationResult]) -> dict:
        """``results``: one per choice."""
        choices = []
        for index, result in enumerate(results):
            choice: dict = {"index": index, "finish_reason": result.finish_reason,
                            "logprobs": self._logprobs(index, result.logprobs)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = self.echo + result.text
            if len(results) > 1:
                choice["hetspec"] = _extension(result)
            choices.append(choice)
        return {**self._envelope(False), "choices": choices, "usage": _usage(results),
                "hetspec": _extension(results[0])}

    def echo_chunk(self, index: int) -> dict:
        """A completion stream's first event of a choice with ``echo``: the prompt."""
        choice = {"index": index, "text": self.echo, "finish_reason": None, "logprobs": None}
        return {**self._envelope(True), "choices": [choice], "hetspec": {"token_ids": []}}

    def chunk(self, index: int, event: StreamEvent) -> dict:
        choice: dict = {"index": index, "finish_reason": event.finish_reason,
                        "logprobs": self._logprobs(index, event.logprobs)}
        if self.chat:
            delta = {"content": event.text}
            if not self.sent_role[index]:
                delta["role"], self.sent_role[index] = "assistant", True
            choice["delta"] = delta
        else:
            choice["text"] = event.text
        extension: dict = {"token_ids": event.token_ids}
        if event.finish_reason:
            extension["stats"] = event.stats.to_dict()
        return {**self._envelope(True), "choices": [choice], "hetspec": extension}

    def usage_chunk(self, last_events: list[StreamEvent]) -> dict:
        """The closing usage event; ``last_events``: each choice's last event."""
        return {**self._envelope(True), "choices": [], "usage": _usage(last_events)}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**self._top(entry.token_id, entry.logprob),
                                 "top_logprobs": [self._top(token_id, logprob) for token_id, logprob in entry.top]}
                                for entry in entries]}
        tokens = [self.token_strings(entry.token_id)[0] for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset[index])
            self.text_offset[index] += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(entry.logprob) for entry in entries],
                "top_logprobs": [{**{self.token_strings(token_id)[0]: _finite(logprob) for token_id, logprob in
                                     entry.top}, token: _finite(entry.logprob)}
                                 for token, entry in zip(tokens, entries)],
                "text_offset": offsets}

    def _top(self, token_id: int, logprob: float) -> dict:
        text, piece = self.token_strings(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(piece)}


def _extension(result: GenerationResult) -> dict:
    return {"token_ids": result.token_ids, "stats": result.stats.to_dict()}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
