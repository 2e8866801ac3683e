"""Admission control of one replica: bounded running requests, a KV memory budget, a bounded waiting line.

At most ``max_running`` requests decode at once (each holds a KV session in the drafter and the target), and with a
``kv_budget`` only as many as their KV caches fit in it: each request counts the bytes its prompt and
max_new_tokens need in both models, and since a model's KV rows are all as wide as its widest (hetspec/kv.py), the
running requests cost their number times the widest one's bytes, not the sum. Up to ``max_waiting`` more wait,
first come first served (the first in line waits for room even if a smaller one behind it would fit: no
starvation); any further request, or one that alone exceeds the budget, is turned away at once with ``Overloaded``
(HTTP 429 / gRPC RESOURCE_EXHAUSTED, with a Retry-After hint), so a burst never piles up unbounded work or opens
sessions the actors cannot hold. A request waits no longer than its deadline (``RequestTimeout``). Single-threaded:
everything runs on the replica's event loop.

    ticket = admission.admit(kv_bytes)  # synchronous: a running slot, a place in line, or Overloaded
    await ticket.wait(deadline)      # until the slot is ours (RequestTimeout past the deadline)
    ...                              # run the request
    ticket.release_after(closes)     # once the request's sessions are closed, the slot goes to the next
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from typing import Awaitable, Callable, Iterable

from deployments.errors import Overloaded, RequestTimeout

# Longest a slot waits for its request's session closes before it is handed on anyway (a dead actor's
# close never answers; the actor's idle sweep frees what is left).
CLOSE_WAIT_S = 30.0


class Ticket:
    """One request's claim: holds a running slot once ``wait`` returns, until ``release``."""

    def __init__(self, admission: "Admission", turn: asyncio.Future | None, kv_bytes: int):
        self._admission = admission
        self._turn = turn  # None: admitted at once; else resolved when a slot is handed over
        self.kv_bytes = kv_bytes
        self._released = False
        self._release_pending = False  # release_after took it: only its close wait releases the slot

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

        admission = self._admission
        admission.closing += 1
        # a caller's own release() from here on (an HTTP stream's response ending) must not hand the slot on
        # before the closes land
        self._release_pending = True

        async def release_when_closed() -> None:
            try:
                await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), CLOSE_WAIT_S)
            except TimeoutError:
                pass
            finally:
                admission.closing -= 1
                self._release_now()

        # a task of its own: the request's task may be being cancelled, this must still run
        task = asyncio.get_running_loop().create_task(release_when_closed())
        self._admission._releasing.add(task)  # held, so the task is not garbage-collected midway
        task.add_done_callback(self._admission._releasing.discard)

    def release(self) -> None:
        """Give the claim back now, unless ``release_after`` already will (then a no-op)."""
        if not self._release_pending:
            self._release_now()

    def _release_now(self) -> None:
        if self._released:
            return
        held = self.holds_slot
        self._released = True
        if held:
            self._admission._free(self)
        else:  # still in line: leave it (a turn handed over meanwhile is passed on by holds_slot above)
            self._turn.cancel()
            self._admission._leave_line(self)


def _check_limits(max_running: int, max_waiting: int) -> None:
    if max_running < 1 or max_waiting < 0:
        raise ValueError("max_running must be >= 1 and max_waiting >= 0")


