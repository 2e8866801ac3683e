"""A request's steps with the drafter and target in other processes.

Each step is the library's: the draft length, draft round and bookkeeping are ``hetspec.decoder.Progress``'s
(the object ``hetspec.decoder.Request`` is in process), the draft and the verification run in the workers
through the library's own step code (``algorithm.draft``, ``TargetSide.verify``), alignment runs here. What
this adds is moving data between processes and pipelining.

Pipelining: while the target verifies chunk i, the drafter already drafts chunk i+1 from the committed
text plus chunk i's candidates, i.e. assuming chunk i is accepted. Its first token is then a guess of the
target's next token (the bonus token after a fully accepted chunk), so it drafts one token more than the
step needs. Hit: chunk i was fully accepted and the guess equals the bonus token; the speculative draft,
without its first token, is the next draft. Miss: it is dropped and the next step drafts afresh
(``DrafterSide.sync`` keeps only what agrees with the committed text). Any draft is verified by the
target, so pipelining changes speed, never what is output: greedy and exact-match (SLEM) output is token
for token the non-pipelined output; with rejection sampling (SD, TLI, SLRS) at temperature > 0 the
drafts differ, so the output is an equally distributed sample, not the same one.
"""

from __future__ import annotations

import asyncio
import copy
import time
from contextlib import contextmanager
from enum import Enum
from dataclasses import dataclass, replace
from typing import AsyncIterator, Awaitable, Callable, Iterator

from hetspec.algorithms import Algorithm, Draft
from hetspec.align import ends_at_character
from hetspec.decoder import Progress
from hetspec.output import Stats, StreamEvent

from deployments.errors import UnknownSession, WorkerLost
from deployments.serving.load_adaptive import ReplicaLoadAdaptive
from deployments.workers.api import DraftItem, Drafted, VerifyItem, VerifyResult, WorkerClient


@dataclass
class PipelineStats(Stats):
    pipelined: bool = False
    pipeline_hits: int = 0  # speculative drafts used
    pipeline_misses: int = 0  # speculative drafts dropped
    drafter_lost: bool = False  # the drafter died (or was being replaced): the target decoded alone from then on


@dataclass
class Step:
    """One decoding step, for metrics."""

    drafted: int
    accepted: int
    drafter_seconds: float
    target_seconds: float
    alignment_seconds: float
    speculation: str | None  # "hit", "miss" or None when no speculative draft was waiting
    source: str = "drafter"  # the draft's: "drafter" or "lookup" (hetspec/lookup.py)


class _Speculation:
    """A draft started from ``assumed_candidates`` fully accepted, while the target verified them."""

    def __init__(self, pending: Awaitable, assumed_candidates: list[int], table: list[bytes | None]):
        self.pending = pending
        self.assumed_candidates = assumed_candidates
        self.table = table

    async def usable(self, new_ids: list[int]) -> tuple[Drafted, Draft | None]:
        """(the speculative draft, the part of it that continues ``new_ids`` or None on a miss)."""
        spent: Drafted = await self.pending
        draft = spent.draft
        bonus = new_ids[-1]
        if new_ids[:-1] != self.assumed_candidates:
            return spent, None
        if draft.candidates:  # a draft of target ids (TLI, SLRS, SD): its first id guessed the bonus token
            if draft.candidates[0] != bonus or len(draft.candidates) == 1:
                return spent, None
            return spent, Draft(candidates=draft.candidates[1:], draft_probs=draft.draft_probs,
                                first_row=draft.first_row + 1)
        bonus_bytes = self.table[bonus] or b""  # a text draft (SLEM): its text must start with the bonus token's
        if draft.texts:  # a tree: the branches that guessed the bonus token
            rest = [text[len(bonus_bytes):] for text in draft.texts
                    if text.startswith(bonus_bytes) and len(text) > len(bonus_bytes)]
            return spent, Draft(texts=rest) if rest else None
        if not draft.text.startswith(bonus_bytes) or len(draft.text) == len(bonus_bytes):
            return spent, None
        return spent, Draft(text=draft.text[len(bonus_bytes):])


class Phase(Enum):
    """Which batched worker call a step's item goes in."""

    DRAFT = "draft"
    VERIFY = "verify"


