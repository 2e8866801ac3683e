"""API keys: which key a request presents (HTTP header, gRPC metadata) and whether it is one of ours.

The keys come from ``AuthConfig`` (the ``HETSPEC_API_KEY`` environment variable, else ``auth.api_keys``);
with none, every request is let in. Keys are compared in constant time (``hmac.compare_digest``, against
every key, no early exit), so the answer's timing tells nothing about how much of a guess was right, and
they are never logged or echoed.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import os
from typing import Callable, Iterable, Mapping, Protocol

import grpc
from starlette.responses import JSONResponse

from deployments.errors import Unauthenticated


class _KeySource(Protocol):
    """What ``ApiKeys.from_config`` reads (``deployments.config.AuthConfig``, which imports this module)."""

    def resolve_keys(self) -> list[str]: ...


# The variable Serve's proxies read their keys from (AuthConfig.api_key_env's default; deployments/proxy.py).
API_KEY_ENV = "HETSPEC_API_KEY"
# HTTP routes open without a key: liveness probes must not need the secret.
OPEN_HTTP_PATHS = frozenset({"/health"})


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = [key.encode() for key in keys]

    @classmethod
    def from_config(cls, auth: _KeySource) -> "ApiKeys":
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


def keys_from_environment(name: str, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The comma-separated keys of the environment variable ``name`` (none if it is unset or empty)."""
    return [key.strip() for key in environ.get(name, "").split(",") if key.strip()]


def unauthenticated_warning(keys: ApiKeys, host: str | None) -> str | None:
    """The warning to log at start when no API key is configured and the server listens beyond loopback."""
    if keys.required or host is None:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if loopback:
        return None
    return (f"no API key is configured and the server listens on {host}: anyone who reaches it can generate. "
            "Set $HETSPEC_API_KEY (or auth.api_keys), or listen on 127.0.0.1 only.")


class RequireApiKey:
    """ASGI middleware: with API keys configured, every route but /health needs ``Authorization: Bearer <key>``
    (the official ``openai`` client sends its ``api_key`` so); otherwise 401 the way OpenAI answers one.
    ``get_api_keys``: the keys in force (a replica's coordinator's, or the proxy's: deployments/proxy.py);
    ``open_paths``: the routes open without a key."""

    def __init__(self, app, get_api_keys: Callable[[], ApiKeys], open_paths: frozenset[str] = OPEN_HTTP_PATHS):
        self.app = app
        self.get_api_keys = get_api_keys
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):  # served under a route prefix
                path = path[len(root):] or "/"
            if path not in self.open_paths:
                headers = dict(scope["headers"])
                presented = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
                try:
                    self.get_api_keys().check(presented, "the header 'Authorization: Bearer <key>'")
                except Unauthenticated as error:  # OpenAI's error body (deployments/api/openai_protocol.py)
                    body = {"error": {"message": str(error), "type": "invalid_request_error", "param": None,
                                      "code": "invalid_api_key"}}
                    response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    return await response(scope, receive, send)
        return await self.app(scope, receive, send)


GRPC_KEY_HOW = "metadata 'authorization: Bearer <key>' (or 'x-api-key: <key>')"


def guarded_handler_factory(factory: Callable, keys: ApiKeys, service_name: str) -> Callable:
    """Serve's ``service_handler_factory`` whose handlers of ``service_name`` first check the call's API key (the
    other services' handlers as they were). A handler it cannot wrap is an error, never let through unchecked."""

    def make(service_method: str, streaming_type) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if not service_method.startswith(f"/{service_name}/"):
            return handler

        async def refuse_keyless(context) -> None:
            try:
                keys.check(grpc_api_key(context.invocation_metadata() or ()), GRPC_KEY_HOW)
            except Unauthenticated as error:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))  # raises: the call ends here

        if inspect.isasyncgenfunction(handler):
            async def streaming(request, context):
                await refuse_keyless(context)
                async for message in handler(request, context):
                    yield message

            return streaming
        if inspect.iscoroutinefunction(handler):
            async def unary(request, context):
                await refuse_keyless(context)
                return await handler(request, context)

            return unary
        raise TypeError(f"{service_method}: Serve's handler {handler!r} is neither a coroutine nor an async generator "
                        "function, so its API key check cannot be put in front of it")

    return make


def guard_grpc_server(server, service_name: str) -> None:
    """With keys in this process's environment, make ``server`` (Serve's gRPC proxy server, before ``service_name``'s
    handlers are added) check them in the proxy. Any other server (a plain ``grpc.aio`` one) is left as it is."""
    keys = ApiKeys(keys_from_environment(API_KEY_ENV))
    factory = getattr(server, "service_handler_factory", None)
    if keys.required and callable(factory):
        server.service_handler_factory = guarded_handler_factory(factory, keys, service_name)
