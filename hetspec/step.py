"""The decode step over a batch of requests (continuous batching), every algorithm, in process and served: a
scheduler that only decides, a runner that only executes, and the step that joins them (``run_step``).

A step: the scheduler plans it (``Scheduler.plan``): which joining requests start, which prompt chunks ride along
within ``prefill_chunk_tokens``, and per running request its ready draft (one made ahead that the last step hit,
hetspec/ahead.py, or a context-lookup draft, hetspec/lookup.py) or its draft length (the request's ``DraftLength``
under ``LoadAdaptive``'s cap). The runner executes it: one batched drafter call drafts for every request that
drafts (in process one batched pass per draft position, ``hetspec.passes.run_lockstep``), each draft is aligned to
target ids (string level, per request), one batched target call verifies every request's candidates (ragged
lengths, chains and trees), a joining request's prompt chunk riding along (packed: it widens no other row), and
beside it the drafter drafts the next step ahead for the requests that pipeline. Each request then commits its
accepted tokens and releases text through its ``OutputText``. Requests join and leave at step boundaries.

``run_step`` is written once, as a generator of the runner calls it needs: ``BatchDecoder`` drives it with
``LocalRunner`` (the models in this process; ``Engine``), the server's replica loop drives the same generator with
awaited calls to its drafter and target actors (deployments/serving/replica_loop.py).

Every request's random numbers are keyed by its own seed and output position (``hetspec.sampling``), and
its verification reads only its own row's logits, so batching changes which requests share a pass, never a
request's rule or its numbers. Batched matrix products may round differently from batch 1; docs/batching.md
says how the tests tell such a numerical tie from an error.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generator, Protocol, Sequence

from hetspec.adaptive import LoadAdaptive
from hetspec.ahead import Ahead, DraftOrder
from hetspec.algorithms import Draft
from hetspec.align import ends_at_character
from hetspec.config import BatchingConfig
from hetspec.decoder import Request
from hetspec.kv import Feed
from hetspec.models import LanguageModel
from hetspec.output import StreamEvent
from hetspec.passes import Steps, run_lockstep


@dataclass
class StepPlan:
    """What one step does, decided before any pass (``Scheduler.plan``)."""

    running: list[Any]  # the requests that decode this step (hetspec.decoder.Request or the server's)
    ready: list[Draft | None]  # per running request: a draft needing no drafter pass (made ahead, or a lookup)
    lengths: list[int]  # per running request: the drafter's draft length, 0 for none
    ahead_outcomes: list[str | None]  # per running request: "hit" or "miss" of its draft made ahead, None if none
    target_chunks: list[Any] = field(default_factory=list)  # joining prompts' chunks riding the verify call
    drafter_chunks: list[Any] = field(default_factory=list)  # and the draft call (the runner's kind of chunk)
    cap: int | None = None  # the load-adaptive cap on every draft length (None: off)
    priced: bool = False  # the step's seconds price its draft lengths (no prompt was fed): LoadAdaptive records it
    started: float = field(default_factory=time.perf_counter)

    @property
    def drafting(self) -> list[int]:
        """Indices of the running requests the drafter drafts for."""
        return [index for index, k in enumerate(self.lengths) if k > 0]


class Scheduler:
    """Decides each step; holds the joining and running requests. Runs no pass."""

    def __init__(self, batching: BatchingConfig, load_adaptive: bool = False):
        self.batching = batching
        self.adaptive = LoadAdaptive() if load_adaptive else None
        self.joining: list[Any] = []
        self.running: list[Any] = []

    def __len__(self) -> int:
        return len(self.joining) + len(self.running)

    def add(self, request: Any) -> None:
        if len(self) >= self.batching.max_batch_size:
            raise RuntimeError(f"the batch is full ({self.batching.max_batch_size} requests)")
        self.joining.append(request)

    def remove(self, request: Any) -> None:
        for group in (self.joining, self.running):
            if request in group:
                group.remove(request)

    def plan(self) -> StepPlan | None:
        """The next step's plan; None when nobody is left."""
        started = time.perf_counter()
        if not self.running:  # nobody decoding: the joining requests start at once (their first pass feeds the prompt)
            self.running, self.joining = self.joining, []
        if not self.running:
            return None
        target_chunks, drafter_chunks = self._prompt_chunks()
        running = list(self.running)
        # the requests whose prompts are being fed count as rows (None: they run within a few steps): the cap is
        # chosen at the load the batch has (served, the first rows to step drafted at their own few while the
        # others' prompts waited: docs/decisions/load-adaptive-draft-length.md)
        cap = self.adaptive.choose({**dict.fromkeys(self.joining), **{
            request: request.draft_length(request.drafter is not None) for request in running}}) \
            if self.adaptive else None
        # a request that started at once feeds its prompt in its first step's passes: that step prices the prompt,
        # not k (priced, a first step of 1.5 s for "1 token" held a lone request at k = 0 for 20 of its 44 steps)
        priced = cap is not None and not (target_chunks or drafter_chunks) and all(
            request.prefilled for request in running)
        ready, lengths, outcomes = [], [], []
        for request in running:
            k = request.draft_length(request.drafter is not None, cap)
            outcome = None if request.ahead is None else "miss"
            draft = request.take_ahead() if k > 0 else None
            if draft is not None:
                outcome = "hit"
            # a request with a lookup draft asks nothing of the drafter this step
            draft = draft or request.lookup_draft(request.target.ids, request.drafter is not None)
            ready.append(draft)
            lengths.append(0 if draft else k)
            outcomes.append(outcome)
            request.ahead = None
        return StepPlan(running, ready, lengths, outcomes, target_chunks, drafter_chunks, cap, priced, started)

    def record(self, plan: StepPlan, committed: Sequence[list[int]], priced: bool) -> None:
        """The step is done: the load-adaptive policy learns its tokens and seconds (``priced``: they price k)."""
        if plan.cap is not None:
            self.adaptive.record(plan.cap, {request: len(new_ids) for request, new_ids in zip(plan.running, committed)},
                                 time.perf_counter() - plan.started, priced)

    def _prompt_chunks(self) -> tuple[list[Any], list[Any]]:
        """(target, drafter) chunks of the joining requests' prompts, within ``prefill_chunk_tokens`` together,
        so a long prompt does not stall the others' decoding; the requests whose prompts are then in their caches
        decode from the next step on."""
        budget = self.batching.prefill_chunk_tokens
        target_chunks, drafter_chunks = [], []
        for request in list(self.joining):
            if request.prefilled:
                self.joining.remove(request)
                self.running.append(request)
                continue
            if budget <= 0:
                continue
            targets, drafters, used = request.prefill_feeds(budget)
            target_chunks += targets
            drafter_chunks += drafters
            budget -= used
        return target_chunks, drafter_chunks


