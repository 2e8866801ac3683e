"""The library's load-adaptive draft length (``hetspec.adaptive.LoadAdaptive``) for one replica's requests.

In process, one ``BatchDecoder`` step chooses the draft length of every request of the step at once and is timed
whole. A replica's requests run their steps on their own tasks, kept in step by ``StepBatches``
(deployments/serving/pipeline.py), so here the steps are counted in rounds: a request asking again starts a new round,
whose cap is chosen over the replica's running requests as they stand then, and every request asking within the
round gets that cap (the policy's probes and its exploring steps then count steps, as in process, not requests).
A round is measured as a step is: its seconds run from its start to the next round's (both models' calls and the
coordinator's turn between them), its tokens are what its requests committed in the steps they took at its cap
(each reports them when it asks again, or leaves). The policy is the library's, unchanged. A round's seconds are
left out of the measure, as a step's feeding a prompt are in process, when a request joined in it or one of its
calls fed a prompt's chunk (a target prompt sent a chunk per verify call, a drafter catching a context up): they
priced that. Its tokens still count: they are what its requests accepted.
A catch-up is what switching from plain decoding to drafting costs once, not what a drafting step costs: priced in
(f945bf3, reverted), every exploring draft after a stretch of plain decoding carries one, so drafting is
measured dearer the longer it was not chosen.
It changes which tokens are drafted, never which are output.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from hetspec.adaptive import LoadAdaptive

from deployments.workers.api import Drafted, VerifyResult


class _Round:
    def __init__(self, cap: int | None, started: float) -> None:
        self.cap = cap
        self.started = started
        self.seconds: float | None = None  # set when the next round starts
        self.asked: dict[Any, int] = {}  # a request -> its position when it asked, until it reports its tokens
        self.committed: dict[Any, int] = {}  # a request that asked -> the tokens it committed, as it reports
        self.priced = cap is not None

    def report(self, progress: Any) -> None:
        """``progress`` took its step of this round: its committed tokens count, once."""
        position = self.asked.pop(progress, None)
        if position is not None:
            self.committed[progress] = progress.position - position


class ReplicaLoadAdaptive:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.policy = LoadAdaptive()
        self.clock = clock
        # a request's Progress -> its own draft length now (None: its prompt is being fed)
        self.running: dict[Any, Callable[[], int | None]] = {}
        self.round: _Round | None = None  # the round now
        self.last: _Round | None = None  # the one before, until its requests have reported their tokens

    def arrive(self, progress: Any) -> None:
        """``progress``'s prompt is being fed: a row of the replica's load, not drafting until it joins. Counted
        in the rows the cap is chosen at, so at a wave's start the first requests to step do not choose drafting at
        their own few rows while the others' prompts wait their turn (at 8 clients one such round took ~1.1 s
        against a plain round's 0.44: docs/decisions/load-adaptive-draft-length.md). In process,
        ``BatchDecoder`` counts its joining requests the same way."""
        self.running[progress] = lambda: None

    def join(self, progress: Any, own_length: Callable[[], int]) -> None:
        self.running[progress] = own_length
        if self.round is not None:  # the round's rows changed under it
            self.round.priced = False

    def leave(self, progress: Any) -> None:
        self.running.pop(progress, None)
        for step_round in (self.last, self.round):
            if step_round is not None:
                step_round.report(progress)
        self._record_last()
        if not self.running:
            self.round = None

    def cap(self, progress: Any) -> int | None:
        """The cap on ``progress``'s draft length this step (None: its own): this round's, or a new round's."""
        if self.round is None or progress in self.round.asked:
            now = self.clock()
            if self.round is not None:
                self.round.seconds = now - self.round.started
            self.last = self.round  # a round before it still waiting for a request's tokens is left out
            self.round = _Round(self.policy.choose(
                {request: own_length() for request, own_length in self.running.items()}), now)
        if self.last is not None:
            self.last.report(progress)
            self._record_last()
        self.round.asked[progress] = progress.position
        return self.round.cap

    def _record_last(self) -> None:
        last = self.last
        if last is None or last.seconds is None or last.asked:
            return
        if last.cap is not None:  # an unmeasured round's tokens still tell its requests' acceptance
            self.policy.record(last.cap, last.committed, last.seconds, last.priced)
        self.last = None

    def drafting(self) -> bool:
        """False while requests run and this round's cap is 0: a request joining now will likely draft nothing
        for a while (the coordinator then leaves its drafter prefill to its first draft)."""
        return not (self.running and self.round is not None and self.round.cap == 0)

    def on_batch(self, phase: Any, items: list, outcomes: list[Any]) -> None:
        """A batched call came back (``StepBatches``): a round whose call fed a prompt's chunk is not measured.
        A verify item without a draft fed a chunk of its prompt (its result has no new ids);
        ``VerifyResult.fed_prompt`` and ``Drafted.fed_prompt`` say a pass of the call fed one."""
        if self.round is not None and any(isinstance(outcome, (VerifyResult, Drafted)) and outcome.fed_prompt
                                          or isinstance(outcome, VerifyResult) and not outcome.new_ids
                                          for outcome in outcomes):
            self.round.priced = False
