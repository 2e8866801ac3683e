"""The errors a request can meet on the server, in one module: the API layer (HTTP routes, gRPC methods) maps
them to status codes importing nothing of the transport or the workers. Each crosses process boundaries
(actor -> replica -> proxy) pickled, so each says how to rebuild itself (``__reduce__``).
"""

from __future__ import annotations

import math


class Overloaded(RuntimeError):
    """The server is full (running and waiting requests, or an actor's sessions); the client may retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # it crosses process boundaries (replica -> gRPC proxy) pickled
        return Overloaded, (str(self), self.retry_after_s)

    @property
    def retry_after_header(self) -> str:
        """Retry-After's value: whole seconds (RFC 9110 delay-seconds), rounded up."""
        return str(math.ceil(self.retry_after_s))


class RequestTimeout(TimeoutError):
    """The request ran (or waited) past its deadline; its work was stopped and its sessions freed."""

    def __reduce__(self):
        return RequestTimeout, (str(self),)


class Unauthenticated(PermissionError):
    """No API key, or a wrong one."""

    def __reduce__(self):  # it crosses process boundaries (replica -> gRPC proxy) pickled
        return Unauthenticated, (str(self),)


class InvalidRequest(ValueError):
    """The client's fault; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # it crosses process boundaries (replica -> gRPC proxy) pickled
        return InvalidRequest, (self.field, self.message)


class SessionLimitReached(RuntimeError):
    """The actor already holds max_sessions KV caches."""


class UnknownSession(KeyError):
    """No session with this request id: never opened, closed, or freed after being idle."""


class ModelLoadFailed(RuntimeError):
    """A drafter or target actor could not load its model (bad path, corrupted file, out of memory...)."""

    def __init__(self, role: str, model: str, reason: str):
        super().__init__(f"the {role} model {model!r} failed to load: {reason}")
        self.role, self.model, self.reason = role, model, reason

    def __reduce__(self):  # Serve pickles a replica's constructor error
        return ModelLoadFailed, (self.role, self.model, self.reason)


class WorkerLost(RuntimeError):
    """The drafter or target actor died (or is unreachable) during a call; the client may retry."""

    def __init__(self, role: str):
        super().__init__(f"the {role} actor is gone (its process or node died); this request is lost, the pipeline "
                         "is being rebuilt: retry")
        self.role = role

    def __reduce__(self):  # it crosses process boundaries (replica -> proxy) pickled
        return WorkerLost, (self.role,)


class WorkerUnresponsive(WorkerLost):
    """The actor did not answer a health ping in time: its node may be cut off; Ray has not declared it dead yet."""

    def __init__(self, role: str, waited_s: float):
        RuntimeError.__init__(self, f"the {role} actor did not answer a ping within {waited_s:g} s (its node may be "
                                    "unreachable)")
        self.role, self.waited_s = role, waited_s

    def __reduce__(self):
        return WorkerUnresponsive, (self.role, self.waited_s)