@dataclass
class DraftCall:
    """The drafter's part of a step: every drafting request's order, prompt chunks fed alongside."""

    orders: list[DraftOrder]
    chunks: list[Any]


@dataclass
class VerifyCall:
    """The target's part of a step, and the drafter's drafts ahead (pipelining) to run beside it."""

    requests: list[Any]
    drafts: list[Draft]
    chunks: list[Any]
    ahead: list[DraftOrder]


@dataclass
class Verified:
    committed: list[list[int] | BaseException]  # per request: its committed ids, or what failed it
    ahead: list[Draft | BaseException | None]  # per ahead order: its draft (None: the drafter was lost)
    fed_prompt: bool = False  # a pass fed a prompt the plan did not know of (a served drafter catching up)


@dataclass
class StepOutcome:
    """One request's part of a finished step."""

    request: Any
    event: StreamEvent | None  # None when it failed
    error: BaseException | None = None
    drafted: int = 0
    accepted: int = 0
    source: str = "drafter"
    ahead: str | None = None  # "hit", "miss" or None: its draft made ahead
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    alignment_seconds: float = 0.0


Call = DraftCall | VerifyCall


def run_step(scheduler: Scheduler) -> Generator[Call, Any, list[StepOutcome]]:
    """One step for every request of ``scheduler``: yields the runner calls (a ``DraftCall`` answered by a list per
    order of ``Draft``, None for a lost drafter or an exception; a ``VerifyCall`` answered by ``Verified``) and
    returns each running request's outcome. A request that failed has left the scheduler."""
    plan = scheduler.plan()
    if plan is None:
        return []
    running, drafting = plan.running, plan.drafting
    aligned_before = [request.stats.alignment_seconds for request in running]
    drafts: list[Draft | BaseException] = [draft or Draft() for draft in plan.ready]
    drafter_seconds = 0.0
    if drafting or plan.drafter_chunks:
        tick = time.perf_counter()
        orders = [_order(running[index], plan.lengths[index]) for index in drafting]
        made = yield DraftCall(orders, plan.drafter_chunks)
        for index, draft in zip(drafting, made):
            drafts[index] = draft or Draft()  # no draft (its drafter lost): the target commits its own next token
        drafter_seconds = time.perf_counter() - tick
    drafts = [draft if isinstance(draft, BaseException) else _aligned(request, draft)
              for request, draft in zip(running, drafts)]
    verifying = [index for index, draft in enumerate(drafts) if not isinstance(draft, BaseException)]
    ahead = [order for index in verifying if (order := _ahead_order(running[index], drafts[index], plan.cap))]
    tick = time.perf_counter()
    verified: Verified = yield VerifyCall([running[index] for index in verifying],
                                          [drafts[index] for index in verifying], plan.target_chunks, ahead)
    target_seconds = time.perf_counter() - tick
    committed: list[list[int] | BaseException] = list(drafts)
    for index, new_ids in zip(verifying, verified.committed):
        committed[index] = new_ids
    for order, draft in zip(ahead, verified.ahead):
        order.request.ahead = Ahead(None if isinstance(draft, BaseException) else draft, order.assumed)
    outcomes = []
    for index, (request, draft, new_ids) in enumerate(zip(running, drafts, committed)):
        if isinstance(new_ids, BaseException):
            scheduler.remove(request)
            outcomes.append(StepOutcome(request, None, new_ids))
            continue
        seconds = drafter_seconds if index in drafting else 0.0
        request.stats.drafter_seconds += seconds
        request.stats.target_seconds += target_seconds
        request.stats.batch_rows += len(verifying)
        request.stats.chosen_draft_tokens += draft.proposed_len if draft.point_mass else plan.lengths[index]
        request.stats.pipeline_hits += plan.ahead_outcomes[index] == "hit"
        request.stats.pipeline_misses += plan.ahead_outcomes[index] == "miss"
        event = request.commit(draft.proposed_len, new_ids, request.target.step_logprobs, draft.source)
        outcomes.append(StepOutcome(request, event, None, draft.proposed_len, len(new_ids) - 1, draft.source,
                                    plan.ahead_outcomes[index], seconds, target_seconds,
                                    request.stats.alignment_seconds - aligned_before[index]))
    scheduler.record(plan, [new_ids if isinstance(new_ids, list) else [] for new_ids in committed],
                     plan.priced and not verified.fed_prompt)
    return outcomes


