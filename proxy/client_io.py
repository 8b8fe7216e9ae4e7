"""Writing to a client, the one way: every write has a deadline.

A client that stops reading fills its socket, then the transport's buffer, and a write then
waits for it. Without a bound that wait lasts as long as the connection: the handler keeps its
lease, the model its slot (it never idles out, is never evicted, and the next request queues
behind it until queue_timeout). Here a write waits `client_write_timeout` seconds at most for the
client to take bytes; past that the connection is aborted, `proxy.client_stalled` is logged and
counted, and ClientStalled (a ConnectionResetError, like any hang-up) unwinds the handler: the
upstream request is dropped and the lease released on the way out.

The relay's hot path stays as cheap as aiohttp's own write: a chunk goes into the transport
without waiting, and only when the transport has paused writing (its buffer above the
high-water mark: the client is behind) is there a wait, and only that wait gets a timer.
A relayed stream goes further (through()): its chunks are put into the transport from the
child connection's callback, and the relay's task waits (drain()) only when the client is
behind.

Both fast paths read aiohttp's private writer internals (`protocol.writing_paused`, `chunked`,
`length`, `send_headers`, write's `drain=`), which come and go between releases (3.10 has
neither `send_headers` nor `writing_paused`). The first prepared response checks them once
(internals_missing()); where one is missing every response takes the public path
(StreamResponse.write under the deadline, each write with its own timer), and one log line
(`proxy.relay_public_writes`) names what was missing: slower, never broken. The writer's
per-write hooks that through() would skip (`on_body_write`, 3.14.5 on; `_on_chunk_sent`, older)
are client-side (upload progress, tracing): a writer where either is set, or a release
without them, is checked per response, not required."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web
from aiohttp.http import StreamWriter

log = structlog.get_logger("corral.proxy")

# A whole body goes out in slices of the transport's default high-water mark: each slice is a
# write the client has `client_write_timeout` to make room for, so a slow client that keeps
# reading a large answer is not cut off, and one that reads nothing is.
_SLICE = 64 * 1024
# Room kept below the high-water mark for what aiohttp's write_eof adds to the bytes it is
# given: a response head not sent yet (corral's and a child's heads are well under 1 KiB), a
# chunked answer's last chunk (5 bytes).
_HEADROOM = 16 * 1024


class ClientStalled(ConnectionResetError):
    """The client took no bytes for client_write_timeout seconds: the connection was cut."""


@dataclass(frozen=True)
class WriteDeadline:
    """The app's settings for client writes. `seconds` is read once per response, so a reload
    applies to the responses that begin after it; `stalled` is told the model (None for a
    stream of no model) of each client cut off."""

    seconds: Callable[[], float]
    stalled: Callable[[str | None], None]


DEADLINE: web.AppKey[WriteDeadline] = web.AppKey("client_write_deadline", WriteDeadline)


def internals_missing(stream: object) -> str | None:
    """The first of aiohttp's private writer internals the fast paths use that `stream` (a
    prepared response's writer) lacks, by name; None when it has them all."""
    protocol = getattr(stream, "protocol", None)
    if not isinstance(getattr(protocol, "writing_paused", None), bool):
        return "protocol.writing_paused"
    for name in ("chunked", "length"):
        if not hasattr(stream, name):
            return name
    if not callable(getattr(stream, "send_headers", None)):
        return "send_headers"
    write = getattr(type(stream), "write", None)
    try:
        if write is None or "drain" not in inspect.signature(write).parameters:
            return "write(drain=)"
    except (TypeError, ValueError):  # a builtin without a signature
        return "write(drain=)"
    return None


class _Internals:
    """Whether this process's aiohttp has what the fast paths read: probed on the first
    prepared response's writer (its instance attributes only exist there), once."""

    missing: str | None = None
    probed = False

    @classmethod
    def usable(cls, stream: StreamWriter) -> bool:
        if not cls.probed:
            cls.probed = True
            cls.missing = internals_missing(stream)
            if cls.missing is not None:
                log.warning("proxy.relay_public_writes", missing=cls.missing,
                            aiohttp=aiohttp.__version__,
                            note="aiohttp's writer lacks an internal the relay's fast path "
                                 "reads: every response is written through the public "
                                 "StreamResponse.write (slower, complete)")
        return cls.missing is None


def writer(request: web.Request, response: web.StreamResponse,
           model: str | None) -> ClientWriter:
    """The writer for `response` to `request`'s client, with the app's deadline. `model`: what
    the answer is from (a model or group name), for the log line and the metric."""
    deadline = request.app[DEADLINE]
    return ClientWriter(request, response, model, deadline.seconds(), deadline.stalled)


