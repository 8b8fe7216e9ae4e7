"""OpenAI-shaped error responses: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import math

from aiohttp import web

from corral.supervisor.errors import SupervisorError


def error_response(status: int, message: str, *, kind: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": code, "param": param}},
        status=status, headers=headers)


def from_supervisor(exc: SupervisorError) -> web.Response:
    return error_response(exc.status, str(exc), kind=exc.kind, code=exc.code,
                          retry_after=exc.retry_after)


class ApiError(Exception):
    """A request the proxy refuses, raised anywhere in a handler and shaped by the middleware."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        self.status, self.code, self.param, self.kind = status, code, param, kind
        super().__init__(message)

    def response(self) -> web.Response:
        return error_response(self.status, str(self), kind=self.kind, code=self.code,
                              param=self.param)


class UpstreamFailed(Exception):
    """The child broke the connection or answered garbage (→ 502)."""


class UpstreamRejected(UpstreamFailed):
    """The child answered, with an HTTP error: it is alive, the request was refused."""


class UpstreamTimeout(UpstreamFailed):
    """The child sent nothing within first_byte_timeout, or went silent past idle_timeout."""


def sse_error_event(message: str, code: str = "upstream_failed") -> bytes:
    """An error delivered inside an already-started SSE stream (the status line is gone).
    The OpenAI SDKs raise APIError on an event carrying an `error` object."""
    import json

    payload = {"error": {"message": message, "type": "server_error", "code": code}}
    return f"data: {json.dumps(payload)}\n\n".encode()
