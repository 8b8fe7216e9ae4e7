"""Server-sent events the way the OpenAI streaming API writes them: one `data:` line per JSON
object, a blank line after each, and `data: [DONE]` at the end."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from corral.proxy import request_id

DONE = b"data: [DONE]\n\n"


def sse_headers() -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # tell an nginx in front of us not to buffer either
    }


def frame(payload: Mapping[str, Any]) -> bytes:
    """One event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def named(event_id: int, kind: str, payload: Mapping[str, Any]) -> bytes:
    """An event with an id (a reconnecting EventSource sends it back as Last-Event-ID) and a
    type (what EventSource.addEventListener listens to)."""
    return (f"id: {event_id}\nevent: {kind}\ndata: ".encode() + json.dumps(payload).encode()
            + b"\n\n")


def typed(kind: str, payload: Mapping[str, Any]) -> bytes:
    """An event with a type line, the way the Responses and Messages streams name theirs:
    Anthropic's SDKs read only named events (an `error` one they raise on)."""
    return f"event: {kind}\ndata: ".encode() + json.dumps(payload).encode() + b"\n\n"


# The longest partial line a rewrite holds back (an SSE event is far smaller).
LINE_LIMIT = 1 << 20


class Lines:
    """A stream's bytes as whole lines, for the relay's rewrites: what a chunk ends with past
    its last newline waits for the next chunk. A line that never ends must not grow the
    buffer without bound: past `limit` bytes what is held goes out as it is."""

    __slots__ = ("_limit", "_rest")

    def __init__(self, limit: int = LINE_LIMIT):
        self._limit = limit
        self._rest = b""

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """The whole lines the stream has now (each with its newline), and whether they are
        whole: False when an overlong unended line is given back as it is."""
        data = self._rest + chunk
        cut = data.rfind(b"\n") + 1
        if not cut and len(data) > self._limit:
            self._rest = b""
            return data, False
        self._rest = data[cut:]
        return data[:cut], True

    def flush(self) -> bytes:
        """What is left: the stream ended without a last newline."""
        rest, self._rest = self._rest, b""
        return rest


# A comment line: keeps proxies and browsers from timing out a quiet stream.
KEEPALIVE = b": keep-alive\n\n"


def error_event(message: str, code: str = "upstream_failed") -> bytes:
    """An error delivered inside an already-started stream (the status line is gone). The
    OpenAI SDKs raise APIError on an event carrying an `error` object. Same shape as the
    error bodies in proxy/errors.py (which imports this module, hence not shared code)."""
    return frame({"error": {"message": request_id.tagged(message), "type": "server_error",
                            "code": code, "param": None}})
