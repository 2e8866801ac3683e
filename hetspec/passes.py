"""Scheduling model passes: computations (generators of feeds, ``Steps``) advanced together, one batched
pass (``hetspec.forward.forward``) feeding every computation waiting for logits.

``run_lockstep`` runs a known set of computations in lockstep (one process, ``hetspec.decoder``);
``SharedPasses`` shares one model's passes between computations that arrive from many threads (a served model).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import torch

from hetspec.forward import PassModel, forward
from hetspec.kv import Feed


@dataclass
class PassRecord:
    """One batched pass, as ``_Lockstep`` reports it (its ``on_pass``)."""

    rows: int  # feeds
    prompt_chunk: bool  # a feed above LONG_ABOVE_TOKENS (a prompt's chunk) was in it


# A computation that needs model passes: it yields a Feed, gets back that feed's logits, and returns its result.
Steps = Generator[Feed, torch.Tensor, Any]


# A feed longer than this is a prompt's chunk: at most one joins a pass (a token budget per pass).
LONG_ABOVE_TOKENS = 32


class _Lockstep:
    """Computations in lockstep: ``advance`` starts or resumes one, ``run_pass`` feeds every waiting one in
    one batched pass. A computation that raises fails alone; a pass that raises fails the ones it fed."""

    def __init__(self, language_model: PassModel,
                 on_pass: Callable[[PassRecord], None] = lambda record: None) -> None:
        self.language_model = language_model
        self.on_pass = on_pass  # called after each pass
        self.waiting: dict[Any, tuple[Steps, Feed]] = {}  # by key: the computation and the feed it waits on
        self.passes = 0
        self.rows = 0  # feeds over all passes

    def advance(self, key: Any, computation: Steps, logits: torch.Tensor | None,
                done: Callable[[Any, Any, BaseException | None], None]) -> None:
        try:
            self.waiting[key] = (computation, computation.send(logits))
        except StopIteration as finished:
            self.waiting.pop(key, None)
            done(key, finished.value, None)
        except Exception as error:
            self.waiting.pop(key, None)
            done(key, None, error)

    def run_pass(self, done: Callable[[Any, Any, BaseException | None], None]) -> None:
        """Feed the waiting computations in one pass: every short feed and the long feed (a prompt's chunk) of
        the computation that came first; the pass is packed when the widths differ (``forward``), so the chunk
        widens no other row. One long feed a pass, first come first served: the first prompt is done (and its
        request decodes) before the next starts, instead of every prompt finishing in the last round, and
        the others' decoding goes on in every pass."""
        # dict order is arrival order: a computation keeps its place while it waits again
        short = [key for key in self.waiting if len(self.waiting[key][1].token_ids) <= LONG_ABOVE_TOKENS]
        first_long = next((key for key in self.waiting if len(self.waiting[key][1].token_ids) > LONG_ABOVE_TOKENS),
                          None)
        keys = short + ([first_long] if first_long is not None else [])
        feeds = [self.waiting[key][1] for key in keys]
        self.passes += 1
        self.rows += len(keys)
        try:
            all_logits = forward(self.language_model, feeds)
        except Exception as error:
            for key in keys:
                self.waiting.pop(key)[0].close()
                done(key, None, error)
            return
        self.on_pass(PassRecord(len(feeds), first_long is not None))
        for key, logits in zip(keys, all_logits):
            self.advance(key, self.waiting[key][0], logits, done)


def run_lockstep(language_model: PassModel, computations: Sequence[Steps]) -> list[Any]:
    """Run several requests' computations with one batched pass per round: every computation that waits for
    logits is fed in the same pass (a draft of k tokens costs k passes for all requests together)."""
    results: list[Any] = [None] * len(computations)
    errors: list[BaseException] = []

    def done(index: int, result: Any, error: BaseException | None) -> None:
        results[index] = result
        if error is not None:
            errors.append(error)

    lockstep = _Lockstep(language_model)
    for index, computation in enumerate(computations):
        lockstep.advance(index, computation, None, done)
    while lockstep.waiting and not errors:
        lockstep.run_pass(done)
    for computation, _ in lockstep.waiting.values():
        computation.close()
    if errors:
        raise errors[0]
    return results


class SharedPasses:
    """One model's passes shared by computations that arrive from many threads (a served model's calls).

    A computation submitted while a pass runs joins the next pass: each pass feeds every computation waiting
    for logits at that moment, so concurrent requests cost one pass per round, not one each. The thread that
    finds nobody driving drives until nothing waits; ``execute`` runs each round (the worker puts it on its
    model thread); the others wait for their result. A computation that raises fails alone.
    """

    def __init__(self, language_model: PassModel,
                 execute: Callable[..., Any] = lambda work, *args: work(*args),
                 on_pass: Callable[[PassRecord], None] = lambda record: None) -> None:
        self.execute = execute
        self._lockstep = _Lockstep(language_model, on_pass)
        self._guard = threading.Lock()
        self._arrived: list[tuple[Future, Steps]] = []
        self._driving = False

    @property
    def passes(self) -> int:
        """Batched passes run so far."""
        return self._lockstep.passes

    @property
    def rows(self) -> int:
        """Feeds over all passes (rows / passes: the mean batch of a pass)."""
        return self._lockstep.rows

    def run(self, computation: Steps) -> Any:
        """The computation's result, its passes shared with whatever else runs meanwhile."""
        outcome = self.run_many([computation])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def run_many(self, computations: Sequence[Steps]) -> list[Any]:
        """Each computation's result, or the exception it raised; all of them start in the same pass."""
        results = [Future() for _ in computations]
        with self._guard:
            self._arrived.extend(zip(results, computations))
            drive, self._driving = not self._driving, True
        try:
            if drive:
                self._drive()
            wait(results)
        except BaseException:  # interrupted: the computations still use the caller's sessions, so wait for them
            wait(results)
            raise
        return [result.exception() or result.result() for result in results]

    def _drive(self) -> None:
        arrived: list[tuple[Future, Steps]] = []
        try:
            while True:
                with self._guard:
                    arrived, self._arrived = self._arrived, []
                    if not arrived and not self._lockstep.waiting:
                        self._driving = False
                        return
                self.execute(self._round, arrived)
                arrived = []
        except BaseException as error:  # the rounds cannot go on (their thread failed): nobody waits forever
            with self._guard:
                arrived, self._arrived = arrived + self._arrived, []
                self._driving = False
            for result, computation in [*arrived, *((key, waiting[0]) for key, waiting in
                                                    list(self._lockstep.waiting.items()))]:
                computation.close()
                if not result.done():
                    result.set_exception(error)
            self._lockstep.waiting.clear()
            raise

    def _round(self, arrived: list[tuple[Future, Steps]]) -> None:
        for result, computation in arrived:
            self._lockstep.advance(result, computation, None, _settle)
        if self._lockstep.waiting:
            self._lockstep.run_pass(_settle)


def _settle(result: Future, value: Any, error: BaseException | None) -> None:
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(value)


def run_alone(language_model: PassModel, computation: Steps) -> Any:
    """One request's computation, one pass per feed (a batch of one)."""
    return run_lockstep(language_model, [computation])[0]

