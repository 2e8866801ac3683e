"""The KV sessions one model actor holds, keyed by request id: bounded, locked, freed when idle.

An actor serves many requests at once from a thread pool; each request's calls arrive one after the
other, but a close (client gone) may race a draft still running, so every session has its own lock and
a close waits for the call in progress (a prompt's prefill stops at its next chunk: ``holds``). A session nobody touched for ``idle_timeout_s`` is freed by a
background sweep, so a coordinator that died mid-request cannot leak a KV cache.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from deployments.errors import SessionLimitReached, UnknownSession

Session = TypeVar("Session")


@dataclass
class _Entry(Generic[Session]):
    session: Session
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)


class Sessions(Generic[Session]):
    def __init__(self, max_sessions: int, idle_timeout_s: float, release: Callable[[Session], None]):
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._release = release
        self._entries: dict[str, _Entry[Session]] = {}
        self._guard = threading.Lock()  # protects the dict, never held during model work
        self._closing = 0  # closed, but still held until the call running on them ends
        # ids closed before they were opened (a client gone while its open was still on the way): when is each
        # remembered since, so the open that comes after frees its session at once instead of leaving it to the
        # idle sweep; forgotten after idle_timeout_s
        self._closed_before_open: dict[str, float] = {}
        self._sweeper_stop = threading.Event()

    def __len__(self) -> int:
        """Sessions holding a KV cache (one being closed counts until it is freed)."""
        return len(self._entries) + self._closing

    def elsewhere(self, within_s: float) -> int:
        """Sessions not in use now but used in the last ``within_s`` seconds: requests this actor serves that are
        between its calls (at the other model, or in the coordinator's turn). A batched call holds the sessions
        of every request in it, so those are not counted."""
        since = time.monotonic() - within_s
        return sum(1 for entry in list(self._entries.values()) if not entry.lock.locked() and entry.last_used >= since)

    def open(self, request_id: str, session: Session) -> None:
        """Hold ``session`` under ``request_id``; one whose close came first is freed and ``UnknownSession``."""
        with self._guard:
            closed_first = self._closed_before_open.pop(request_id, None) is not None
            if not closed_first:
                if request_id in self._entries:
                    raise ValueError(f"session {request_id} is already open")
                if len(self) >= self.max_sessions:
                    raise SessionLimitReached(f"this actor already holds {self.max_sessions} sessions (max_sessions)")
                self._entries[request_id] = _Entry(session)
                return
        self._release(session)
        raise UnknownSession(request_id)

    def holds(self, request_id: str, session: Session) -> bool:
        """Whether ``session`` is still open under ``request_id``. A close takes it out at once, before it waits for
        the call running on it: a long call (a prompt's prefill) asks between its passes and stops early."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.session is session

    @contextmanager
    def use(self, request_id: str) -> Iterator[Session]:
        entry = self._entries.get(request_id)
        if entry is None:
            raise UnknownSession(request_id)
        with entry.lock:
            if self._entries.get(request_id) is not entry:  # closed while we waited for the lock
                raise UnknownSession(request_id)
            entry.last_used = time.monotonic()
            try:
                yield entry.session
            finally:
                entry.last_used = time.monotonic()

    def close(self, request_id: str) -> bool:
        """Free a session; False if there was none (already closed, expired, or not opened yet: then its open,
        should it come, frees it at once)."""
        with self._guard:
            entry = self._entries.pop(request_id, None)  # no new call gets it from here on
            if entry is None:
                self._closed_before_open[request_id] = time.monotonic()
                return False
            self._closing += 1
        try:
            with entry.lock:  # a call still running on this session finishes first
                self._release(entry.session)
        finally:
            with self._guard:
                self._closing -= 1
        return True

    def close_idle(self) -> list[str]:
        """Free the sessions idle for longer than the timeout (a busy one is never idle); their ids."""
        deadline = time.monotonic() - self.idle_timeout_s
        with self._guard:
            for request_id, since in list(self._closed_before_open.items()):
                if since < deadline:
                    del self._closed_before_open[request_id]
        expired = [request_id for request_id, entry in list(self._entries.items())
                   if entry.last_used < deadline and not entry.lock.locked()]
        return [request_id for request_id in expired if self.close(request_id)]

    def close_all(self) -> list[str]:
        """Free every session (a call running on one finishes first); their ids."""
        return [request_id for request_id in list(self._entries) if self.close(request_id)]

    def start_sweeper(self, on_expired: Callable[[list[str]], None] = lambda ids: None) -> threading.Thread:
        """A daemon thread that frees idle sessions until ``stop_sweeper``."""
        def sweep() -> None:
            while not self._sweeper_stop.wait(min(5.0, self.idle_timeout_s / 4)):
                expired = self.close_idle()
                if expired:
                    on_expired(expired)

        thread = threading.Thread(target=sweep, name="kv-session-sweeper", daemon=True)
        thread.start()
        return thread

    def stop_sweeper(self) -> None:
        self._sweeper_stop.set()
