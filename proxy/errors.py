"""OpenAI-shaped error responses, {"error": {"message", "type", "code", "param"}}, and the one
table that says what each supervisor or upstream error means in HTTP."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from corral.proxy import request_id
from corral.proxy.redact import without_secrets  # forward.py and the groups import it here
from corral.proxy.sse import error_event as sse_error_event  # its old home: forward.py imports it
from corral.supervisor.errors import (
    InUse,
    NoCapacity,
    NotAllowed,
    NotServed,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    SlotNotCleared,
    StartBackoff,
    StartFailed,
    StartTimedOut,
    SupervisorError,
    UnknownModel,
    Unloaded,
    WorkersUnavailable,
    shown,
)

__all__ = ["ApiError", "UnknownGroup", "UpstreamFailed", "UpstreamRejected", "UpstreamTimeout",
           "error_response", "http_error", "method_not_allowed", "shape_of", "sse_error_event",
           "without_secrets"]


def error_response(status: int, message: str, *, kind: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None,
                   retry_after: float | None = None,
                   extra: dict[str, Any] | None = None) -> web.Response:
    """The one error body. A 5xx message ends with the request id: what a client quotes when
    it reports the failure, and what finds its lines in the daemon log."""
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    if status >= 500:
        message = request_id.tagged(message)
    body = {"error": {"message": message, "type": kind, "code": code, "param": param}}
    return web.json_response({**body, **(extra or {})}, status=status, headers=headers)


def method_not_allowed(method: str, path: str, allow: str) -> web.Response:
    """405 in the OpenAI shape, with the Allow header HTTP asks of it (`allow`: "GET, HEAD")."""
    response = error_response(405, f"{method} is not allowed on {path}; it answers {allow}",
                              code="method_not_allowed")
    response.headers["Allow"] = allow
    return response


class ApiError(Exception):
    """A request the proxy refuses, raised anywhere in a handler and shaped by the middleware."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        self.status, self.code, self.param, self.kind = status, code, param, kind
        super().__init__(message)

    def response(self) -> web.Response:
        return error_response(self.status, str(self), kind=self.kind, code=self.code,
                              param=self.param)


class UnknownGroup(UnknownModel):
    """A group named in /v1/batch or /v1/chain that does not exist (for this caller)."""

    def __init__(self, name: str, known: list[str], hint: str = ""):
        super().__init__(name, known)
        self.args = (f"group {shown(name)} does not exist{hint}; "
                     f"groups: {', '.join(known) or 'none'}",)


class UpstreamFailed(Exception):
    """The child broke the connection or answered garbage (→ 502)."""


class UpstreamRejected(UpstreamFailed):
    """The child answered, with an HTTP error: it is alive, the request was refused."""


class UpstreamTimeout(UpstreamFailed):
    """The child sent nothing within first_byte_timeout, or went silent past idle_timeout."""


@dataclass(frozen=True)
class Shape:
    status: int
    code: str
    kind: str = "server_error"


# Most specific first is not needed: shape_of walks each error's own class hierarchy.
_SHAPES: dict[type[Exception], Shape] = {
    UnknownGroup: Shape(404, "group_not_found", "invalid_request_error"),
    UnknownModel: Shape(404, "model_not_found", "invalid_request_error"),
    QueueFull: Shape(429, "queue_full", "rate_limit_error"),
    NotAllowed: Shape(403, "permission_denied", "permission_error"),
    InUse: Shape(409, "model_busy", "invalid_request_error"),
    Unloaded: Shape(503, "model_unloaded"),
    QueueTimeout: Shape(503, "queue_timeout"),
    NoCapacity: Shape(503, "no_capacity"),
    NotServed: Shape(503, "model_not_served"),
    ShuttingDown: Shape(503, "shutting_down"),
    SlotNotCleared: Shape(503, "slot_not_cleared"),
    StartBackoff: Shape(503, "model_start_backoff"),
    WorkersUnavailable: Shape(503, "workers_unavailable"),
    StartTimedOut: Shape(504, "model_start_timeout"),
    StartFailed: Shape(502, "model_start_failed"),
    UpstreamTimeout: Shape(504, "upstream_timeout"),
    UpstreamFailed: Shape(502, "upstream_failed"),
}
_UNMAPPED = Shape(500, "internal_error")


def shape_of(exc: Exception) -> Shape:
    for cls in type(exc).__mro__:
        shape = _SHAPES.get(cls)
        if shape is not None:
            return shape
    return _UNMAPPED


def http_error(exc: SupervisorError | UpstreamFailed,
               extra: dict[str, Any] | None = None) -> web.Response:
    shape = shape_of(exc)
    return error_response(shape.status, str(exc), kind=shape.kind, code=shape.code,
                          retry_after=getattr(exc, "retry_after", None), extra=extra)


def child_error(status: int, payload: bytes, model: str,
                retry_after: str | None = None) -> web.Response:
    """A child's own error answer, in our shape and with a status we document: its 4xx stay
    (the request was refused), its other 5xx (llama-server answers 500 to some malformed
    requests, 501 to a feature it was not started with) become 502, and a redirect (3xx) is a
    502 too: corral does not follow it. `retry_after`: the child's Retry-After, passed on (a
    provider's 429 or 503 says when to come back; the client's SDK reads it)."""
    if 300 <= status < 400:
        # Following would send the body and the remote's key wherever it points; passing it
        # on would send the client there (a relative Location even back to corral).
        return error_response(502, f"{model} answered HTTP {status}, a redirect, which corral "
                              "does not follow: its `url` may be out of date (the location "
                              "is in corral's log)", kind="server_error",
                              code="upstream_redirect")
    response = _child_error(status, payload, model)
    if retry_after and response.status in (429, 503) and len(retry_after) <= 64:
        response.headers["Retry-After"] = retry_after
    return response


def _child_error(status: int, payload: bytes, model: str) -> web.Response:
    message, kind = _child_message(payload)
    if status in (401, 403):
        # Only a remote endpoint refuses corral's key (a child has the one corral gave it):
        # the client's own key was fine, so not a 401 to the client, a gateway's error.
        return error_response(502, f"{model} refused corral's credentials (HTTP {status}): "
                              f"{message}", kind="server_error", code="upstream_auth")
    if status >= 500 and status not in (502, 503, 504):
        return error_response(502, f"{model} answered HTTP {status}: {message}",
                              kind="server_error", code="upstream_error")
    return error_response(status, message, kind=kind or "invalid_request_error",
                          code="upstream_error" if status >= 500 else None)


def _child_message(payload: bytes) -> tuple[str, str | None]:
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        kind = error.get("type")
        return error["message"], kind if isinstance(kind, str) else None
    return payload[:300].decode(errors="replace"), None
