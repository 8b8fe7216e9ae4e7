"""The frames between the daemon and its relay workers: a 4-byte length, then a pickle.

Both ends are processes of this user, the socket sits in a 0700 directory of the daemon's
(supervisor/socket_dir.py), and the daemon spawned the workers: nothing else speaks on it,
so pickle (fast, and it carries the config's own objects) is safe here, as it is for
multiprocessing's own connections."""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("corral.proxy.workers")

_LENGTH = struct.Struct("!I")
# A frame at most: a pin carries a request's body (max_body_mb); a snapshot the config.
MAX_FRAME = 1 << 30


class LinkClosed(ConnectionError):
    """The other end went away (or sent what is not a frame)."""


async def read(reader: asyncio.StreamReader) -> Any:
    """The next message. Raises LinkClosed at the end of the stream."""
    try:
        head = await reader.readexactly(_LENGTH.size)
        (size,) = _LENGTH.unpack(head)
        if size > MAX_FRAME:
            raise LinkClosed(f"a frame of {size} bytes")
        data = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkClosed(str(exc) or "closed") from exc
    try:
        return pickle.loads(data)
    except Exception as exc:
        # A class this end cannot import (a plugin's error the other end could), a frame
        # spoilt: the messages in it are lost. The link ends as if the other end went away
        # (a worker is spawned again, its leases given back, its calls failed), said in one
        # line, not as an unpickling traceback out of the reader.
        log.error("relay_link.frame_unreadable", bytes=size,
                  error=f"{type(exc).__name__}: {exc}"[:300])
        raise LinkClosed(f"a frame that could not be read ({type(exc).__name__})") from exc


def write(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue `message` on `writer` (the transport buffers it: no await on the hot path)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(data)) + data)


class Outbox:
    """The messages to one peer, sent once a turn of the event loop, together in one frame (a
    list): a burst of requests makes one pickle and one write for its dozens of leases and
    releases, not one each. read() then returns such a list."""

    __slots__ = ("_dropped", "_flush", "_queued", "_writer")

    def __init__(self, writer: asyncio.StreamWriter,
                 dropped: Callable[[Any, str], None] | None = None) -> None:
        """`dropped`: told of each message that could not be sent (a call then fails)."""
        self._writer = writer
        self._dropped = dropped
        self._queued: list[Any] = []
        self._flush: asyncio.Handle | None = None

    def put(self, message: Any) -> None:
        if self._writer.is_closing():
            return
        self._queued.append(message)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._flush = None
        batch, self._queued = self._queued, []
        if not self._writer.is_closing():
            self._write(batch)

    def _write(self, batch: list[Any]) -> None:
        """`batch` in one frame, else in halves. A frame that cannot be made (a message pickle
        cannot carry: an error with a lock or a lambda in it) or that the peer refuses (past
        MAX_FRAME: a burst of pins of big bodies) lost every message in it, with the others'
        grants and answers: their calls waited for ever, their leases stayed held; and a
        frame too big closed the link (every request of the worker cut). A message that
        cannot go on its own is sent as _carried() says."""
        try:
            data: bytes | None = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            data, failure = None, f"{type(exc).__name__}: {exc}"
        if data is not None and len(data) <= MAX_FRAME:
            self._writer.write(_LENGTH.pack(len(data)) + data)
        elif len(batch) > 1:
            half = len(batch) // 2
            self._write(batch[:half])
            self._write(batch[half:])
        else:
            if data is not None:
                failure = f"{len(data)} bytes, more than a frame carries ({MAX_FRAME})"
            carried = _carried(batch[0], failure)
            if carried is not None:
                write(self._writer, [carried])
            elif self._dropped is not None:
                self._dropped(batch[0], failure)


def _carried(message: Any, failure: str) -> Any:
    """What can be sent of a `message` that cannot go as it is: a call's answer as an error
    of its own class with its message, else as a RuntimeError; a note is dropped (None), and
    logged."""
    if message[0] in ("raise", "reply"):
        kind, args = (message[2][0], message[2][1]) if message[0] == "raise" else (
            RuntimeError, (f"an answer that could not be sent ({failure})",))
        text = " ".join(str(arg) for arg in args)[:2000]
        errors: list[tuple[Any, tuple[str], dict[str, Any]]] = [
            (kind, (text,), {}), (RuntimeError, (f"{kind.__name__}: {text}",), {})]
        for error in errors:
            try:
                pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                continue
            return ("raise", message[1], error)
    log.error("relay_link.message_dropped", kind=str(message[0])[:40], error=failure)
    return None


def error_of(exc: BaseException) -> tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]:
    """An exception as a message: its class, args and attributes (corral's errors take more
    than a message in their constructors, which plain pickling would call with the args)."""
    return type(exc), exc.args, dict(getattr(exc, "__dict__", {}))


def raised(data: tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]) -> BaseException:
    """The exception error_of() described, rebuilt without calling its constructor."""
    kind, args, attributes = data
    exc = kind.__new__(kind)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc
