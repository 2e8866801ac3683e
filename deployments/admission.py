"""Admission control of one replica: a bounded number of running requests and a bounded waiting line.

At most ``max_running`` requests decode at once (each holds a KV session in the drafter and the target);
up to ``max_waiting`` more wait, first come first served; any further request is turned away at once
with ``Overloaded`` (HTTP 429 / gRPC RESOURCE_EXHAUSTED, with a Retry-After hint), so a burst never
piles up unbounded work or opens sessions the actors cannot hold. A request waits no longer than its
deadline (``RequestTimeout``). Single-threaded: everything runs on the replica's event loop.

    ticket = admission.admit()       # synchronous: a running slot, a place in line, or Overloaded
    await ticket.wait(deadline)      # until the slot is ours (RequestTimeout past the deadline)
    ...                              # run the request
    ticket.release_after(closes)     # once the request's sessions are closed, the slot goes to the next
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Awaitable, Iterable

# Longest a slot waits for its request's session closes before it is handed on anyway (a dead actor's
# close never answers; the actor's idle sweep frees what is left).
CLOSE_WAIT_S = 30.0


class Overloaded(RuntimeError):
    """The server is full (running and waiting requests, or an actor's sessions); the client may retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # it crosses process boundaries (replica -> gRPC proxy) pickled
        return Overloaded, (str(self), self.retry_after_s)


class RequestTimeout(TimeoutError):
    """The request ran (or waited) past its deadline; its work was stopped and its sessions freed."""

    def __reduce__(self):
        return RequestTimeout, (str(self),)


class Ticket:
    """One request's claim: holds a running slot once ``wait`` returns, until ``release``."""

    def __init__(self, admission: "Admission", turn: asyncio.Future | None):
        self._admission = admission
        self._turn = turn  # None: admitted at once; else resolved when a slot is handed over
        self._released = False

    @property
    def holds_slot(self) -> bool:
        return not self._released and (self._turn is None or (self._turn.done() and not self._turn.cancelled()))

    async def wait(self, deadline: float | None = None) -> None:
        """Until this request may run; ``deadline`` is a ``time.monotonic()`` value (None: no limit)."""
        if self._turn is None or self._turn.done():
            return
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            # shield: a timeout or a cancellation must not cancel the turn itself while release() decides
            await asyncio.wait_for(asyncio.shield(self._turn), timeout)
        except TimeoutError:
            self.release()
            raise RequestTimeout("the request waited past its deadline for a free slot "
                                 "(limits.request_timeout_s)") from None
        except asyncio.CancelledError:
            self.release()
            raise

    def release_after(self, closing: Iterable[Awaitable]) -> None:
        """Release once ``closing`` (the request's session closes) are done: a slot handed on before the
        actors freed the sessions would let them hold more sessions than running requests for a moment."""
        closing = list(closing)
        if not closing or not self.holds_slot:
            self.release()
            return

        async def release_when_closed() -> None:
            try:
                await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), CLOSE_WAIT_S)
            except TimeoutError:
                pass
            finally:
                self.release()

        # a task of its own: the request's task may be being cancelled, this must still run
        task = asyncio.get_running_loop().create_task(release_when_closed())
        self._admission._releasing.add(task)  # held, so the task is not garbage-collected midway
        task.add_done_callback(self._admission._releasing.discard)

    def release(self) -> None:
        if self._released:
            return
        held = self.holds_slot
        self._released = True
        if held:
            self._admission._hand_over()
        else:  # still in line: leave it (a turn handed over meanwhile is passed on by holds_slot above)
            self._turn.cancel()
            self._admission._leave_line(self._turn)


class Admission:
    def __init__(self, max_running: int, max_waiting: int, retry_after_s: float):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.running = 0  # slots held (tickets admitted, or handed a slot and not yet released)
        self.rejected = 0  # requests turned away since start
        self._line: deque[asyncio.Future] = deque()
        self._releasing: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def admit(self) -> Ticket:
        """A ticket, or ``Overloaded`` when every running slot and every place in line is taken."""
        if self.running < self.max_running and not self._line:
            self.running += 1
            return Ticket(self, None)
        if len(self._line) >= self.max_waiting:
            self.rejected += 1
            raise Overloaded(f"server busy: {self.running} requests running (limits.max_running_requests) and "
                             f"{len(self._line)} waiting (limits.max_waiting_requests)", self.retry_after_s)
        turn = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        return Ticket(self, turn)

    def _hand_over(self) -> None:
        """A slot was freed: the first in line gets it (running stays the same), else it is free."""
        while self._line:
            turn = self._line.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1

    def _leave_line(self, turn: asyncio.Future) -> None:
        try:
            self._line.remove(turn)
        except ValueError:  # already handed over and popped
            pass
