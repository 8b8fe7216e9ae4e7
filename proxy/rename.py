"""A model's `served_name`: the server behind a lease (a command child, a remote endpoint)
knows the model by another name. Requests carry that name in `model`; answers get the model's
corral name back, whole or streamed. Only leases with a served_name pay for any of this."""

from __future__ import annotations

import json
from typing import Any

from corral.proxy.families.wire import CHAT, Wire
from corral.proxy.sse import Lines
from corral.supervisor.json_bytes import compact

__all__ = ["StreamRenamer", "rename_answer", "rename_request"]


def rename_request(body: Any, served_name: str) -> Any:
    """The request body (bytes or a dict) with `model` set to `served_name`."""
    if isinstance(body, dict):
        return {**body, "model": served_name}
    if isinstance(body, (bytes, bytearray)):
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # a hostile upstream nests deep
            return body  # not JSON: the server says what it makes of it
        if isinstance(data, dict):
            return compact({**data, "model": served_name})
    return body


def rename_answer(payload: bytes, served_name: str, model: str, wire: Wire = CHAT) -> bytes:
    """A whole JSON answer naming `served_name` as its model, naming `model` instead (wherever
    the answer's family names it)."""
    if served_name.encode() not in payload:
        return payload
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):  # a hostile upstream nests deep
        return payload
    return compact(data) if wire.rename(data, served_name, model) else payload


class StreamRenamer:
    """An event stream's chunks, with the model renamed in every `data:` event, wherever the
    stream's family names it (chat's chunks at the top, `response.model` in a Responses
    event, `message.model` in a Messages one). Chunks split events anywhere: whole lines go
    out, the last partial line waits for the next chunk."""

    def __init__(self, served_name: str, model: str, wire: Wire = CHAT):
        self._served, self._needle, self._model = served_name, served_name.encode(), model
        self._wire = wire
        self._lines = Lines()

    def feed(self, chunk: bytes) -> bytes:
        data, whole = self._lines.feed(chunk)
        if not whole:  # a line that never ends goes out as it is (unrenamed)
            return data
        return b"".join(self._line(line) for line in data.splitlines(keepends=True))

    def flush(self) -> bytes:
        rest = self._lines.flush()
        return self._line(rest) if rest else b""

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:") or self._needle not in line:
            return line
        body = line[5:].strip()
        try:
            event = json.loads(body)
        except (ValueError, RecursionError):  # a hostile upstream nests deep
            return line
        if not self._wire.rename(event, self._served, self._model):
            return line
        ending = line[len(line.rstrip(b"\r\n")):]
        return b"data: " + compact(event) + ending
