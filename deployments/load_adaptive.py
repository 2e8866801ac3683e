"""The library's load-adaptive draft length (``hetspec.adaptive.LoadAdaptive``) for one replica's requests.

In process, one ``BatchDecoder`` step chooses the draft length of every request of the step at once. A replica's
requests run their steps on their own tasks, kept in step by ``StepBatches`` (deployments/pipeline.py), so here
the steps are counted in rounds: a request asking again starts a new round, whose cap is chosen over the
replica's running requests as they stand then, and every request asking within the round gets that cap (the
policy's probes and its exploring steps then count steps, as in process, not requests). The policy is
the library's, unchanged. The prices: the target's from its own passes (``VerifyResult.passes``: each pass without a
prompt's chunk, timed around the pass), not from the ``verify_many`` calls, whose time also holds a pass they
shared with a prompt's chunk or waited for; the drafter's likewise from its passes (``Draft.passes``), not from the
``draft_many`` calls, whose time also holds the chunks of a context the drafter catches up.
It changes which tokens are drafted, never which are output.
"""

from __future__ import annotations

from typing import Any, Callable

from hetspec.adaptive import LoadAdaptive

from deployments.workers import VerifyResult


class ReplicaLoadAdaptive:
    def __init__(self) -> None:
        self.policy = LoadAdaptive()
        self.running: dict[Any, Callable[[], int]] = {}  # a request's Progress -> its own draft length now
        self.asked: set[int] = set()  # requests that took this round's cap
        self.round_cap: int | None = None

    def join(self, progress: Any, own_length: Callable[[], int]) -> None:
        self.running[progress] = own_length

    def leave(self, progress: Any) -> None:
        self.running.pop(progress, None)
        self.asked.discard(id(progress))

    def cap(self, progress: Any) -> int | None:
        """The cap on ``progress``'s draft length this step (None: its own): this round's, or a new round's."""
        if not self.asked or id(progress) in self.asked:
            self.asked.clear()
            self.round_cap = self.policy.choose({request: own_length() for request, own_length in self.running.items()})
        self.asked.add(id(progress))
        return self.round_cap

    def drafting(self) -> bool:
        """False while requests run and this round's cap is 0: a request joining now will likely draft nothing
        for a while (the coordinator then leaves its drafter prefill to its first draft)."""
        return not (self.running and self.round_cap == 0)

    def on_batch(self, method: str, items: list[tuple], outcomes: list[Any]) -> None:
        """A batched call came back (``StepBatches``): its items and per item the result or exception."""
        done = [(item, outcome) for item, outcome in zip(items, outcomes) if not isinstance(outcome, BaseException)]
        if not done:
            return
        if method == "verify_many":  # outcomes: VerifyResult (the first with the target's passes since the last
            # call), or a count of prompt tokens for an item that fed a prompt's chunk
            first = next((outcome for _, outcome in done if isinstance(outcome, VerifyResult)), None)
            for rows, tokens, seconds in first.passes if first is not None else ():
                self.policy.record_target(rows, tokens, seconds)
        elif method == "draft_many":  # outcomes: Draft, the first with the drafter's passes since the last call
            for rows, _, seconds in done[0][1].passes:
                self.policy.record_drafter(rows, 1, seconds)
