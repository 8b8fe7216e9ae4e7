"""The frames between the daemon and its relay workers: a 4-byte length, then a pickle.

Both ends are processes of this user, the socket sits in a 0700 directory of the daemon's
(supervisor/socket_dir.py), and the daemon spawned the workers: nothing else speaks on it,
so pickle (fast, and it carries the config's own objects) is safe here, as it is for
multiprocessing's own connections."""

from __future__ import annotations

import asyncio
import pickle
import struct
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
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkClosed(str(exc) or "closed") from exc


def write(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue `message` on `writer` (the transport buffers it: no await on the hot path)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(data)) + data)


class Outbox:
    """The messages to one peer, sent once a turn of the event loop, together in one frame (a
    list): a burst of requests makes one pickle and one write for its dozens of leases and
    releases, not one each. read() then returns such a list."""

    __slots__ = ("_flush", "_queued", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
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
        if self._writer.is_closing():
            return
        try:
            write(self._writer, batch)
        except Exception:
            # One message pickle cannot carry (an error with a lock or a lambda in it) lost
            # the whole frame, with the others' grants and answers: their calls waited for
            # ever. Then each goes as it can (_carried).
            carried = (_carried(message) for message in batch)
            write(self._writer, [message for message in carried if message is not None])


def _carried(message: Any) -> Any:
    """`message`, or what pickle can carry of it: a call's answer as an error of its own
    class with its message, else as a RuntimeError; a note that cannot go is dropped (None),
    and logged."""
    try:
        pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return message
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
        if message[0] in ("raise", "reply"):
            kind, args = (message[2][0], message[2][1]) if message[0] == "raise" else (
                RuntimeError, (f"an answer that could not be sent ({failure})",))
            text = " ".join(str(arg) for arg in args)
            for error in ((kind, (text,), {}), (RuntimeError, (f"{kind.__name__}: {text}",), {})):
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
