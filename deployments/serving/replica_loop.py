"""The replica's one decode loop: the library's scheduler and step (hetspec/step.py ``Scheduler``, ``run_step``)
driven on this replica's event loop, the passes run by the drafter and target actors (``RemoteRunner``: one call per
model per step for the whole batch). Requests join and leave at step boundaries; a request that leaves (finished,
cancelled, timed out) is out of the next step, and the coordinator frees its KV sessions at once.

If the drafter is lost mid-request (``WorkerLost``, or its session swept while the request drafted nothing), the
request goes on with the target alone: a step with no candidates verifies nothing and commits the target's own next
token, which is what the target alone would output, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Sequence

from hetspec.adaptive import LoadAdaptive
from hetspec.algorithms import Algorithm, Draft
from hetspec.config import BatchingConfig, SamplingParams, SpeculationConfig
from hetspec.decoder import Progress
from hetspec.models import LanguageModel
from hetspec.output import Stats, StreamEvent, TokenLogprob
from hetspec.step import DraftCall, Scheduler, StepOutcome, VerifyCall, Verified, run_step

from deployments.errors import UnknownSession, WorkerLost
from deployments.workers.api import DraftItem, Drafted, VerifyItem, VerifyResult, WorkerClient

log = logging.getLogger("ray.serve")


class RemoteTarget:
    """A request's committed target ids here, its KV session in the target actor (``TargetSide``'s view)."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.ids = list(prompt_ids)
        self.prompt_len = len(self.ids)
        self.step_logprobs: list[TokenLogprob] | None = None  # of the ids the last verify committed


class RemoteRequest(Progress):
    """One served request: its progress here, its KV sessions in the actors (``session_id``)."""

    def __init__(self, request_id: str, session_id: str, algorithm: Algorithm, target_model: LanguageModel,
                 params: SamplingParams, speculation: SpeculationConfig, target_prompt_ids: list[int],
                 target: WorkerClient, drafter: WorkerClient | None, pipelined: bool, prompt_in_cache: bool) -> None:
        self.request_id = request_id  # the client's (logs); ``session_id`` keys the KV sessions in the actors
        self.session_id = session_id
        self.algorithm = algorithm
        self.target = RemoteTarget(target_prompt_ids)
        self.target_worker = target
        self.drafter = drafter  # None: no drafter for this algorithm, or it was lost
        # target prompt tokens still to feed a chunk per step (all but the last: the first verify feeds that one)
        self.prompt_left = 0 if prompt_in_cache else max(0, len(target_prompt_ids) - 1)
        stats = Stats(algorithm=algorithm.name, prompt_tokens=len(target_prompt_ids),
                      drafter_lost=algorithm.needs_drafter and drafter is None)
        super().__init__(target_model, params, speculation, stats, target_prompt_ids)
        self.pipelined = stats.pipelined = pipelined and drafter is not None

    @property
    def prefilled(self) -> bool:
        return self.prompt_left == 0

    def prefill_feeds(self, budget: int) -> tuple[list[Any], list[Any], int]:
        """(target chunks, drafter chunks, tokens): this request's next target prompt chunk (the target actor sizes
        it, ``prefill_chunk_tokens``); the drafter's prompt is fed at open or by its first draft."""
        return [self], [], min(budget, self.prompt_left)


class RemoteRunner:
    """Runs a step's calls in the drafter and target actors: one batched call per actor and step (the requests of a
    step normally share one actor of each; a request pinned to an actor since replaced calls that one)."""

    def __init__(self, on_drafter_lost: Callable[[RemoteRequest], None] = lambda request: None) -> None:
        self.on_drafter_lost = on_drafter_lost
        self._fed_prompt = False  # a drafter pass fed a context's chunk this step (a catch-up): the step prices it

    async def draft(self, call: DraftCall) -> list[Draft | BaseException | None]:
        """Each order's draft (None: the request's drafter was lost, it goes on target-only); chunks: none here."""
        items = [DraftItem(order.request.session_id, order.committed, order.k, order.first_position,
                           order.draft_round) for order in call.orders]
        outcomes = await _per_worker([order.request.drafter for order in call.orders], items, "draft")
        drafts: list[Draft | BaseException | None] = []
        for order, outcome in zip(call.orders, outcomes):
            if isinstance(outcome, Drafted):
                self._fed_prompt |= outcome.fed_prompt
                order.request.stats.drafter_forwards += outcome.draft.drafter_forwards
                drafts.append(outcome.draft)
            elif _drafter_gone(outcome):
                self._lose_drafter(order.request)
                drafts.append(None)
            else:
                drafts.append(outcome)
        return drafts

    async def verify(self, call: VerifyCall) -> Verified:
        requests: list[RemoteRequest] = [*call.requests, *call.chunks]
        items = [VerifyItem(request.session_id, draft) for request, draft in zip(call.requests, call.drafts)]
        items += [VerifyItem(request.session_id, None) for request in call.chunks]  # a prompt chunk in the same pass
        verifying = _per_worker([request.target_worker for request in requests], items, "verify")
        ahead: list[Draft | BaseException | None] = []
        if call.ahead:
            outcomes, ahead = await asyncio.gather(verifying, self.draft(DraftCall(call.ahead, [])))
        else:
            outcomes = await verifying
        committed: list[list[int] | BaseException] = []
        fed_prompt = self._fed_prompt or any(isinstance(outcome, VerifyResult) and outcome.fed_prompt
                                             for outcome in outcomes)
        self._fed_prompt = False
        for index, (request, outcome) in enumerate(zip(requests, outcomes)):
            if index >= len(call.requests):  # a prompt chunk: a failed one fails its request's first verify
                request.prompt_left = outcome.prompt_left if isinstance(outcome, VerifyResult) else 0
                continue
            if isinstance(outcome, VerifyResult):
                request.prompt_left = 0  # a verify pass feeds whatever of the prompt was not cached yet
                request.target.ids.extend(outcome.new_ids)
                request.target.step_logprobs = outcome.logprobs
                committed.append(outcome.new_ids)
            else:
                committed.append(outcome)
        return Verified(committed, ahead, fed_prompt)

    def _lose_drafter(self, request: RemoteRequest) -> None:
        if request.drafter is not None:
            request.drafter, request.pipelined = None, False
            request.stats.drafter_lost = True
            self.on_drafter_lost(request)


