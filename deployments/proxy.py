"""Serve's HTTP and gRPC proxies, before any routing: a request without a right API key, or an HTTP body over the
proxy's message bound, is refused where it costs nothing.

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

import os

from starlette.middleware import Middleware

from deployments.auth import API_KEY_ENV, OPEN_HTTP_PATHS, ApiKeys, RequireApiKey, keys_from_environment
from deployments.body_limit import LimitBody

# Serve's own probes (the proxy's health and route table: KubeRay's readiness checks) stay open too.
OPEN_PROXY_PATHS = OPEN_HTTP_PATHS | {"/-/healthz", "/-/routes"}


# The proxy's message bound, the one its gRPC side enforces (deployments.config.GRPC_MAX_MESSAGE_BYTES).
MESSAGE_BOUND_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def proxy_middlewares() -> list[Middleware]:
    """Serve's HTTP proxy callback: the body bound, if this process has one (an HTTP body over it is refused 413
    here, not buffered by the proxy and forwarded to a replica that refuses it), then the API key check, if this
    process has keys."""
    middlewares = []
    bound = os.environ.get(MESSAGE_BOUND_ENV, "")
    if bound.isdigit():
        middlewares.append(Middleware(LimitBody, get_limit=lambda: int(bound), setting=MESSAGE_BOUND_ENV))
    keys = ApiKeys(keys_from_environment(API_KEY_ENV))
    if keys.required:
        middlewares.append(Middleware(RequireApiKey, get_api_keys=lambda: keys, open_paths=OPEN_PROXY_PATHS))
    return middlewares