def _order(request: Any, k: int) -> DraftOrder:
    return DraftOrder(request, k, request.committed, request.position, request.next_round())


def _aligned(request: Any, draft: Draft) -> Draft:
    """String-level alignment (SLEM re-tokenizes the drafted text); other drafts are target ids already."""
    if not draft.text and not draft.texts:
        return draft
    tick = time.perf_counter()
    aligned = request.algorithm.align(draft, request.target.ids)
    request.stats.alignment_seconds += time.perf_counter() - tick
    return aligned


def _ahead_order(request: Any, draft: Draft, cap: int | None) -> DraftOrder | None:
    """The next step's draft to make ahead, assuming all of ``draft``'s candidates accepted (hetspec/ahead.py):
    the next k plus one for the bonus token's guess. None when the request does not pipeline, the draft is a tree
    (its accepted branch is not known ahead), or nothing would be drafted (at a cap of 0 the next step would drop
    it, and the drafter's pass costs the target's cores)."""
    if not request.pipelined or request.drafter is None or draft.tree is not None:
        return None
    table = request.output.table
    assumed = request.committed + b"".join(table[token] or b"" for token in draft.candidates)
    policy = copy.copy(request.policy)
    policy.update(len(draft.candidates), len(draft.candidates))
    remaining = request.params.max_new_tokens - request.position
    next_k = min(policy.k, remaining - len(draft.candidates) - 2, policy.k if cap is None else cap)
    if next_k <= 0 or not ends_at_character(assumed):
        return None
    return DraftOrder(request, next_k + 1, assumed, request.position + len(draft.candidates), request.next_round(),
                      tuple(draft.candidates))