class ClientWriter:
    """One response to one client. prepare(), write() as often as needed, finish(); each
    raises ClientStalled when the client took nothing for `timeout` seconds."""

    __slots__ = ("_stalled", "_stream", "model", "request", "response", "timeout")

    def __init__(self, request: web.Request, response: web.StreamResponse, model: str | None,
                 timeout: float, stalled: Callable[[str | None], None]) -> None:
        self.request = request
        self.response = response
        self.model = model
        self.timeout = timeout
        self._stalled = stalled
        # aiohttp's writer, once the response is prepared and until it is finished: writes go
        # to it directly so that its drain can be bounded on its own.
        self._stream: StreamWriter | None = None

    async def prepare(self) -> None:
        """Send the head: into the transport, or (a web.Response) kept to go with the body;
        either way nothing waits for the client here. A response already prepared keeps its
        writer."""
        stream = await self.response.prepare(self.request)
        # Another AbstractStreamWriter (none in aiohttp's server today), or an aiohttp without
        # the internals read here, is written through the response, each write under a
        # timer: slower, still bounded.
        self._stream = stream if isinstance(stream, StreamWriter) and _Internals.usable(
            stream) else None

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        stream = self._stream
        if stream is None:
            # Not prepared or already finished (the response raises what it raises then), or
            # a writer of another kind.
            await self._bounded(self.response.write(data))
            return
        # Into the transport without waiting: what the client has not taken stays buffered.
        await stream.write(data, drain=False)
        if stream.protocol.writing_paused:
            # The buffer is past its high-water mark: the client is behind. Wait for it to
            # take some (down to the low-water mark), for `timeout` at most.
            await self._bounded(stream.drain())

    def through(self) -> Callable[[bytes], bool] | None:
        """A write for the relay to call from the child connection's callback, without a task
        or an await per chunk: it puts one chunk of the chunked body into the transport and
        says whether the client is behind (the caller then stops reading its source and waits
        in drain()). It raises ConnectionResetError for a client gone. None when this response
        is not a plain chunked one (compressed, sized, or a writer of another kind)."""
        stream = self._stream
        transport = self.request.transport
        if (stream is None or transport is None or not stream.chunked
                or stream.length is not None or self.response.compression
                or getattr(stream, "on_body_write", None) is not None
                or getattr(stream, "_on_chunk_sent", None) is not None):
            return None
        stream.send_headers()  # the head first, when it is still held back for the body
        # Past the high-water mark the transport pauses the protocol (writing_paused): the
        # same test, without a Python property per chunk.
        high = transport.get_write_buffer_limits()[1]
        size = transport.get_write_buffer_size

        def put(data: bytes) -> bool:
            if transport.is_closing():
                raise ConnectionResetError("the client closed the connection")
            # The chunk's framing and its bytes in one buffer: one send.
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return size() > high

        return put

    async def drain(self) -> None:
        """Wait, for `timeout` at most, until a client that is behind took some bytes."""
        stream = self._stream
        if stream is not None and stream.protocol.writing_paused:
            await self._bounded(stream.drain())

    async def finish(self, pending: int = 0) -> None:
        """The end of the response (a chunked one's last chunk; `pending`: the bytes write_eof
        still has to write, a web.Response's body), under the same deadline. aiohttp's
        write_eof waits for the client only when what it writes takes the transport's buffer
        past the high-water mark: when it cannot, no timer is needed."""
        self._stream = None
        if self._fits(pending) and not self.response.compression:
            await self.response.write_eof()
        else:
            await self._bounded(self.response.write_eof())

    def _fits(self, size: int) -> bool:
        """Whether `size` more bytes (and a head) stay below the transport's high-water mark."""
        transport = self.request.transport
        if transport is None:
            return True  # gone: aiohttp raises at once, without waiting
        high = transport.get_write_buffer_limits()[1]
        return transport.get_write_buffer_size() + size + _HEADROOM <= high

    async def _bounded(self, waiting: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await waiting
        except TimeoutError:
            self._cut_off()
            raise ClientStalled(f"the client took no bytes for {self.timeout:g}s "
                                "(client_write_timeout)") from None
        except ConnectionResetError:
            raise
        except ConnectionError as exc:
            # The connection was lost while the write waited (aiohttp's drain says so with a
            # bare ConnectionError): a client gone, like any other hang-up.
            raise ConnectionResetError(str(exc) or "connection lost") from exc

    def _cut_off(self) -> None:
        self._stream = None
        # The request id comes from the request's structlog context.
        log.warning("proxy.client_stalled", model=self.model, path=self.request.path,
                    seconds=self.timeout)
        self._stalled(self.model)
        transport = self.request.transport
        if transport is not None:
            # Discard what it never took and close now: a close would wait for it to read.
            transport.abort()


async def send(request: web.Request, response: web.StreamResponse,
               model: str | None) -> web.StreamResponse:
    """A whole answer built as a web.Response (a relayed JSON body, an error), written here
    with the deadline instead of by aiohttp after the handler returns (with none): a small one
    as aiohttp would, a large one slice by slice, so that a slow client that keeps reading is
    not cut off. A response already under way (a stream) is returned as it is."""
    if response.prepared or not isinstance(response, web.Response):
        return response
    body = response.body
    if not isinstance(body, bytes):  # a Payload: aiohttp writes it
        return response
    if len(body) <= _SLICE:
        # Sent as aiohttp sends it (head and body in one write); a timer only when the client
        # is behind already.
        out = writer(request, response, model)
        await out.prepare()
        await out.finish(pending=len(body))
        return response
    whole = web.StreamResponse(status=response.status, reason=response.reason,
                               headers=response.headers)
    whole.content_length = len(body)
    out = writer(request, whole, model)
    await out.prepare()
    view = memoryview(body)
    for start in range(0, len(body), _SLICE):
        await out.write(view[start:start + _SLICE])
    await out.finish()
    return whole
