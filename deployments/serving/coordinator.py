"""The coordinator: validates a request, opens its KV sessions in the two workers, runs the decode loop.

Protocol-free: the OpenAI routes (``openai_api``) and the gRPC methods (``grpc_service``) turn their
requests into a ``GenerationRequest`` and consume the ``StreamEvent``s this yields. Errors a client can
fix are ``InvalidRequest`` naming the field; a full server (running and waiting requests, or an actor's
sessions) is ``Overloaded``; a request past ``limits.request_timeout_s`` is stopped with ``RequestTimeout``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from pydantic import ValidationError
from ray.exceptions import TaskCancelledError

from hetspec.algorithms import Algorithm, PairMaps, make_algorithm
from hetspec.config import BatchingConfig, SamplingParams, SpeculationConfig
from hetspec.engine import prompt_ids
from hetspec.output import StreamEvent
from hetspec.models import LanguageModel
from hetspec.step import StepOutcome

from deployments.auth import ApiKeys
from deployments.config import AppConfig
from deployments.errors import (InvalidRequest, Overloaded, RequestTimeout, SessionLimitReached, WorkerLost,
                                WorkerUnresponsive)
from deployments.runtime.metrics import coordinator_metrics
from deployments.serving.admission import Admission, Ticket
from deployments.serving.replica_loop import RemoteRequest, RemoteRunner, ReplicaLoop
from deployments.serving.request import GenerationRequest, request_speculation, validation_to_invalid
from deployments.workers.api import ModelInfo, OpenSession, WorkerClient

log = logging.getLogger("ray.serve")

# How long one health check's answer serves /health (check_health).
HEALTH_CACHE_S = 1.0
# How long a health check waits for each actor's ping: one on a cut-off node answers nothing until Ray declares it
# dead (tens of seconds; /health timed out meanwhile in docs/deploy.md's link-down timeline): 503 naming it instead.
HEALTH_WAIT_S = 2.0


@dataclass
class Prepared:
    """A validated request, ready to run.

    ``request_id`` is the client's (Serve's request id: an ``X-Request-ID`` header or gRPC ``request_id``
    metadata, else one Serve made): it names the request in logs and in the response's ``id``, and nothing
    else, since two clients may send the same one. ``session_id`` keys the request's KV sessions in the model
    actors: made here, per run, never seen by a client."""

    request_id: str
    algorithm: Algorithm
    speculation: SpeculationConfig
    params: SamplingParams
    target_prompt_ids: list[int]
    drafter_prompt_ids: list[int] | None
    pipelined: bool
    deadline: float | None = None  # time.monotonic() past which the request is stopped (limits.request_timeout_s)
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def longest_token_chars(model: LanguageModel) -> int:
    """The most characters one token of ``model`` stands for (at least 1). A text of ``c`` characters is at least
    ``c / longest`` tokens, so a prompt longer than ``max_prompt_tokens * longest`` characters is refused
    without tokenizing it. A vocabulary entry's string is never shorter than the text it encodes (a
    SentencePiece piece with its "▁", a byte-level BPE piece one character per byte, a byte-fallback
    "<0xNN>"), for tokenizers that do not delete characters before encoding."""
    return max(1, max(len(piece) for piece in model.tokenizer.get_vocab()))


def serve_replica_id() -> str | None:
    """Serve's unique id of this replica (as ``serve status`` and the Serve logs name it); None outside a replica."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # not in a Serve replica
        return None


def _with_template(info: ModelInfo, chat_template: str | None) -> LanguageModel:
    model = info.stand_in()
    if chat_template and not model.tokenizer.chat_template:
        model.tokenizer.chat_template = chat_template
    return model


