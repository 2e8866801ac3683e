"""OpenAI completions and chat completions: the request models, their translation, the error bodies.

Only what the official ``openai`` client sends is accepted (plus vLLM's ``stop_token_ids``); an unknown field,
or a known one this server does not implement (penalties, logit_bias, best_of > 1, suffix, echo with logprobs,
...), is a 400 naming the field, never silently ignored. Speculation options travel in the ``hetspec``
extension object (``extra_body`` in the client), statistics come back in a ``hetspec`` field of the response
(deployments/api/openai_responses.py). Defaults follow OpenAI's (temperature 1), except max_tokens: the server's
default_max_new_tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt, ValidationInfo, field_validator

from hetspec.config import Algorithm as AlgorithmName
from hetspec.config import StrictModel

from deployments.api.openai_responses import error_body
from deployments.errors import InvalidRequest
from deployments.serving.request import MAX_MESSAGES, ChatMessage, GenerationRequest

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


# Most text parts one message may hold.
MAX_PARTS = 1024


class OpenAIMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer"] = Field(description="Who speaks.")
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] = Field(description="Text, or text parts.")
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
    n: int | None = Field(None, ge=1, le=16, description=(
        "Choices to return: independent samples (seed s gives choice i the seed s + i), batched together; with "
        "temperature 0 one greedy decode, copied n times, as OpenAI answers."))
    stream: bool | None = Field(False, description="Server-sent events, one per decoding step.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: str | list[str] | None = Field(None, description="Stop strings.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed of the per-position random stream.")
    presence_penalty: float | None = Field(None, description="Only 0.")
    frequency_penalty: float | None = Field(None, description="Only 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported.")
    user: str | None = Field(None, description="Ignored.")
    stop_token_ids: list[NonNegativeInt] | None = Field(None, max_length=64, description=(
        "vLLM's extension: generation ends after any of these target token ids (kept in the output)."))
    hetspec: HetspecOptions | None = Field(None, description="Speculation options (extension).")

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

    @property
    def choices(self) -> int:
        return self.n or 1

    def _generation(self, default_max_tokens: int, max_tokens: int | None, logprobs: int | None,
                    **prompt) -> GenerationRequest:
        options = self.hetspec or HetspecOptions()
        params = {"max_new_tokens": max_tokens or default_max_tokens,
                  "temperature": 1.0 if self.temperature is None else self.temperature,
                  "top_p": 1.0 if self.top_p is None else self.top_p, "top_k": self.top_k or 0,
                  "seed": self.seed, "stop": self._stop_list(), "ignore_eos": options.ignore_eos,
                  "stop_token_ids": self.stop_token_ids or [], "logprobs": logprobs}
        return GenerationRequest.model_validate({
            **prompt, "params": params, "algorithm": options.algorithm, "draft_tokens": options.draft_tokens,
            "pipelined": options.pipelined})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] = Field(description="The prompt (a list must hold exactly one string).")
    echo: bool | None = Field(None, description="Put the prompt before the generated text.")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, description="Only 1.")
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "Log-probabilities of each generated token and of this many most likely alternatives (the target's raw "
        "log-softmax, before temperature, top-k and top-p). Not with echo: the prompt's are not computed."))

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("must be a string or a list of exactly one string")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value):
        return _unsupported(value, 1)

    @field_validator("suffix")
    @classmethod
    def _none(cls, value):
        if value is not None:
            raise ValueError("is not supported by this server")
        return value

    @field_validator("logprobs")
    @classmethod
    def _not_with_echo(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("echo"):
            raise ValueError("is not supported together with echo: the prompt's log-probabilities are not computed")
        return value

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def to_generation(self, default_max_tokens: int) -> GenerationRequest:
        return self._generation(default_max_tokens, self.max_tokens, self.logprobs, prompt=self.prompt_text)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[OpenAIMessage] = Field(min_length=1, max_length=MAX_MESSAGES,
                                          description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (newer name).")
    logprobs: bool | None = Field(None, description=(
        "Log-probabilities of each generated token (the target's raw log-softmax, before temperature, top-k "
        "and top-p)."))
    top_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "With logprobs: this many most likely alternatives at each position."))

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    def to_generation(self, default_max_tokens: int) -> GenerationRequest:
        messages = [message.to_chat_message().model_dump() for message in self.messages]
        return self._generation(default_max_tokens, self.max_completion_tokens or self.max_tokens,
                                (self.top_logprobs or 0) if self.logprobs else None, messages=messages)


class TokenizeRequest(StrictModel):
    """vLLM's ``POST /tokenize``: the target ids a generation route would feed for this prompt or chat."""

    model: str | None = Field(None, description="The served model id, if given.")
    prompt: str | None = Field(None, description="A plain prompt (exclusive with messages).")
    messages: list[OpenAIMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES, description=(
        "Chat turns, rendered by the target's chat template with the assistant's turn opened (exclusive with "
        "prompt)."))
    add_special_tokens: bool = Field(True, description=(
        "For a prompt: true gives the ids completions feed (the target's BOS rule), false the bare text's."))

    def generation_prompt(self) -> dict:
        """The prompt or messages as a GenerationRequest holds them."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("prompt", "give exactly one of prompt or messages")
        if self.messages is not None:
            return {"messages": [message.to_chat_message().model_dump() for message in self.messages]}
        return {"prompt": self.prompt}


class DetokenizeRequest(StrictModel):
    """vLLM's ``POST /detokenize``: the text of target token ids."""

    model: str | None = Field(None, description="The served model id, if given.")
    tokens: list[int] = Field(max_length=1_000_000, description="Target token ids.")


def request_error(error: InvalidRequest) -> dict:
    param = error.field
    for ours, theirs in FIELD_NAMES.items():
        param = param.replace(ours, theirs)
    return error_body(f"{param}: {error.message}", param)
