"""The HTTP request body bound, checked before a body is read: in the replica (``limits.max_request_bytes``) and
in Serve's HTTP proxy (its message bound, the ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`` its gRPC side refuses above), so
an oversized body is refused by the first process it reaches instead of being buffered there and forwarded."""

from __future__ import annotations

from typing import Callable

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse


def too_large_body(limit: int, setting: str) -> dict:
    """OpenAI's error body (deployments/api/openai_responses.py) for a body over ``limit`` bytes."""
    message = f"the request body is larger than this server's limit of {limit} bytes ({setting})"
    return {"error": {"message": message, "type": "invalid_request_error", "param": "body",
                      "code": "request_too_large"}}


class LimitBody:
    """ASGI middleware: a request body larger than ``get_limit()`` bytes is refused with 413 before it is read: at
    once when its Content-Length says so, else as soon as the bytes received pass the limit (the reader gets an
    HTTPException with the same message: the replica's app answers it 413; in the proxy the replica's own bound,
    never larger, has refused such a body first)."""

    def __init__(self, app, get_limit: Callable[[], int], setting: str):
        self.app = app
        self.get_limit = get_limit
        self.setting = setting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.get_limit()
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await JSONResponse(too_large_body(limit, self.setting), status_code=413)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > limit:
                    raise HTTPException(413, too_large_body(limit, self.setting)["error"]["message"])
            return event

        return await self.app(scope, limited_receive, send)
