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
(deployments/api/grpc_registration.py), which the proxy calls with its server, wraps that factory for HetSpec's
methods (``deployments.auth.guard_grpc_server``, in auth.py because the API layer may import it): a call without a
right key in its metadata is aborted UNAUTHENTICATED before the factory's handler runs, so the router never counts
it. Serve's own service (Healthz, ListApplications) stays open.
"""

from __future__ import annotations

from starlette.middleware import Middleware

from deployments.auth import API_KEY_ENV, OPEN_HTTP_PATHS, ApiKeys, RequireApiKey, keys_from_environment

# Serve's own probes (the proxy's health and route table: KubeRay's readiness checks) stay open too.
OPEN_PROXY_PATHS = OPEN_HTTP_PATHS | {"/-/healthz", "/-/routes"}


def proxy_middlewares() -> list[Middleware]:
    """Serve's HTTP proxy callback: the API key check, if this process has keys."""
    keys = ApiKeys(keys_from_environment(API_KEY_ENV))
    if not keys.required:
        return []
    return [Middleware(RequireApiKey, get_api_keys=lambda: keys, open_paths=OPEN_PROXY_PATHS)]