def _drafter_gone(outcome: Any) -> bool:
    """The drafter died, is being replaced, or no longer holds the request's session (swept while the request
    drafted nothing): the request goes on target-only."""
    return isinstance(outcome, UnknownSession) or (isinstance(outcome, WorkerLost) and outcome.role == "drafter")


async def _per_worker(workers: list[WorkerClient], items: list, method: str) -> list:
    """Each item's outcome (a result or the exception it met) from one batched call per distinct worker."""
    groups: dict[int, tuple[WorkerClient, list[int]]] = {}
    for index, worker in enumerate(workers):
        groups.setdefault(worker.identity, (worker, []))[1].append(index)
    outcomes: list = [None] * len(items)

    async def call(worker: WorkerClient, indices: list[int]) -> None:
        batch = [items[index] for index in indices]
        try:
            results = await (worker.draft(batch) if method == "draft" else worker.verify(batch))
        except Exception as error:  # noqa: BLE001 -- e.g. WorkerLost: every item of the call met it
            results = [error] * len(batch)
        for index, result in zip(indices, results):
            outcomes[index] = result

    await asyncio.gather(*(call(worker, indices) for worker, indices in groups.values()))
    return outcomes


class ReplicaLoop:
    """Steps while the replica has requests; each request reads its events from its own queue."""

    def __init__(self, batching: BatchingConfig, load_adaptive: bool, runner: RemoteRunner,
                 on_step: Callable[[StepOutcome], None] = lambda outcome: None) -> None:
        self.scheduler = Scheduler(batching, load_adaptive)
        self.runner = runner
        self.on_step = on_step
        self._queues: dict[RemoteRequest, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None

    def reconfigure(self, batching: BatchingConfig, load_adaptive: bool) -> None:
        """New limits; the load-adaptive policy starts afresh when it is turned on."""
        self.scheduler.batching = batching
        if load_adaptive != (self.scheduler.adaptive is not None):
            self.scheduler.adaptive = LoadAdaptive() if load_adaptive else None

    def drafts_soon(self) -> bool:
        """False while requests run and the load-adaptive policy's last cap was 0: a request joining now will likely
        draft nothing for a while (the coordinator then leaves its drafter prefill to its first draft)."""
        adaptive = self.scheduler.adaptive
        return not (adaptive and self.scheduler.running and adaptive.chosen and adaptive.chosen[-1][1] == 0)

    async def run(self, request: RemoteRequest) -> AsyncIterator[StreamEvent]:
        """The request's events until it finishes; it leaves the loop at the next step boundary once the consumer
        stops (cancelled, timed out) or it fails."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request] = queue
        self.scheduler.add(request)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._steps())
        try:
            while True:
                outcome = await queue.get()
                if isinstance(outcome, BaseException):
                    raise outcome
                yield outcome
                if outcome.finish_reason:
                    return
        finally:
            del self._queues[request]
            self.scheduler.remove(request)

    async def _steps(self) -> None:
        while len(self.scheduler):
            try:
                outcomes = await self._step()
            except Exception as error:  # noqa: BLE001 -- a bug in a step: its requests fail, the loop goes on
                log.exception("decode step failed")
                outcomes = [StepOutcome(request, None, error) for request in self.scheduler.running]
                for outcome in outcomes:
                    self.scheduler.remove(outcome.request)
            for outcome in outcomes:
                queue = self._queues.get(outcome.request)
                if queue is None:  # it left during the step
                    continue
                event = outcome.event
                if outcome.error is not None:
                    queue.put_nowait(outcome.error)
                    continue
                self.on_step(outcome)
                if event.token_ids or event.text or event.finish_reason:
                    queue.put_nowait(event)
                if outcome.request.finished:
                    self.scheduler.remove(outcome.request)

    async def _step(self) -> list[StepOutcome]:
        calls, answer = run_step(self.scheduler), None
        try:
            while True:
                call = calls.send(answer)
                answer = await (self.runner.draft(call) if isinstance(call, DraftCall) else self.runner.verify(call))
        except StopIteration as done:
            return done.value
