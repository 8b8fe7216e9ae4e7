"""The relay's HTTP/1.1 client to a child: kept-alive connections over asyncio protocols, the
child's answer parsed by httptools (llhttp, the parser uvicorn uses).

aiohttp's client cost about 150 µs of CPU per relayed request (a request object, the
connector, a write task, per-read timers, a response object with its own stream reader): more
than everything else corral does for the request. The relay needs one thing from a client:
POST a body it already holds, wait for the head, then take the body as it comes, with
back-pressure. That is what this does, in a few calls per request.

Errors say what the relay must know about the child:
- NotBegun: no byte of an answer came: the connection could not be made, or a kept-alive one
  was closed under the request (cpp-httplib closes idle connections after 5 s and every
  connection after 100 requests). Safe to send again while the child is alive.
- Silent: nothing within the wait allowed (the head: first_byte_timeout; then every silence
  in the body: idle_timeout).
- Broken: the connection failed or closed before the answer was whole, or the child sent
  something that is not HTTP.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import cast
from urllib.parse import urlsplit

import httptools

# An idle connection is forgotten after this long. llama-server's cpp-httplib keeps one 5 s
# (CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND): ours is gone well before it could be closed under us.
KEEPALIVE_S = 2.0
CONNECT_TIMEOUT_S = 10.0
# Body bytes buffered from the child before its socket stops being read (the client is
# behind): the child then waits in its own send, as it would for a slow direct client.
_HIGH = 256 * 1024
# A response head's bytes at most (interim answers included): llhttp bounds neither a header's
# length nor their number, and what came is held until the head is whole.
HEAD_LIMIT = 64 * 1024


class ChildHttpError(Exception):
    """The exchange with the child failed; the subclass says how."""


class NotBegun(ChildHttpError):
    """Nothing of the request can have been processed: the connection could not be made
    (`sent` False), or a kept-alive connection from the pool closed with no byte of an answer
    (`sent` True: the child closed it idle as the request went out, as cpp-httplib does after
    5 s or 100 requests). Sent again only while nothing says the child did the work."""

    def __init__(self, message: str, sent: bool = False):
        super().__init__(message)
        self.sent = sent


class Silent(ChildHttpError):
    """The child sent nothing within the wait allowed."""


class Broken(ChildHttpError):
    """The connection failed or closed before the answer was whole."""


@dataclass(frozen=True, slots=True)
class Target:
    key: tuple[str, str, int]  # scheme, host, port: connections are shared per key
    host: str
    port: int
    tls: bool
    host_header: bytes
    prefix: str  # a remote endpoint's URL may carry a path


@lru_cache(maxsize=256)
def target(base_url: str) -> Target:
    """Where a lease's base_url points (parsed once per URL)."""
    parts = urlsplit(base_url)
    tls = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    host_header = shown if port == (443 if tls else 80) else f"{shown}:{port}"
    return Target((parts.scheme, host, port), host, port, tls, host_header.encode("idna"),
                  parts.path.rstrip("/"))


def _head(where: Target, path: str, headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"POST {where.prefix}{path} HTTP/1.1\r\nHost: ".encode(), where.host_header,
             f"\r\nContent-Length: {length}\r\n".encode()]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
    lines.append(b"\r\n")
    return b"".join(lines)