class Coordinator:
    def __init__(self, config: AppConfig, target: WorkerClient, drafter: WorkerClient, target_info: ModelInfo,
                 drafter_info: ModelInfo):
        self.config = config
        self.target, self.drafter = target, drafter
        self.target_model = _with_template(target_info, config.chat_template)
        self.drafter_model = _with_template(drafter_info, config.chat_template)
        self.maps = PairMaps(self.drafter_model, self.target_model)
        self.ongoing = 0
        # requests of this replica, by how they ended
        self.outcomes = {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0, "timed_out": 0}
        limits = config.limits
        self.admission = Admission(limits.max_running_requests, limits.max_waiting_requests, limits.retry_after_s,
                                   limits.kv_cache_bytes, on_change=lambda: self._publish_load())
        self.bit_exact = target_info.bit_exact  # the target's self-check: /v1/models reports it
        self.kv_bytes_per_token = {"target": target_info.kv_bytes_per_token,
                                   "drafter": drafter_info.kv_bytes_per_token}
        # the replica's one decode loop: the library's scheduler and step, the passes in the actors
        self.loop = ReplicaLoop(_batching(config), config.speculation.load_adaptive,
                                RemoteRunner(on_drafter_lost=lambda request: self._drafter_lost(request.request_id)),
                                on_step=self._record_step)
        self.api_keys = ApiKeys.from_config(config.auth)  # the environment of this replica's process
        self.longest_token_chars = longest_token_chars(self.target_model)
        self._health: tuple[float, asyncio.Task | None] = (0.0, None)  # the last health check: when, its task
        # prompts are tokenized here, one at a time, never on the event loop (health and the streams wait on it)
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="hetspec-tokenize")
        self.replica = serve_replica_id() or uuid.uuid4().hex[:8]  # Serve's id: the metrics' and actor names' too
        self.metrics = coordinator_metrics()
        self.metrics.for_replica(self.replica)
        self._publish_load()

    def reconfigure(self, config: AppConfig) -> None:
        """Take ``config``'s speculation and limits for new requests: a prepared request holds its own
        speculation and deadline, and admission keeps who runs and who waits (``Admission.resize``)."""
        self.config = config
        limits = config.limits
        self.admission.resize(limits.max_running_requests, limits.max_waiting_requests, limits.retry_after_s,
                              limits.kv_cache_bytes)
        self.loop.reconfigure(_batching(config), config.speculation.load_adaptive)
        self._publish_load()  # the KV budget may have changed

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt (or its messages' contents together) may have: longer ones cannot fit
        in ``limits.max_prompt_tokens`` (``longest_token_chars``) and are refused before they are tokenized."""
        return self.config.limits.max_prompt_tokens * self.longest_token_chars

    def check_prompt_size(self, request: GenerationRequest) -> None:
        """``InvalidRequest`` for a prompt or messages too long for any tokenization to fit the prompt limit."""
        if request.prompt is not None:
            chars = len(request.prompt)
        else:
            chars = sum(len(message.content) for message in request.messages or [])
        if chars > self.max_prompt_chars:
            raise InvalidRequest("prompt" if request.prompt is not None else "messages",
                                 f"is {chars} characters, more than {self.config.limits.max_prompt_tokens} tokens "
                                 f"(this server's limit) can hold ({self.max_prompt_chars} characters)")

    def check_output_size(self, params: SamplingParams, choices: int = 1) -> None:
        """``InvalidRequest`` for more tokens or log-probabilities in all ``choices`` than this server answers."""
        limits = self.config.limits
        if params.max_new_tokens > limits.max_new_tokens:
            raise InvalidRequest("max_new_tokens", f"must be at most {limits.max_new_tokens} on this server")
        tokens = choices * params.max_new_tokens
        if tokens > limits.max_request_new_tokens:
            raise InvalidRequest("max_new_tokens", f"n x max_tokens is {tokens}, above this server's limit of "
                                                   f"{limits.max_request_new_tokens} (limits.max_request_new_tokens)")
        if params.logprobs is not None and tokens * (1 + params.logprobs) > limits.max_logprob_entries:
            raise InvalidRequest("logprobs", f"n x max_tokens x (1 + top_logprobs) is {tokens * (1 + params.logprobs)}"
                                             f", above this server's limit of {limits.max_logprob_entries} "
                                             "(limits.max_logprob_entries)")

    def check_draft_tokens(self, draft_tokens: int | None) -> None:
        """A client's draft length is at most the server's ``speculation.max_draft_tokens`` (or its own
        ``draft_tokens``, if higher): drafting is work admission does not see beyond it."""
        server = self.config.speculation
        bound = max(server.draft_tokens, server.max_draft_tokens)
        if draft_tokens is not None and draft_tokens > bound:
            raise InvalidRequest("draft_tokens", f"must be at most {bound} on this server "
                                                 "(speculation.max_draft_tokens)")

    async def prepare_async(self, request: GenerationRequest, request_id: str | None = None,
                            choices: int = 1) -> Prepared:
        """``prepare`` on the tokenizer thread: the event loop goes on serving while a prompt is tokenized."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, self.prepare, request,
                                                                request_id, choices)

    def prepare(self, request: GenerationRequest, request_id: str | None = None, choices: int = 1) -> Prepared:
        """Validate everything a client can get wrong, before any response is sent; the sizes first, so an
        oversized request costs no tokenizing. ``choices``: the runs the client's request makes (OpenAI's n)."""
        self.check_output_size(request.params, choices)
        self.check_draft_tokens(request.draft_tokens)
        self.check_prompt_size(request)
        limits = self.config.limits
        vocab_size = self.target_model.vocab_size
        for token_id in request.params.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidRequest("stop_token_ids", f"{token_id} is not a token id of the target "
                                                       f"(its vocabulary has {vocab_size})")
        try:
            speculation = request_speculation(self.config.speculation, request.algorithm, request.draft_tokens)
        except ValidationError as error:
            raise validation_to_invalid(error) from None
        try:
            algorithm = make_algorithm(speculation.algorithm, self.maps, speculation, request.params)
        except (ValueError, NotImplementedError) as error:
            raise InvalidRequest("algorithm", str(error)) from None
        target_prompt_ids = self.target_prompt_ids(request)
        if len(target_prompt_ids) > limits.max_prompt_tokens:
            raise InvalidRequest("messages" if request.messages else "prompt",
                                 f"is {len(target_prompt_ids)} tokens, above this server's limit of "
                                 f"{limits.max_prompt_tokens}")
        drafter_prompt_ids = self._prompt_ids(request, self.drafter_model) if algorithm.needs_drafter else None
        pipelined = self.config.pipeline.pipelined if request.pipelined is None else request.pipelined
        timeout_s = limits.request_timeout_s
        return Prepared(request_id or uuid.uuid4().hex, algorithm, speculation, request.params.seeded(),
                        target_prompt_ids, drafter_prompt_ids, pipelined,
                        None if timeout_s is None else time.monotonic() + timeout_s)

    def kv_bytes(self, prepared: Prepared) -> int:
        """The KV cache the request may fill: its prompt and max_new_tokens (plus a draft's lookahead) in each
        model. The drafter's output length in its own tokens is unknown; its count of target tokens stands in."""
        new_tokens = prepared.params.max_new_tokens + prepared.speculation.draft_tokens + 1
        needed = (len(prepared.target_prompt_ids) + new_tokens) * self.kv_bytes_per_token["target"]
        if prepared.drafter_prompt_ids is not None:
            needed += (len(prepared.drafter_prompt_ids) + new_tokens) * self.kv_bytes_per_token["drafter"]
        return needed

    def admit(self, protocol: str, prepared: Prepared) -> Ticket:
        """A running slot or a place in line for a request, or ``Overloaded`` (counted) when there is neither."""
        try:
            return self.admission.admit(self.kv_bytes(prepared))
        except Overloaded:
            self.outcomes["rejected"] += 1
            self.metrics.request_errors.inc(tags={"protocol": protocol, "kind": "Overloaded"})
            raise

    def target_prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The target ids the request's prompt or messages are fed as (``InvalidRequest`` if they cannot be)."""
        return self._prompt_ids(request, self.target_model)

    def _prompt_ids(self, request: GenerationRequest, model: LanguageModel) -> list[int]:
        messages = None if request.messages is None else [message.model_dump() for message in request.messages]
        try:
            return prompt_ids(request.prompt, messages, model)
        except ValueError as error:
            raise InvalidRequest("messages" if request.messages is not None else "prompt", str(error)) from None

    async def run(self, prepared: Prepared, protocol: str, ticket: Ticket | None = None) -> AsyncIterator[StreamEvent]:
        """The request's stream events; its KV sessions are freed however it ends (cancellation included).

        ``ticket``: the request's admission if the caller took it already (an HTTP stream decides its status
        before the body starts); else it is taken here, and ``Overloaded`` raised when the server is full.
        """
        arrived = time.perf_counter()
        ticket = ticket or self.admit(protocol, prepared)
        closing: list = []  # the request's session closes, filled in by _run_admitted
        try:
            try:
                await ticket.wait(prepared.deadline)
            except RequestTimeout:  # timed out in line, before anything was opened
                self.outcomes["timed_out"] += 1
                self.metrics.request_errors.inc(tags={"protocol": protocol, "kind": "RequestTimeout"})
                raise
            self.metrics.queue_time.observe(time.perf_counter() - arrived, tags={"protocol": protocol})
            async with aclosing(self._run_admitted(prepared, protocol, closing, arrived)) as events:
                async for event in events:
                    yield event
        finally:
            ticket.release_after(closing)

    async def _run_admitted(self, prepared: Prepared, protocol: str, closing: list,
                            arrived: float) -> AsyncIterator[StreamEvent]:
        """``arrived``: when the request reached this replica (time.perf_counter), for the latency metrics."""
        request_id, session_id, algorithm = prepared.request_id, prepared.session_id, prepared.algorithm
        workers: list[WorkerClient] = []  # the actors holding this request's sessions
        first_text_at: float | None = None
        finished = False
        self._track(+1)
        log.info("request start request_id=%s session=%s protocol=%s algorithm=%s prompt_tokens=%d "
                 "max_new_tokens=%d pipelined=%s", request_id, session_id, protocol, algorithm.name,
                 len(prepared.target_prompt_ids), prepared.params.max_new_tokens, prepared.pipelined)
        try:
            # pinned: if an actor is replaced meanwhile, this request fails (WorkerLost) instead of calling
            # a new actor that never saw its session
            target = self.target.pinned()
            drafter = self._pinned_drafter() if algorithm.needs_drafter else None
            workers = [target] + ([drafter] if drafter else [])
            drafter = await self._open(prepared, target, drafter)
            if algorithm.needs_drafter and drafter is None:
                self._drafter_lost(request_id)
            request = RemoteRequest(request_id, session_id, algorithm, self.target_model, prepared.params,
                                    prepared.speculation, prepared.target_prompt_ids, target, drafter,
                                    prepared.pipelined, prompt_in_cache=prepared.pipelined)
            # closed with the request's stream (a client gone): the request leaves the loop now, not when collected
            async with aclosing(_until(prepared.deadline, self.loop.run(request))) as events:
                async for event in events:
                    if first_text_at is None and event.text:
                        first_text_at = time.perf_counter()
                        self.metrics.time_to_first_token.observe(first_text_at - arrived, tags={"protocol": protocol})
                    if event.finish_reason:
                        finished = True
                        self.outcomes["finished"] += 1
                        self._record_finish(protocol, event, arrived, first_text_at)
                        log.info("request done request_id=%s finish_reason=%s %s", request_id, event.finish_reason,
                                 " ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                                          for key, value in event.stats.to_dict().items()))
                    yield event
        except (asyncio.CancelledError, GeneratorExit, TaskCancelledError):  # the client went away
            if not finished:  # a consumer closing us after the last event is no cancellation
                self.outcomes["cancelled"] += 1
                log.info("request cancelled request_id=%s", request_id)
                self.metrics.request_errors.inc(tags={"protocol": protocol, "kind": "cancelled"})
            raise
        except RequestTimeout:
            self.outcomes["timed_out"] += 1
            log.info("request timed out request_id=%s", request_id)
            self.metrics.request_errors.inc(tags={"protocol": protocol, "kind": "RequestTimeout"})
            raise
        except Exception as error:
            self.outcomes["failed"] += 1
            log.warning("request failed request_id=%s error=%s", request_id, type(error).__name__)
            self.metrics.request_errors.inc(tags={"protocol": protocol, "kind": type(error).__name__})
            raise
        finally:
            self._track(-1)
            closing.extend(worker.close(session_id) for worker in workers)

    def _pinned_drafter(self) -> WorkerClient | None:
        """The drafter for a new request, or None while it is being replaced (the request runs target-only)."""
        try:
            return self.drafter.pinned()
        except WorkerLost:
            return None

    async def _open(self, prepared: Prepared, target: WorkerClient,
                    drafter: WorkerClient | None) -> WorkerClient | None:
        """Open the request's sessions; the drafter to use (None: lost while opening, decode target-only)."""
        # In step, the target's prompt goes a chunk per step with the others' verify call (the replica loop):
        # prefilled here it ran beside the others' draft calls
        def session(prompt_ids: list[int], prefill_now: bool) -> OpenSession:
            return OpenSession(prepared.session_id, prompt_ids, prepared.algorithm.name, prepared.speculation,
                               prepared.params, prefill_now)

        opening = [target.open(session(prepared.target_prompt_ids, prepared.pipelined))]
        if drafter is not None:
            # The drafter's prefill waits for the first draft (deployments/workers/model_workers.py) unless the models
            # work side by side (pipelined): in step, the first draft comes when the target is idle, while at open the
            # two prefills would share the cores (TTFT 14.3 s against 7.7 s without a drafter at 4 clients,
            # docs/decisions/served-in-step.md); and at load, while the policy drafts nothing,
            # the prompt may never be drafted from
            prefill_now = prepared.pipelined and (not prepared.speculation.load_adaptive or self.loop.drafts_soon())
            opening.append(drafter.open(session(prepared.drafter_prompt_ids, prefill_now)))
        # both settle before any error is raised, so no session is opened behind a failure's back
        target_error, drafter_error = [*await asyncio.gather(*opening, return_exceptions=True), None][:2]
        for error in (target_error, drafter_error):
            if isinstance(error, SessionLimitReached):
                raise Overloaded(str(error), self.config.limits.retry_after_s) from None
        if isinstance(target_error, BaseException):
            raise target_error
        if isinstance(drafter_error, WorkerLost):
            return None
        if isinstance(drafter_error, BaseException):
            raise drafter_error
        return drafter

    def _drafter_lost(self, request_id: str) -> None:
        log.warning("drafter lost request_id=%s: decoding with the target alone", request_id)
        self.metrics.drafter_lost.inc()

    async def stats(self) -> dict:
        async def actor_stats(worker: WorkerClient) -> dict:
            try:
                return await worker.stats()
            except WorkerLost as error:
                return {"error": str(error)}

        target, drafter = await asyncio.gather(actor_stats(self.target), actor_stats(self.drafter))
        return {"replica": self.replica, "replica_pid": os.getpid(), "ongoing_requests": self.ongoing,
                "running_slots": self.admission.running, "waiting_requests": self.admission.waiting,
                "admitted_kv_bytes": self.admission.kv_bytes, "kv_cache_bytes": self.admission.kv_budget,
                **{f"{outcome}_requests": count for outcome, count in self.outcomes.items()},
                "target": target, "drafter": drafter}

    async def check_health(self) -> None:
        """Both actors answer a ping (else ``WorkerLost``). One check serves every caller for ``HEALTH_CACHE_S``:
        a flood of /health costs the actors one ping each per period, whatever its rate."""
        now, loop = time.monotonic(), asyncio.get_running_loop()
        checked_at, check = self._health
        if check is None or now - checked_at > HEALTH_CACHE_S or check.get_loop() is not loop:
            check = loop.create_task(self._ping_both())
            self._health = (now, check)
        await asyncio.shield(check)  # a caller that goes away does not cancel the others' check

    async def _ping_both(self) -> None:
        async def ping(role: str, worker) -> None:
            try:
                async with asyncio.timeout(HEALTH_WAIT_S):
                    await worker.ping()
            except TimeoutError:
                raise WorkerUnresponsive(role, HEALTH_WAIT_S) from None

        await asyncio.gather(ping("target", self.target), ping("drafter", self.drafter))

    def _publish_load(self) -> None:
        """Running and waiting requests, and the KV memory they are admitted with, of this replica."""
        tags = {"replica": self.replica}
        self.metrics.running_requests.set(self.admission.running, tags=tags)
        self.metrics.waiting_requests.set(self.admission.waiting, tags=tags)
        self.metrics.admitted_kv_bytes.set(self.admission.kv_bytes, tags=tags)
        if self.admission.kv_budget is not None:
            self.metrics.kv_budget_bytes.set(self.admission.kv_budget, tags=tags)

    def _track(self, delta: int) -> None:
        self.ongoing += delta
        self.metrics.ongoing_requests.set(self.ongoing, tags={"replica": self.replica})

    def _record_step(self, step: StepOutcome) -> None:
        tags = {"algorithm": step.request.algorithm.name}
        by_source = {**tags, "source": step.source}
        self.metrics.accepted_length.observe(step.accepted, tags=tags)
        if step.drafted:  # a Ray counter only takes positive increments
            self.metrics.drafted_tokens.inc(step.drafted, tags=by_source)
            self.metrics.draft_length.observe(step.drafted, tags=tags)
        if step.accepted:
            self.metrics.accepted_tokens.inc(step.accepted, tags=by_source)
        for stage, seconds in (("drafter", step.drafter_seconds), ("target", step.target_seconds),
                               ("alignment", step.alignment_seconds)):
            if seconds:
                self.metrics.step_seconds.observe(seconds, tags={"stage": stage})
        if step.ahead:
            self.metrics.pipeline.inc(tags={"outcome": step.ahead})

    def _record_finish(self, protocol: str, event: StreamEvent, arrived: float, first_text_at: float | None) -> None:
        stats = event.stats
        tags = {"algorithm": stats.algorithm}
        now = time.perf_counter()
        self.metrics.request_latency.observe(now - arrived, tags={"protocol": protocol})
        if first_text_at is not None and stats.generated_tokens > 1:  # vLLM's TPOT: after the first token
            self.metrics.time_per_output_token.observe((now - first_text_at) / (stats.generated_tokens - 1),
                                                       tags={"protocol": protocol})
        self.metrics.requests.inc(tags={"protocol": protocol, "algorithm": stats.algorithm,
                                        "finish_reason": event.finish_reason})
        if stats.generated_tokens:
            self.metrics.generated_tokens.inc(stats.generated_tokens, tags=tags)
        self.metrics.prompt_tokens.inc(stats.prompt_tokens, tags=tags)


def _batching(config: AppConfig) -> BatchingConfig:
    """The replica loop's batch: every running request (admission bounds them), prompts chunked as the actors do."""
    return BatchingConfig(max_batch_size=config.limits.max_running_requests,
                          prefill_chunk_tokens=config.pipeline.prefill_chunk_tokens)


async def _until(deadline: float | None, events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    """``events`` until ``deadline`` (``time.monotonic()``): past it the step in progress is cancelled and
    ``RequestTimeout`` raised, so a slow or stuck step cannot hold the request's sessions beyond its time."""
    async with aclosing(events):
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                async with asyncio.timeout(None if remaining is None else max(0.0, remaining)):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimeout("the request ran past this server's time limit "
                                     "(limits.request_timeout_s); it was stopped") from None
            yield event
