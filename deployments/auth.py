"""API keys: which key a request presents (HTTP header, gRPC metadata) and whether it is one of ours.

The keys come from ``AuthConfig`` (the ``HETSPEC_API_KEY`` environment variable, else ``auth.api_keys``);
with none, every request is let in. Keys are compared in constant time (``hmac.compare_digest``, against
every key, no early exit), so the answer's timing tells nothing about how much of a guess was right, and
they are never logged or echoed.
"""

from __future__ import annotations

import hmac
from typing import Iterable

from deployments.config import AuthConfig
from deployments.errors import Unauthenticated

# HTTP routes open without a key: liveness probes must not need the secret.
OPEN_HTTP_PATHS = frozenset({"/health"})


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = [key.encode() for key in keys]

    @classmethod
    def from_config(cls, auth: AuthConfig) -> "ApiKeys":
        return cls(auth.resolve_keys())

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def check(self, presented: str | None, how: str) -> None:
        """Raise ``Unauthenticated`` unless no key is required or ``presented`` is one of the keys."""
        if not self._keys:
            return
        if not presented:
            raise Unauthenticated(f"missing API key: send {how}")
        candidate = presented.encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        if not matched:
            raise Unauthenticated("invalid API key")

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self._keys)} keys)"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def grpc_api_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The key in gRPC metadata: ``authorization: Bearer <key>``, or ``x-api-key: <key>``."""
    values = {key.lower(): value for key, value in metadata if isinstance(value, str)}
    return bearer_token(values.get("authorization")) or values.get("x-api-key") or None