class StepRunner(Protocol):
    """Executes a step's calls."""

    def draft(self, call: DraftCall) -> list[Draft | BaseException | None]:
        """Each order's draft (not aligned: the step aligns it), the chunks fed in the same passes."""

    def verify(self, call: VerifyCall) -> Verified:
        """Each request's committed ids (accepted candidates, then the target's own next token); the drafts ahead."""

    def close(self, request: Any) -> None:
        """Free the request's KV sessions (at once: its rows go to the next request)."""


class LocalRunner:
    """The models in this process: a request's KV rows are taken at its first pass and freed at ``close``. Drafts
    ahead run on a second thread beside the verification pass (the two models then share the cores)."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None) -> None:
        self.target = target
        self.drafter = drafter
        self._beside: ThreadPoolExecutor | None = None

    def draft(self, call: DraftCall) -> list[Draft]:
        return run_lockstep(self.drafter, [order.request.draft(order) for order in call.orders]
                            + [_fed(feed) for feed in call.chunks])[:len(call.orders)]

    def verify(self, call: VerifyCall) -> Verified:
        ahead = None
        if call.ahead:
            self._beside = self._beside or ThreadPoolExecutor(1, thread_name_prefix="hetspec-ahead")
            ahead = self._beside.submit(self.draft, DraftCall(call.ahead, []))
        # the joining prompts' chunks ride the verification pass, packed (hetspec/layouts.py): they widen no row
        verifications = [request.verify(draft) for request, draft in zip(call.requests, call.drafts)]
        committed = run_lockstep(self.target, verifications + [_fed(feed) for feed in call.chunks])[:len(call.requests)]
        return Verified(committed, ahead.result() if ahead is not None else [])

    def close(self, request: Request) -> None:
        request.release()


class BatchDecoder:
    """Runs steps over the requests added to it; a request leaves when it finishes or is cancelled."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None = None,
                 batching: BatchingConfig | None = None, load_adaptive: bool = False,
                 runner: StepRunner | None = None):
        self.batching = batching or BatchingConfig()
        self.scheduler = Scheduler(self.batching, load_adaptive)
        self.runner = runner or LocalRunner(target, drafter)

    @property
    def joining(self) -> list[Request]:
        return self.scheduler.joining

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def adaptive(self) -> LoadAdaptive | None:
        return self.scheduler.adaptive

    def __len__(self) -> int:
        return len(self.scheduler)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def cancel(self, request: Request) -> None:
        """Leave now: the request's rows of both KV caches are freed at once."""
        self.scheduler.remove(request)
        self.runner.close(request)

    def step(self) -> list[tuple[Request, StreamEvent]]:
        """One step for every request; returns the events of the requests that released something or finished."""
        calls, answer = run_step(self.scheduler), None
        try:
            while True:
                call = calls.send(answer)
                answer = self.runner.draft(call) if isinstance(call, DraftCall) else self.runner.verify(call)
        except StopIteration as done:
            outcomes: list[StepOutcome] = done.value
        events = []
        for outcome in outcomes:
            if outcome.error is not None:  # in process a pass raises for the whole step, never for one request
                raise outcome.error
            event = outcome.event
            if event.token_ids or event.text or event.finish_reason:
                events.append((outcome.request, event))
            if outcome.request.finished:
                self.cancel(outcome.request)
        return events


def _fed(feed: Feed) -> Steps:
    """A computation of one pass: the feed (a prompt's chunk, its logits unused)."""
    yield feed