class Admission:
    def __init__(self, max_running: int, max_waiting: int, retry_after_s: float, kv_budget: int | None = None,
                 on_change: Callable[[], None] = lambda: None):
        """``on_change``: called whenever the running or waiting requests change (the metrics gauges)."""
        _check_limits(max_running, max_waiting)
        self.on_change = on_change
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.kv_budget = kv_budget
        self.running = 0  # slots held (tickets admitted, or handed a slot and not yet released)
        self._widths: Counter[int] = Counter()  # the running requests' KV bytes, each alone
        self.rejected = 0  # requests turned away since start
        # Slots of requests that have ended but whose sessions are still closing. Serve's router counts such a
        # request gone already and may send the next one (max_ongoing_requests = running + waiting): the line
        # takes one more per closing slot, so what Serve sends is never turned away for it.
        self.closing = 0
        self._line: deque[Ticket] = deque()
        self._releasing: set[asyncio.Task] = set()

    @property
    def waiting(self) -> int:
        return len(self._line)

    @property
    def kv_bytes(self) -> int:
        """The KV memory the running requests may make the actors reserve: their number times the widest one's
        bytes (every row of a model's pool is as wide as its widest, hetspec/kv.py)."""
        return self._cost(0, 0)

    def _cost(self, more: int, kv_bytes: int) -> int:
        """The running requests' KV bytes with ``more`` more of ``kv_bytes`` each: all as wide as the widest."""
        return (self.running + more) * max(max(self._widths, default=0), kv_bytes)

    def _start(self, kv_bytes: int) -> None:
        self.running += 1
        self._widths[kv_bytes] += 1

    async def closes_done(self) -> None:
        """Until every finished request's session closes have answered (or timed out) and its slot is free.

        An event loop that ends first cancels the waits, and a close still queued for a worker thread with
        them (tests driving a coordinator under ``asyncio.run`` await this before they return)."""
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    def resize(self, max_running: int, max_waiting: int, retry_after_s: float, kv_budget: int | None) -> None:
        """New limits, for the requests admitted from now on (Serve's reconfigure). Nobody is turned out:
        running requests keep their slots above a lowered cap, and a line longer than a lowered
        ``max_waiting`` only stops taking newcomers; raised limits let the first in line in at once."""
        _check_limits(max_running, max_waiting)
        self.max_running, self.max_waiting = max_running, max_waiting
        self.retry_after_s, self.kv_budget = retry_after_s, kv_budget
        self._hand_room()
        self.on_change()

    def _fits(self, kv_bytes: int) -> bool:
        if self.running >= self.max_running:
            return False
        # Alone, a request always fits: admit() turns away any above the budget, so one in line that is was
        # admitted before the budget was lowered (resize), and it must not wait forever at the head of the line.
        return self.kv_budget is None or self.running == 0 or self._cost(1, kv_bytes) <= self.kv_budget

    def admit(self, kv_bytes: int = 0) -> Ticket:
        """A ticket, or ``Overloaded`` when every running slot and every place in line is taken (or the
        request's ``kv_bytes`` alone exceed the budget)."""
        if self.kv_budget is not None and kv_bytes > self.kv_budget:
            self.rejected += 1
            raise Overloaded(f"the request needs {kv_bytes} bytes of KV cache (prompt + max_new_tokens), more "
                             f"than this replica's whole budget of {self.kv_budget} (limits.kv_cache_bytes): "
                             "ask for fewer max_new_tokens or a shorter prompt", self.retry_after_s)
        if not self._line and self._fits(kv_bytes):
            self._start(kv_bytes)
            self.on_change()
            return Ticket(self, None, kv_bytes)
        if len(self._line) >= self.max_waiting + self.closing:
            self.rejected += 1
            raise Overloaded(f"server busy: {self.running} requests running (limits.max_running_requests) "
                             f"holding {self.kv_bytes} bytes of KV cache (limits.kv_cache_bytes) and "
                             f"{len(self._line)} waiting (limits.max_waiting_requests)", self.retry_after_s)
        ticket = Ticket(self, asyncio.get_running_loop().create_future(), kv_bytes)
        self._line.append(ticket)
        self.on_change()
        return ticket

    def _free(self, ticket: Ticket) -> None:
        """A running request ended: its room goes to the first in line while they fit."""
        self.running -= 1
        self._widths[ticket.kv_bytes] -= 1
        if not self._widths[ticket.kv_bytes]:
            del self._widths[ticket.kv_bytes]
        self._hand_room()
        self.on_change()

    def _leave_line(self, ticket: Ticket) -> None:
        try:
            self._line.remove(ticket)
        except ValueError:  # already handed over and popped
            pass
        self._hand_room()  # a large request that left the head of the line may have held back smaller ones
        self.on_change()

    def _hand_room(self) -> None:
        while self._line and self._fits(self._line[0].kv_bytes):
            waiting = self._line.popleft()
            if not waiting._turn.done():
                self._start(waiting.kv_bytes)
                waiting._turn.set_result(None)