class StepBatches:
    """The draft and verify calls of a replica's decoding requests, gathered into one call per worker and step.

    A worker runs the items of one call in shared passes (deployments/workers/model_workers.py), so requests that step
    together cost one pass per round: the coordinator keeps them in step, as the library's ``BatchDecoder``
    does in process. Each member (a decoding request) is at any moment free (its own work, its client),
    pending (its call waits here) or in flight (in a call sent). A worker's pending calls leave together once
    no member is in flight and none is free, i.e. nobody else is about to call; a member free for longer
    than ``max_wait_s`` (a slow client) is not waited for. One request alone is never held back.

    ``one_model_at_a_time`` (``PipelineConfig``): where drafter and target share a node's cores and run in step
    (not pipelined), the workers give each call every thread (deployments/workers/model_workers.py), so a draft call
    beside a verify call oversubscribes the cores. Two requests that reached different phases (one drafting while the
    other's target prefill ran) send their draft and verify calls together at every step and stay out of
    phase: a batch of ~1 per pass, and drafter passes of 0.26-0.43 s against 0.035 s in step, at 2-4 clients
    (docs/decisions/served-in-step.md). With it, the pending calls of one worker
    leave and the others wait; the members they free call again and join them, so the phases merge. A prompt
    goes a chunk per target call (``DecodeLoop``), so it too waits for the draft calls in flight.

    Why not Ray Serve's ``@serve.batch``: it waits a fixed time for a fixed count, while here the count is
    known exactly (who is drafting, who is verifying), and it needs a replica context (tests run this in
    process).
    """

    FREE, PENDING, IN_FLIGHT = "free", "pending", "in flight"

    def __init__(self, max_wait_s: float,
                 on_batch: Callable[[Phase, list, list], None] = lambda phase, items, outcomes: None,
                 one_model_at_a_time: bool = False) -> None:
        self.max_wait_s = max_wait_s
        self.one_model_at_a_time = one_model_at_a_time
        self.on_batch = on_batch  # (phase, items, outcomes) of every batched call that came back
        self.states: dict[int, str] = {}  # by member id
        self._pending: dict[tuple[int, Phase], list] = {}  # (worker, phase) -> [(member, item, future, worker)]
        self._first_pending: dict[tuple[int, Phase], float] = {}
        self._sends = 0  # calls sent so far
        self._last_sent: dict[tuple[int, Phase], int] = {}  # (worker, phase) -> the count at its last call sent
        self._timer: asyncio.TimerHandle | None = None

    def join(self, member: object) -> None:
        self.states[id(member)] = self.FREE

    @contextmanager
    def in_flight(self, member: object) -> Iterator[None]:
        """The member waits on a call of its own outside these batches (a speculative draft)."""
        self.states[id(member)] = self.IN_FLIGHT
        try:
            yield
        finally:
            if id(member) in self.states:
                self.states[id(member)] = self.FREE
            self._returned()

    def leave(self, member: object) -> None:
        self.states.pop(id(member), None)
        self._send_ready()

    async def call(self, member: object, worker: WorkerClient, phase: Phase, item: DraftItem | VerifyItem):
        """``worker.draft([..., item, ...])`` or ``worker.verify(...)``'s outcome for ``item``, sent with the other
        members' items."""
        key = (worker.identity, phase)  # pinned copies of one actor share a batch
        result = asyncio.get_running_loop().create_future()
        entry = (id(member), item, result, worker)
        self._pending.setdefault(key, []).append(entry)
        self._first_pending.setdefault(key, time.monotonic())
        self.states[id(member)] = self.PENDING
        self._send_ready()
        try:
            return await result
        finally:
            if entry in self._pending.get(key, []):  # cancelled before it was sent
                self._pending[key].remove(entry)
            if id(member) in self.states:
                self.states[id(member)] = self.FREE

    def _send_ready(self) -> None:
        states = self.states.values()
        if not self._pending or self.IN_FLIGHT in states:
            return  # a call in flight returns soon and its members call again: wait for them
        now = time.monotonic()
        waiting_for_free = self.FREE in states
        # With one model at a time, the worker whose call went the longest ago first, then the most waiting: the
        # fewer follow once the first call is back. By the count alone, a request drafting beside three decoding
        # plain waited for the drafter until they had all finished, as they called the target again before every
        # turn came round (a 22.7 s stall: docs/decisions/served-in-step.md).
        for key in sorted(self._pending, key=lambda key: (self._last_sent.get(key, -1), -len(self._pending[key]))):
            if not self._pending[key]:
                del self._pending[key]
                self._first_pending.pop(key, None)
            elif not waiting_for_free or now - self._first_pending[key] >= self.max_wait_s:
                self._send(key)
                if self.one_model_at_a_time:
                    break
        if self._pending and self._timer is None:  # look again when the oldest has waited max_wait_s
            oldest = min(self._first_pending.values())
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, oldest + self.max_wait_s - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._send_ready()

    def _send(self, key: tuple[int, Phase]) -> None:
        entries = self._pending.pop(key)
        self._first_pending.pop(key, None)
        self._sends += 1
        self._last_sent[key] = self._sends
        for member, _, _, _ in entries:
            self.states[member] = self.IN_FLIGHT
        worker: WorkerClient = entries[0][3]
        items = [item for _, item, _, _ in entries]
        try:
            sent = worker.draft(items) if key[1] is Phase.DRAFT else worker.verify(items)
        except Exception as error:  # e.g. WorkerLost: the worker is being replaced
            sent = asyncio.get_running_loop().create_future()
            sent.set_exception(error)
        asyncio.ensure_future(sent).add_done_callback(lambda done: self._distribute(key[1], entries, done))

    def _returned(self) -> None:
        """A member's call came back: the members it frees get ``max_wait_s`` from now to call again."""
        now = time.monotonic()
        for key in self._first_pending:
            self._first_pending[key] = now
        self._send_ready()

    def _distribute(self, phase: Phase, entries: list, done: asyncio.Future) -> None:
        error = RuntimeError("the batched call was cancelled") if done.cancelled() else done.exception()
        outcomes = [error] * len(entries) if error is not None else done.result()
        if error is None:
            self.on_batch(phase, [item for _, item, _, _ in entries], outcomes)
        for (member, _, result, _), outcome in zip(entries, outcomes):
            if member in self.states:
                self.states[member] = self.FREE
            if not result.done():
                if isinstance(outcome, BaseException):
                    result.set_exception(outcome)
                else:
                    result.set_result(outcome)
        self._returned()


