"""The model workers' API: what the replica asks of its drafter and target, typed.

``DrafterAPI`` and ``TargetAPI`` are what a worker offers (deployments/workers/model_workers.py implements them, in
process or as a Ray actor); ``WorkerClient`` is how the replica reaches one (deployments/workers/clients.py:
``ActorWorker`` over Ray, ``LocalWorker`` on a thread). Every call is a real method: a reader, or a static tool, follows
a request from the replica's loop to the worker's pass. A step's calls are batched: one ``draft`` or ``verify`` call
carries an item per request, and returns per item its result or the exception that item met (the others
still run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Protocol

import torch

from hetspec.algorithms import Draft
from hetspec.config import SamplingParams, SpeculationConfig
from hetspec.models import LanguageModel
from hetspec.output import TokenLogprob


@dataclass
class ModelInfo:
    """What the coordinator needs of a model it does not hold: its tokenizer, logits width and EOS ids."""

    name: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_bytes_per_token: int = 0  # keys and values of one token, all layers (admission's KV budget)
    bit_exact: bool = False  # the model's load-time self-check (hetspec/exact.py)

    def stand_in(self) -> LanguageModel:
        """A LanguageModel without weights: enough for tokenizing, vocabulary maps and ``OutputText``."""
        return LanguageModel(name=self.name, model=None, tokenizer=self.tokenizer, device=torch.device("cpu"),
                             vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids)


@dataclass
class OpenSession:
    """A request's KV session on one model: its prompt (that model's ids) and how it decodes."""

    request_id: str
    prompt_ids: list[int]
    algorithm: str  # a resolved name (hetspec.algorithms.ALGORITHM_CLASSES)
    speculation: SpeculationConfig
    params: SamplingParams
    # the prompt into the KV row now; else the drafter's first draft feeds it, the target a chunk per verify item
    # without a draft (the coordinator's choice, deployments/serving/coordinator.py ``_open``)
    prefill_now: bool = True


@dataclass
class DraftItem:
    """One request's draft in a batched ``draft`` call."""

    request_id: str
    committed: bytes  # the committed output text the draft continues (the drafter re-syncs to it first)
    k: int  # draft length
    first_position: int  # output position of the first drafted token (hetspec.sampling keys)
    draft_round: int  # the request's draft round: a drafter's random numbers are never reused


@dataclass
class Drafted:
    """A ``draft`` item's result."""

    draft: Draft  # ``draft_probs``, if any, is a stored reference (``store``) between processes
    seconds: float = 0.0  # the call's time inside the drafter
    # a pass of the call fed a context's chunk (a catch-up): the load-adaptive policy leaves the step out of its
    # measure (hetspec/step.py Verified.fed_prompt)
    fed_prompt: bool = False


@dataclass
class VerifyItem:
    """One request's verification in a batched ``verify`` call; ``draft`` None feeds the next chunk of the
    session's prompt (opened without prefill) in the call's pass instead."""

    request_id: str
    draft: Draft | None


@dataclass
class VerifyResult:
    """A ``verify`` item's result."""

    new_ids: list[int]  # accepted candidates and the target's own next token; empty for a prompt chunk
    seconds: float = 0.0  # time inside the target
    logprobs: list[TokenLogprob] | None = None  # one per new id, when the request asked for them
    # a pass since the previous verify returned fed a prompt's chunk: the load-adaptive policy leaves its step out
    # of the measure (hetspec/step.py Verified.fed_prompt)
    fed_prompt: bool = False
    prompt_left: int = 0  # a prompt-chunk item: the prompt tokens still to feed


class ModelWorkerAPI(Protocol):
    """What both workers offer."""

    def info(self) -> ModelInfo: ...

    def ping(self) -> str: ...

    def set_kv_budget(self, budget_bytes: int | None) -> None: ...

    def node_id(self) -> str | None: ...

    def stats(self) -> dict: ...

    def open(self, session: OpenSession) -> None: ...

    def close(self, request_id: str) -> bool: ...


class DrafterAPI(ModelWorkerAPI, Protocol):
    def attach_target(self, target: ModelInfo) -> None: ...

    def draft(self, items: list[DraftItem]) -> list[Drafted | Exception]: ...


class TargetAPI(ModelWorkerAPI, Protocol):
    def verify(self, items: list[VerifyItem]) -> list[VerifyResult | Exception]: ...


class WorkerClient(Protocol):
    """A drafter or target worker as the replica calls it: each call is running once the method returns.

    ``draft`` and ``verify`` go on behalf of several requests (a batch): no request's cancellation may cancel
    them. ``close`` must happen even if the calling request is being cancelled; it is already running when this
    returns, and awaiting it is optional (the admission waits for closes before it hands the request's slot on,
    so the actors never hold more sessions than running requests)."""

    def open(self, session: OpenSession) -> Awaitable[None]: ...

    def close(self, request_id: str) -> Awaitable[bool]: ...

    def draft(self, items: list[DraftItem]) -> Awaitable[list[Drafted | Exception]]: ...

    def verify(self, items: list[VerifyItem]) -> Awaitable[list[VerifyResult | Exception]]: ...

    def stats(self) -> Awaitable[dict]: ...

    def ping(self) -> Awaitable[str]: ...

    def node_id(self) -> Awaitable[str | None]: ...

    def pinned(self) -> "WorkerClient":
        """This worker as it is now, for one request: it keeps calling the process that holds its sessions."""
