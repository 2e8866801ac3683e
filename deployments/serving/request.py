"""A generation request as the server takes it, whatever protocol it came by: the OpenAI routes
(deployments/api/openai_api.py) and the gRPC methods (deployments/api/grpc_service.py) build a
``GenerationRequest``; the coordinator validates it against the models and the limits (``Coordinator.prepare``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError

from hetspec.config import Algorithm as AlgorithmName
from hetspec.config import SamplingParams, SpeculationConfig, StrictModel

from deployments.errors import InvalidRequest


# Most chat turns one request may hold (each costs template tokens: more never fit a prompt limit in use).
MAX_MESSAGES = 4096


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: str = Field(description="What is said.")


class GenerationRequest(StrictModel):
    prompt: str | None = Field(None, description="Plain prompt (exclusive with messages).")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES, description=(
        "Chat turns, rendered by each model's chat template (exclusive with prompt)."))
    params: SamplingParams = Field(description="Sampling and stop settings.")
    algorithm: AlgorithmName | None = Field(None, description="Speculation algorithm; None: the server default.")
    draft_tokens: int | None = Field(None, ge=1, le=64, description="Draft length k; None: the server default.")
    pipelined: bool | None = Field(None, description="Pipeline drafting with verification; None: server default.")


def request_speculation(server: SpeculationConfig, algorithm: str | None,
                        draft_tokens: int | None) -> SpeculationConfig:
    """The server's speculation settings with a request's overrides (None: keep the server's); a
    ValidationError names the field a client got wrong."""
    overrides = {name: value for name, value in (("algorithm", algorithm), ("draft_tokens", draft_tokens))
                 if value is not None}
    if overrides.get("algorithm") not in (None, "slem", "auto"):
        overrides["tree_width"] = 1  # the server's SLEM draft tree does not apply to a chain-only algorithm
    return SpeculationConfig.model_validate({**server.model_dump(), **overrides})


def validation_to_invalid(error: ValidationError, renames: dict[str, str] | None = None) -> InvalidRequest:
    """The first pydantic error as an InvalidRequest naming the field (in the client's own words)."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "request"
    for ours, theirs in (renames or {}).items():
        field = field.replace(ours, theirs)
    return InvalidRequest(field, first["msg"])


def serve_request_id() -> str | None:
    """Serve's id of the request being handled (it tags Serve's logs too); None outside a replica.

    Private API: Ray Serve 2.60 has no public accessor for the current request's id (its public
    ``serve.get_replica_context()`` describes the replica, ``serve.get_multiplexed_model_id()`` reads one field
    of this same private context). Pinned with ray in pyproject; if it moves, requests get our own ids."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # noqa: BLE001 -- no Serve context: the coordinator makes an id
        return None
