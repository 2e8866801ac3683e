"""How the replica reaches its model workers (``deployments.workers.api.WorkerClient``): ``ActorWorker`` over Ray
actor calls (the transport: the only module that imports Ray's actor errors), ``LocalWorker`` on a thread of this
process (tests, embedding)."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Awaitable, Callable

from ray.exceptions import ActorDiedError, RayActorError

from deployments.errors import WorkerLost
from deployments.workers.api import DraftItem, Drafted, DrafterAPI, OpenSession, TargetAPI, VerifyItem, VerifyResult


class LocalWorker:
    """A worker object in this process, called on a thread (tests; the Serve app uses actors). A ``WorkerClient``."""

    def __init__(self, worker: DrafterAPI | TargetAPI) -> None:
        self.worker = worker

    @property
    def identity(self) -> int:
        """The same for every client of one worker (the replica loop sends their items in one call)."""
        return id(self.worker)

    def _call(self, method: Callable, *args) -> Awaitable:
        # run_in_executor starts the call now, like an actor call, even if nobody awaits it (a close)
        return asyncio.get_running_loop().run_in_executor(None, method, *args)

    def open(self, session: OpenSession) -> Awaitable[None]:
        return self._call(self.worker.open, session)

    def close(self, request_id: str) -> Awaitable[bool]:
        # shielded: a cancelled waiter (the loop shutting down, asyncio.run's end) must not cancel a close still
        # queued for a thread, which then never ran and left the request's KV rows taken
        return asyncio.shield(self._call(self.worker.close, request_id))

    def draft(self, items: list[DraftItem]) -> Awaitable[list[Drafted | Exception]]:
        return self._call(self.worker.draft, items)

    def verify(self, items: list[VerifyItem]) -> Awaitable[list[VerifyResult | Exception]]:
        return self._call(self.worker.verify, items)

    def stats(self) -> Awaitable[dict]:
        return self._call(self.worker.stats)

    def ping(self) -> Awaitable[str]:
        return self._call(self.worker.ping)

    def node_id(self) -> Awaitable[str | None]:
        return self._call(self.worker.node_id)

    def pinned(self) -> "LocalWorker":
        return self


class ActorWorker:
    """A worker Ray actor: a direct actor call (~1 ms) per step, no Serve handle hop (~3 ms). A ``WorkerClient``.

    ``handle`` is replaced when the actor is (``deployments.workers.actors``); while a replacement starts the worker
    is not ``available`` and calls fail at once. A call that finds the actor dead raises ``WorkerLost`` and
    reports the loss through ``on_lost``.
    """

    def __init__(self, role: str, handle=None, on_lost: Callable[[str], None] = lambda role: None) -> None:
        self.role = role
        self.handle = handle
        self.on_lost = on_lost
        self.available = True

    @property
    def identity(self) -> int:
        """The same for every pinned copy of one actor (the replica loop sends their items in one call)."""
        return id(self.handle)

    def pinned(self) -> "ActorWorker":
        if not self.available:
            raise WorkerLost(self.role)
        return ActorWorker(self.role, self.handle, self.on_lost)

    def open(self, session: OpenSession) -> Awaitable[None]:
        return self._call(self._available().open.remote(session))

    def close(self, request_id: str) -> Awaitable[bool]:
        # Ray cancels every call a cancelled task made, recursively, even one made while it unwinds; a call
        # made from an empty context belongs to no task (what Serve's own long-poll client does).
        return contextvars.Context().run(self.handle.close.remote, request_id)

    def draft(self, items: list[DraftItem]) -> Awaitable[list[Drafted | Exception]]:
        return self._call(contextvars.Context().run(self._available().draft.remote, items))

    def verify(self, items: list[VerifyItem]) -> Awaitable[list[VerifyResult | Exception]]:
        # Ray cancels every actor call a cancelled task made (recursively), a running one included: a batch
        # call made from one request's task would go with that request. Made from an empty context, it
        # belongs to no task (as close above).
        return self._call(contextvars.Context().run(self._available().verify.remote, items))

    def stats(self) -> Awaitable[dict]:
        return self._call(self._available().stats.remote())

    def ping(self) -> Awaitable[str]:
        return self._call(self._available().ping.remote())

    def node_id(self) -> Awaitable[str | None]:
        return self._call(self._available().node_id.remote())

    def _available(self):
        """The actor's handle, or ``WorkerLost`` at once while a replacement starts."""
        if not self.available:
            raise WorkerLost(self.role)
        return self.handle

    def _call(self, ref) -> Awaitable:
        task = asyncio.ensure_future(self._result(ref))
        task.add_done_callback(_retrieve)  # a dropped speculative draft's failure is not worth a warning
        return task

    async def _result(self, ref):
        try:
            return await ref
        except RayActorError as error:
            if isinstance(error, ActorDiedError):
                self.on_lost(self.role)
            raise WorkerLost(self.role) from error


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