class DecodeLoop:
    """One request's decoding across a drafter and a target worker whose sessions are already open.

    If the drafter is lost mid-request (``WorkerLost``), decoding goes on with the target alone: a step
    with no candidates verifies nothing and commits the target's own next token, which is what the target
    alone would output (token for token in greedy and seeded exact-match decoding), so nothing is lost.
    """

    def __init__(self, request_id: str, algorithm: Algorithm, progress: Progress, target_ids: list[int],
                 target: WorkerClient, drafter: WorkerClient | None, pipelined: bool, batches: StepBatches,
                 on_step: Callable[[Step], None] = lambda step: None,
                 on_drafter_lost: Callable[[], None] = lambda: None, load_adaptive: ReplicaLoadAdaptive | None = None,
                 prefill_target: bool = False):
        self.batches = batches
        # the target session was opened without its prompt: a chunk per target call, in step with the others' calls
        self.prefill_target = prefill_target
        self.load_adaptive = load_adaptive  # the replica's choice of draft length at its load (None: the request's own)
        self.request_id = request_id
        self.algorithm = algorithm
        self.progress = progress
        self.output = progress.output
        self.stats: PipelineStats = progress.stats
        self.target_ids = target_ids  # the committed target ids, prompt included (TargetSide.ids' twin)
        self.target = target
        self.drafter = drafter
        self.pipelined = pipelined and drafter is not None
        self.stats.pipelined = self.pipelined
        self.on_step = on_step
        self.on_drafter_lost = on_drafter_lost

    async def run(self) -> AsyncIterator[StreamEvent]:
        self.batches.join(self)
        try:
            # Each chunk goes with the others' verify calls (one target pass feeds them and the chunk), as a joining
            # prompt does in process (hetspec/step.py's BatchDecoder); prefilled at open, it ran beside draft
            # calls. The draft length policy counts it as a row meanwhile, and as drafting once it steps.
            if self.load_adaptive is not None:
                self.load_adaptive.arrive(self.progress)
            while self.prefill_target and (await self.batches.call(self, self.target, Phase.VERIFY,
                                                                   VerifyItem(self.request_id, None))).prompt_left:
                pass
            if self.load_adaptive is not None:
                self.load_adaptive.join(self.progress, lambda: self.progress.draft_length(self.drafter is not None))
            async for event in self._steps():
                yield event
        finally:
            self.batches.leave(self)
            if self.load_adaptive is not None:
                self.load_adaptive.leave(self.progress)

    async def _steps(self) -> AsyncIterator[StreamEvent]:
        speculation: _Speculation | None = None
        new_ids: list[int] = []
        while True:
            remaining = self.progress.params.max_new_tokens - self.progress.position
            committed = self.progress.committed
            cap = self.load_adaptive.cap(self.progress) if self.load_adaptive is not None else None
            k = self.progress.draft_length(self.drafter is not None, cap)
            drafts = k > 0
            message, drafter_seconds, outcome = None, 0.0, None
            if speculation is not None:
                with self.batches.in_flight(self):  # the others' calls wait for this one's, as for a call sent
                    usable = await self._from_drafter(speculation.usable(new_ids))
                if usable is not None:
                    spent, message = usable
                    self._count_draft(spent)
                    drafter_seconds += spent.seconds
                    message = message if drafts else None
                    outcome = "hit" if message is not None else "miss"
            drafts = drafts and self.drafter is not None  # a lost drafter drafts no more
            if message is None:  # the library's choice between the context lookup and the drafter (no model)
                message = self.progress.lookup_draft(self.target_ids, self.drafter is not None)
            if drafts and message is None:
                drafted = await self._from_drafter(self._draft(committed, k, self.progress.position))
                if drafted is not None:
                    self._count_draft(drafted)
                    drafter_seconds += drafted.seconds
                    message = drafted.draft
            message = message or Draft()  # no draft: the target commits its own next token
            tick = time.perf_counter()
            message = self._align(message)
            alignment_seconds = time.perf_counter() - tick
            verifying = asyncio.ensure_future(self.batches.call(self, self.target, Phase.VERIFY,
                                                                VerifyItem(self.request_id, message)))
            # a tree's accepted branch is not known ahead of verification: nothing to assume, no speculation
            speculating = self.pipelined and message.tree is None
            speculation = self._speculate(committed, message.candidates, remaining, cap) if speculating else None
            result: VerifyResult = await verifying
            new_ids = result.new_ids
            event = self._account(message, result, drafter_seconds, alignment_seconds, outcome)
            self.target_ids.extend(new_ids)
            yield event
            if event.finish_reason:
                return

    async def _from_drafter(self, call: Awaitable):
        """The drafter call's result, or None once the drafter is lost, or its session of this request is gone
        (swept after ``session_idle_timeout_s`` while the request drafted nothing): the request goes on
        target-only."""
        try:
            return await call
        except (WorkerLost, UnknownSession) as error:
            if isinstance(error, WorkerLost) and error.role != "drafter":
                raise
            if self.drafter is not None:
                self.drafter, self.pipelined = None, False
                self.stats.drafter_lost = True
                self.on_drafter_lost()
            return None

    def _align(self, draft: Draft) -> Draft:
        """String-level alignment (SLEM re-tokenizes the drafted text); other algorithms pass ids through."""
        if not draft.text and not draft.texts:
            return draft
        return self.algorithm.align(replace(draft, text=draft.text, texts=list(draft.texts)), self.target_ids)

    def _speculate(self, committed: bytes, candidates: list[int], remaining: int,
                   cap: int | None) -> _Speculation | None:
        """Start drafting the next chunk as if all ``candidates`` are accepted (the step's k plus a bonus guess).
        ``cap``: the replica's draft length cap this step (None: none); at a cap of 0 nothing is drafted ahead,
        since the next step would discard the draft and the drafter's pass costs the target's cores."""
        table = self.output.table
        assumed = committed + b"".join(table[token] or b"" for token in candidates)
        policy = copy.copy(self.progress.policy)
        policy.update(len(candidates), len(candidates))
        next_k = min(policy.k, remaining - len(candidates) - 1 - 1, policy.k if cap is None else cap)
        if next_k <= 0 or not ends_at_character(assumed):
            return None
        first_position = self.progress.position + len(candidates)  # the bonus token's position
        return _Speculation(self._draft(assumed, next_k + 1, first_position, speculative=True), list(candidates),
                            table)

    def _draft(self, committed: bytes, k: int, first_position: int, speculative: bool = False) -> Awaitable:
        """A drafter call with the next draft round: a missed speculative draft's tokens can stay in the drafter's
        context (``DrafterContext.sync``), so the draft that replaces it must not reuse its random numbers.
        A speculative draft goes at once, alone (this request is verifying: it is not in the draft step)."""
        item = DraftItem(self.request_id, committed, k, first_position, self.progress.next_round())
        if speculative:  # a batch call: a cancelled request must not cancel a drafter call holding its session
            return _first(self.drafter.draft([item]))
        return self.batches.call(self, self.drafter, Phase.DRAFT, item)

    def _count_draft(self, drafted: Drafted) -> None:
        self.stats.drafter_forwards += drafted.draft.drafter_forwards
        self.stats.drafter_seconds += drafted.seconds

    def _account(self, message: Draft, result: VerifyResult, drafter_seconds: float,
                 alignment_seconds: float, outcome: str | None) -> StreamEvent:
        accepted = len(result.new_ids) - 1
        drafted = message.proposed_len
        self.stats.alignment_seconds += alignment_seconds
        self.stats.target_seconds += result.seconds
        self.stats.pipeline_hits += outcome == "hit"
        self.stats.pipeline_misses += outcome == "miss"
        self.stats.batch_rows += result.rows
        self.stats.chosen_draft_tokens += drafted
        event = self.progress.commit(drafted, result.new_ids, result.logprobs, message.source)
        self.on_step(Step(drafted, accepted, drafter_seconds, result.seconds, alignment_seconds,
                          outcome, message.source))
        return event


async def _first(call: Awaitable):
    """The only outcome of a one-item batch call (raised if it is an exception)."""
    [outcome] = await call
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome
