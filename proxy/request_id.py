"""Request ids: one per request, sent back as X-Request-Id and carried by every log line the
request causes (structlog contextvars), so a client's report finds the daemon's lines."""

from __future__ import annotations

import re
import uuid
from contextlib import AbstractContextManager

import structlog

HEADER = "X-Request-Id"
_KEY = "request_id"  # the structlog contextvar: log lines and error bodies read the same one
# A client's own id is kept only when it is short and plain: it goes into headers and logs.
_VALID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def choose(given: str | None) -> str:
    """The client's id when it is acceptable, else a fresh one."""
    if given is not None and _VALID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def bound(request_id: str) -> AbstractContextManager[None]:
    """Every log line inside (and in tasks started inside) carries `request_id`."""
    return structlog.contextvars.bound_contextvars(**{_KEY: request_id})


def current() -> str | None:
    """The id of the request being served by this task (None outside a request)."""
    value = structlog.contextvars.get_contextvars().get(_KEY)
    return value if isinstance(value, str) else None


def tagged(message: str) -> str:
    """`message` with the request id appended: what a client quotes when reporting a 5xx."""
    request_id = current()
    return f"{message} (request id {request_id})" if request_id else message