class ChildResponse:
    """One answer from a child: status and headers once the head is in, then the body through
    read() (whole), chunk() (as it comes) or pump() (handed to a sink from the connection's
    callback, with no task woken per chunk). Ends with release() (the connection may serve
    another request) or close() (it is dropped: the child sees the hang-up)."""

    __slots__ = ("_behind", "_buffered", "_chunks", "_conn", "_done", "_error", "_head_waiter",
                 "_idle_timeout", "_last", "_loop", "_sink", "_tail", "_timer", "_waiter",
                 "content_type", "got_bytes", "headers", "keep_alive", "status", "until_eof")

    def __init__(self, conn: _Connection, idle_timeout: float | None) -> None:
        self._conn = conn
        self._idle_timeout = idle_timeout
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_type = ""
        self.got_bytes = False
        self.until_eof = False  # no length and not chunked: the body ends with the connection
        self.keep_alive = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: ChildHttpError | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        # idle_timeout: the time body bytes last came, and one timer that fires at most once
        # per idle_timeout (a timer per read of a stream cost more than the read).
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # pump(): where body bytes go as they come, from the connection's callback.
        self._sink: Callable[[bytes], bool] | None = None
        self._tail: deque[bytes] | None = None
        self._behind = False

    # -- fed by the connection -----------------------------------------------------------------

    def _headed(self, status: int) -> None:
        self.status = status
        self._last = self._loop.time()
        length = chunked = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-type":
                self.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
            elif lower == b"content-length":
                length = True
            elif lower == b"transfer-encoding":
                chunked = True
        # What llhttp reads to the end of the connection; it says nothing at that end.
        self.until_eof = not (length or chunked or status in (204, 304) or status < 200)
        _wake(self._head_waiter)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        if self._sink is not None:
            return  # pump(): handed to the sink when the read is parsed (_flush)
        self._last = self._loop.time()
        self._buffered += len(data)
        if self._buffered > _HIGH:
            self._conn.pause()
        _wake(self._waiter)

    def _complete(self, keep_alive: bool) -> None:
        self._done = True
        self.keep_alive = keep_alive
        self._stop_timer()
        _wake(self._waiter)

    def _flush(self) -> None:
        """pump(): what the last read brought (one read's events in one write) to the sink. The
        sink says the client is behind (True): the child is not read until pump() is called
        again, after the client took some."""
        sink = self._sink
        if sink is None:
            return
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._last = self._loop.time()
        if self._tail is not None:
            self._tail.append(data)
        try:
            behind = sink(data)
        except ConnectionError as exc:
            # The client is gone: pump() raises it, and the relay drops the child's answer.
            self._sink = None
            self._conn.pause()
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)
            return
        if behind:
            self._sink = None
            self._behind = True
            self._conn.pause()
            _wake(self._waiter)

    def _fail(self, error: ChildHttpError) -> None:
        if self._done:
            return
        self._done = True
        self._error = error
        self._stop_timer()
        for waiter in (self._head_waiter, self._waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)

    # -- read by the relay ---------------------------------------------------------------------

    async def _head(self, timeout: float | None) -> None:
        if self.status or self._error is not None:
            if self._error is not None and not self.status:
                raise self._error
            return
        self._head_waiter = self._loop.create_future()
        try:
            await _wait(self._head_waiter, timeout, "before its response head")
        finally:
            self._head_waiter = None

    async def chunk(self) -> bytes:
        """The body bytes that came since the last call (waiting for some); b"" at the end."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return b""
            self._waiter = self._loop.create_future()
            if self._idle_timeout is not None and self._timer is None:
                if not self._last:
                    self._last = self._loop.time()  # the head's arrival starts the first wait
                self._timer = self._loop.call_at(self._last + self._idle_timeout, self._idle)
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._conn.resume():  # everything buffered is taken: read the child again
            # Its silence counts from now: it was not read while the client was behind.
            self._last = self._loop.time()
        return data

    async def pump(self, sink: Callable[[bytes], bool],
                   tail: deque[bytes] | None = None) -> bool:
        """Body bytes handed to `sink` as they come, from the connection's callback: no task
        wakes per chunk. Returns at the end (False), or when `sink` said the client is behind
        (True): the child is not read until the next call, which the caller makes once the
        client took some. Raises what chunk() raises, and what `sink` raised (a client gone).
        The idle timer runs as for chunk(). `tail`: each piece is also appended to it (a
        bounded deque: the relay reads the usage from the last events)."""
        self._behind = False
        self._tail = tail
        if self._chunks:
            self._buffered = 0
            data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            if tail is not None:
                tail.append(data)
            if sink(data):
                self._conn.pause()
                return True
        if self._conn.resume():
            self._last = self._loop.time()  # not read while the client was behind
        if self._done:
            if self._error is not None:
                raise self._error
            return False
        self._sink = sink
        self._waiter = self._loop.create_future()
        if self._idle_timeout is not None and self._timer is None:
            if not self._last:
                self._last = self._loop.time()
            self._timer = self._loop.call_at(self._last + self._idle_timeout, self._idle)
        try:
            await self._waiter
        finally:
            self._waiter = None
            self._sink = None
        if self._behind:
            return True
        if self._chunks:  # came with the end, after the sink was taken away
            return await self.pump(sink, tail)
        return False

    def _idle(self) -> None:
        """The idle timer: a reader waiting and nothing for idle_timeout fails it (Silent);
        bytes came since the timer was set: it is set again from when they came."""
        self._timer = None
        if self._done or self._idle_timeout is None:
            return
        due = self._last + self._idle_timeout
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._idle)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(
                Silent(f"nothing for {self._idle_timeout:g}s in its answer"))
        # No reader waiting (the client is slow): its next wait sets the timer again.

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; past `limit` bytes, Broken (the connection closed: the rest of an
        endless answer is never read)."""
        parts: list[bytes] = []
        size = 0
        while True:
            data = await self.chunk()
            if not data:
                return b"".join(parts)
            size += len(data)
            if limit is not None and size > limit:
                self.close()
                raise Broken(f"its answer passed {limit} bytes (max_answer_mb)")
            parts.append(data)

    def release(self) -> None:
        """Done with the answer: a whole, kept-alive exchange leaves the connection pooled."""
        self._conn.finished(self, reuse=self._done and self._error is None and self.keep_alive
                            and self.content_type != "text/event-stream")

    def close(self) -> None:
        self._fail(Broken("closed by corral"))
        self._conn.finished(self, reuse=False)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


async def _wait(waiter: asyncio.Future[None], timeout: float | None, what: str) -> None:
    if timeout is None:
        await waiter
        return
    # One timer per wait, and only for a wait: a chunk already buffered costs none.
    timer = asyncio.get_running_loop().call_later(
        timeout, _time_out, waiter, f"nothing for {timeout:g}s {what}")
    try:
        await waiter
    finally:
        timer.cancel()


