"""Serve's HTTP and gRPC proxies, before any routing: a request without a right API key is refused where it costs
nothing.

Checked in the replica only (deployments/auth.py ``RequireApiKey``), a keyless request was counted as load by
the request router (deployments/serving/routing.py) and took one of Serve's slots before its 401: 96 concurrent keyless
POSTs made every authenticated request meanwhile a 429. Serve runs ``proxy_middlewares`` in each HTTP proxy when
the Ray processes' environment has ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy:proxy_middlewares``
(deployments/tools/local_serve.py sets it; docs/deploy.md for a cluster); the proxy wraps its whole ASGI app in them,
so the check runs before routing. The keys are the proxy process's ``$HETSPEC_API_KEY`` (auth.api_key_env's
default): with none there, the proxy checks nothing and the replicas alone answer 401, as before. The replica
still checks every request, so a proxy without the variable set is no hole, only a cost.

gRPC: Serve's gRPC proxy has no interceptors and replaces every handler of a registered service with one its
``service_handler_factory`` makes (the one that routes to a replica). The servicer function of the Serve configs
(deployments/api/grpc_registration.py), which the proxy calls with its server, wraps that factory for HetSpec's methods
(``guard_grpc_server``): a call without a right key in its metadata is aborted UNAUTHENTICATED before the factory's
handler runs, so the router never counts it. Serve's own service (Healthz, ListApplications) stays open.
"""

from __future__ import annotations

import inspect
from typing import Callable

import grpc
from starlette.middleware import Middleware

from deployments.auth import OPEN_HTTP_PATHS, ApiKeys, RequireApiKey, grpc_api_key, keys_from_environment
from deployments.errors import Unauthenticated

# The variable the proxy reads its keys from (AuthConfig.api_key_env's default).
API_KEY_ENV = "HETSPEC_API_KEY"
# Serve's own probes (the proxy's health and route table: KubeRay's readiness checks) stay open too.
OPEN_PROXY_PATHS = OPEN_HTTP_PATHS | {"/-/healthz", "/-/routes"}


def proxy_middlewares() -> list[Middleware]:
    """Serve's HTTP proxy callback: the API key check, if this process has keys."""
    keys = ApiKeys(keys_from_environment(API_KEY_ENV))
    if not keys.required:
        return []
    return [Middleware(RequireApiKey, get_api_keys=lambda: keys, open_paths=OPEN_PROXY_PATHS)]


GRPC_KEY_HOW = "metadata 'authorization: Bearer <key>' (or 'x-api-key: <key>')"


def guarded_handler_factory(factory: Callable, keys: ApiKeys, service_name: str) -> Callable:
    """Serve's ``service_handler_factory`` whose unary and server-streaming handlers of ``service_name`` first check
    the call's API key (the other services' handlers, and the client-streaming kinds nobody serves, as they were)."""

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
        return handler

    return make


def guard_grpc_server(server, service_name: str) -> None:
    """With keys in this process's environment, make ``server`` (Serve's gRPC proxy server, before ``service_name``'s
    handlers are added) check them in the proxy. Any other server (a plain ``grpc.aio`` one) is left as it is."""
    keys = ApiKeys(keys_from_environment(API_KEY_ENV))
    factory = getattr(server, "service_handler_factory", None)
    if keys.required and callable(factory):
        server.service_handler_factory = guarded_handler_factory(factory, keys, service_name)
