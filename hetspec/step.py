"""The decode step over a batch of requests (continuous batching), every algorithm: a scheduler that only
decides, a runner that only executes, and ``BatchDecoder``, the loop that joins them.

A step: the scheduler plans it (``Scheduler.plan``): which joining requests start, which prompt chunks ride along
within ``prefill_chunk_tokens``, and per running request its context-lookup draft or its draft length (the
request's ``DraftLength`` under ``LoadAdaptive``'s cap). The runner executes it (``StepRunner``): the drafter
drafts for every request that drafts in lockstep, one batched pass per draft position
(``hetspec.passes.run_lockstep``), each draft aligned to target ids (string level, per request); one batched
target pass verifies every request's candidates (ragged lengths, chains and trees), a joining request's prompt
chunk riding along (packed: it widens no other row). Each request then commits its accepted tokens and releases
text through its ``OutputText``. Requests join and leave at any step boundary. ``Engine`` runs it in process
(one request is a batch of one) with ``LocalRunner``.

Every request's random numbers are keyed by its own seed and output position (``hetspec.sampling``), and
its verification reads only its own row's logits, so batching changes which requests share a pass, never a
request's rule or its numbers. Batched matrix products may round differently from batch 1; docs/batching.md
says how the tests tell such a numerical tie from an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from hetspec.adaptive import LoadAdaptive
from hetspec.algorithms import Draft
from hetspec.config import BatchingConfig
from hetspec.decoder import Request
from hetspec.kv import Feed
from hetspec.models import LanguageModel
from hetspec.output import StreamEvent
from hetspec.passes import Steps, run_lockstep


@dataclass
class StepPlan:
    """What one step does, decided before any pass (``Scheduler.plan``)."""

    running: list[Request]  # the requests that decode this step
    lookups: list[Draft | None]  # per running request: its context-lookup draft (no drafter pass), or None
    lengths: list[int]  # per running request: the drafter's draft length, 0 for none (a lookup draft, k = 0)
    target_chunks: list[Feed] = field(default_factory=list)  # joining prompts' chunks riding the verify pass
    drafter_chunks: list[Feed] = field(default_factory=list)  # and the draft passes
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
        self.joining: list[Request] = []
        self.running: list[Request] = []

    def __len__(self) -> int:
        return len(self.joining) + len(self.running)

    def add(self, request: Request) -> None:
        if len(self) >= self.batching.max_batch_size:
            raise RuntimeError(f"the batch is full ({self.batching.max_batch_size} requests)")
        self.joining.append(request)

    def remove(self, request: Request) -> None:
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
        lookups = [request.lookup_draft(request.target.ids, request.drafter is not None) for request in running]
        # a request with a lookup draft asks nothing of the drafter this step
        lengths = [0 if lookup else request.draft_length(request.drafter is not None, cap)
                   for request, lookup in zip(running, lookups)]
        return StepPlan(running, lookups, lengths, target_chunks, drafter_chunks, cap, priced, started)

    def record(self, plan: StepPlan, committed: Sequence[list[int]]) -> None:
        """The step is done: the load-adaptive policy learns its tokens and seconds."""
        if plan.cap is not None:
            self.adaptive.record(plan.cap, {request: len(new_ids) for request, new_ids in zip(plan.running, committed)},
                                 time.perf_counter() - plan.started, plan.priced)

    def _prompt_chunks(self) -> tuple[list[Feed], list[Feed]]:
        """(target, drafter) feeds of the joining requests' next prompt chunks, within ``prefill_chunk_tokens``
        together, so a long prompt does not stall the others' decoding; the requests whose prompts are then in
        their caches decode from the next step on."""
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


class StepRunner(Protocol):
    """Executes a plan's passes: one batched draft (every drafting request at once) and one batched verify."""

    def draft(self, requests: Sequence[Request], lengths: Sequence[int], chunks: Sequence[Feed]) -> list[Draft]:
        """Each request's draft of its length, aligned to target ids; ``chunks``: prompt chunks fed alongside."""

    def verify(self, requests: Sequence[Request], drafts: Sequence[Draft], chunks: Sequence[Feed]) -> list[list[int]]:
        """Each request's committed ids (accepted candidates, then the target's own next token)."""

    def close(self, request: Request) -> None:
        """Free the request's KV sessions (at once: its rows go to the next request)."""


class LocalRunner:
    """The models in this process: a request's KV rows are taken at its first pass and freed at ``close``."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None) -> None:
        self.target = target
        self.drafter = drafter

    def draft(self, requests: Sequence[Request], lengths: Sequence[int], chunks: Sequence[Feed]) -> list[Draft]:
        return run_lockstep(self.drafter, [request.draft(k) for request, k in zip(requests, lengths)]
                            + [_fed(feed) for feed in chunks])[:len(requests)]

    def verify(self, requests: Sequence[Request], drafts: Sequence[Draft], chunks: Sequence[Feed]) -> list[list[int]]:
        # the joining prompts' chunks ride the verification pass, packed (hetspec/layouts.py): they widen no row
        return run_lockstep(self.target, [request.verify(draft) for request, draft in zip(requests, drafts)]
                            + [_fed(feed) for feed in chunks])[:len(requests)]

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
        plan = self.scheduler.plan()
        if plan is None:
            return []
        running, drafting = plan.running, plan.drafting
        drafts = [lookup or Draft() for lookup in plan.lookups]
        tick = time.perf_counter()
        if drafting or plan.drafter_chunks:
            made = self.runner.draft([running[index] for index in drafting],
                                     [plan.lengths[index] for index in drafting], plan.drafter_chunks)
            for index, draft in zip(drafting, made):
                drafts[index] = draft
        drafter_seconds = time.perf_counter() - tick
        tick = time.perf_counter()
        committed = self.runner.verify(running, drafts, plan.target_chunks)
        target_seconds = time.perf_counter() - tick
        events = []
        for index, (request, draft, new_ids) in enumerate(zip(running, drafts, committed)):
            request.stats.drafter_seconds += drafter_seconds if index in drafting else 0.0
            request.stats.target_seconds += target_seconds
            request.stats.batch_rows += len(running)
            request.stats.chosen_draft_tokens += draft.proposed_len if draft.point_mass else plan.lengths[index]
            event = request.commit(draft.proposed_len, new_ids, request.target.step_logprobs, draft.source)
            if event.token_ids or event.text or event.finish_reason:
                events.append((request, event))
            if request.finished:
                self.cancel(request)
        self.scheduler.record(plan, committed)
        return events


def _fed(feed: Feed) -> Steps:
    """A computation of one pass: the feed (a prompt's chunk, its logits unused)."""
    yield feed