def _time_out(waiter: asyncio.Future[None], message: str) -> None:
    if not waiter.done():
        waiter.set_exception(Silent(message))


class _Connection(asyncio.Protocol):
    """One connection to a child: one request at a time, kept for the next while whole."""

    def __init__(self, pool: ChildPool, where: Target) -> None:
        self.pool = pool
        self.where = where
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: ChildResponse | None = None
        self.idle_since = 0.0
        self.closed = False
        self.reused = False  # taken from the pool for this request (not made for it)
        self._interim = False  # the message being parsed is a 1xx interim answer
        self._paused = False
        self._head_bytes = 0  # read for the current request before its head was whole

    # -- asyncio ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.close()  # bytes nobody asked for: this connection is no longer in step
            return
        response.got_bytes = True
        if not response.status:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(Broken(f"the child's answer is not valid HTTP: {exc}"))
            self.close()
            return
        if not response.status and self._head_bytes > HEAD_LIMIT:
            # Still no whole head (a read that ends it may carry body bytes: not counted).
            response._fail(Broken(f"its response head passed {HEAD_LIMIT // 1024} KiB"))
            self.close()
            return
        if response._sink is not None and response._chunks:
            response._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is None:
            self.pool._forget(self)  # idle: a child that closed it (or is gone) leaves no entry
        response = self.response
        if response is None or response._done:
            return
        if not response.got_bytes and self.reused:
            response._fail(NotBegun("the kept-alive connection closed before the answer began"
                                    if exc is None else f"{exc}", sent=True))
        elif not response.got_bytes:
            # A new connection that took the request and closed: it may have done the work
            # (a paid request), so it is never sent again.
            response._fail(Broken("the connection closed after the request was sent, before "
                                  "any answer" if exc is None else f"{exc}"))
        elif response.status and response.until_eof and exc is None:
            response._complete(keep_alive=False)
        else:
            response._fail(Broken("the connection closed before the answer was complete"
                                  if exc is None else f"{exc}"))

    # -- httptools ----------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (100 Continue, 103 Early Hints): never the answer. Its headers
            # go; the final answer follows on the same connection. 101 would switch protocols,
            # which a relay of HTTP answers cannot follow.
            response.headers.clear()
            self._interim = True
            if status == 101:
                response._fail(Broken("the child switched protocols (101)"))
                self.close()
            return
        self._interim = False
        response._headed(status)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False  # the interim answer ended; the final one comes next
            return
        if self.response is not None:
            self.response._complete(self.parser.should_keep_alive())

    # -- the pool's -----------------------------------------------------------------------------

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> bool:
        """Read the child again, if paused (True then)."""
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
            return True
        return False

    async def send(self, head: bytes, body: bytes, first_byte_timeout: float | None,
                   idle_timeout: float | None) -> ChildResponse:
        assert self.transport is not None
        response = self.response = ChildResponse(self, idle_timeout)
        self._head_bytes = 0
        # Head and body as they are (one writev): a body of the client's size is not copied.
        self.transport.writelines((head, body))
        try:
            await response._head(first_byte_timeout)
        except BaseException:
            self.close()
            raise
        return response

    def finished(self, response: ChildResponse, reuse: bool) -> None:
        if self.response is not response:
            return
        self.response = None
        if reuse and not self.closed and not self._paused:
            self.idle_since = time.monotonic()
            self.pool._keep(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class ChildPool:
    """The relay's connections to children, kept alive per host and port."""

    def __init__(self, keepalive: float = KEEPALIVE_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.keepalive = keepalive
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                   first_byte_timeout: float | None = None,
                   idle_timeout: float | None = None) -> ChildResponse:
        """POST `body` to base_url + path; the answer once its head is in."""
        where = target(base_url)
        head = _head(where, path, headers, len(body))
        conn = self._take(where)
        if conn is None:
            conn = await self._connect(where)
        return await conn.send(head, body, first_byte_timeout, idle_timeout)

    def _take(self, where: Target) -> _Connection | None:
        idle = self._idle.get(where.key)
        if not idle:
            return None
        fresh = time.monotonic() - self.keepalive
        while idle:
            conn = idle.pop()  # the most recent first: the least likely to be closed
            if not conn.closed and conn.idle_since > fresh:
                conn.reused = True
                return conn
            conn.close()
        return None

    def _keep(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.where.key, [])
        idle.append(conn)
        if len(idle) > 256:  # more than any burst needs: the oldest go
            idle.pop(0).close()

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.where.key)
        if idle is None:
            return
        if conn in idle:
            idle.remove(conn)
        if not idle:
            del self._idle[conn.where.key]  # a stopped child's port leaves no list behind

    async def _connect(self, where: Target) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if where.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, where), where.host, where.port, ssl=tls)
        except TimeoutError as exc:
            raise NotBegun(f"could not connect to {where.host}:{where.port} within "
                           f"{self.connect_timeout:g}s") from exc
        except OSError as exc:
            raise NotBegun(f"could not connect to {where.host}:{where.port}: "
                           f"{exc.strerror or exc}") from exc
        return conn

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
