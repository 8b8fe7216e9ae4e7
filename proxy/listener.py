"""corral's listening socket: how aiohttp's server is set up against clients that hold on.

Every client connection takes a file descriptor, and so do corral's connections to its
children, the watchdog's /health probes, the children's pipes and every file the daemon
writes. Without a bound, one client that opens connections and sends nothing (or a head a byte
at a time) takes them all: at RLIMIT_NOFILE the watchdog's probes fail with EMFILE and every
child is killed as unresponsive, the memory loop fails, and no client is served. So:

- client connections are capped below the descriptor limit (`connection_limit`): a reserve
  stays for the daemon's own work. A connection accepted at the cap is cut at once (the
  client sees a reset and may retry), and the oldest connections are asked to close (after
  the request each may have in flight), so that idle keep-alive connections make room;
- a connection that sends no request (or no whole head) within `IDLE_S` of its accept or of
  its last answer is closed (aiohttp's keep-alive timer, which also runs before the first
  request; aiohttp's own default, without web.run_app, is an hour);
- a malformed request head (two Content-Lengths, Content-Length with Transfer-Encoding, a
  header too long, too many headers, a control byte in a value) gets a 400 in the OpenAI error
  shape (aiohttp's own is plain text, which SDKs cannot read) and the connection closed, as
  HTTP demands, with one debug line: anyone can send those, and aiohttp logs each with a
  traceback at ERROR.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any

import structlog
from aiohttp import http_exceptions, web

from corral.proxy.errors import error_response

log = structlog.get_logger("corral.proxy")

# How long a connection may sit without a whole request head: between requests, and before
# the first. nginx's keepalive_timeout and client_header_timeout are 75 s and 60 s.
IDLE_S = 75.0
# Descriptors kept for the daemon itself at the cap: its children (a pipe or two each, the
# relay's and the watchdog's connections), the state and cache files, the config watchers.
_RESERVE_MIN = 128
# The accept queue's length (nginx's default is 511).
BACKLOG = 1024
# Idle connections closed per accept at the cap, and how many connections one accept looks at.
_EVICT = 1
_WINDOW = 64


def connection_limit(soft: int | None = None) -> int:
    """Client connections served at once: below the process's descriptor limit, with a
    reserve of a quarter of it (at least _RESERVE_MIN) for the daemon's own descriptors."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - max(_RESERVE_MIN, soft // 4))


class _QuietParseErrors(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, with a client's malformed request (a 4xx it answers below the
    app) at debug without its traceback; anything else as aiohttp logs it."""

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        if not _malformed(exc_info):
            super().exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        if not _malformed(kwargs.get("exc_info")):  # a first request not HTTP (TLS, a scan)
            super().debug(msg, *args, **kwargs)


def _malformed(exc: object) -> bool:
    """Whether `exc` is a client's malformed request, logged here as one line if so."""
    if not isinstance(exc, http_exceptions.HttpProcessingError) \
            or not 400 <= (exc.code or 400) < 500:
        return False
    log.debug("proxy.bad_http", error=type(exc).__name__, reason=str(exc.message)[:200])
    return True


class _OpenAIShapedErrors(web.RequestHandler):
    """aiohttp's connection handler, with the answers it makes below the app (a malformed
    head, a handler that raised past corral's middleware) in the OpenAI error shape."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's own first: it logs (quietly, above), and raises if an answer was begun.
        super().handle_error(request, status, exc, message)
        if 400 <= status < 500:
            text = f"malformed HTTP request: {message or 'bad request'}"
            shaped = error_response(status, text[:300], code="bad_http_request")
        else:
            shaped = error_response(status, "the request failed inside corral",
                                    kind="server_error", code="internal_error")
        shaped.force_close()
        return shaped


def _handler(server: web.Server) -> web.RequestHandler:
    """A new connection's handler, as `server()` makes it but of _OpenAIShapedErrors: its
    settings are a private field of aiohttp's Server; a release without it gets aiohttp's own
    handler (plain-text errors, nothing else lost)."""
    settings = getattr(server, "_kwargs", None)
    loop = getattr(server, "_loop", None)
    if isinstance(settings, dict) and loop is not None:
        try:
            return _OpenAIShapedErrors(server, loop=loop, **settings)
        except TypeError:
            pass
    return server()


def runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The app's runner with corral's settings for client connections."""
    return web.AppRunner(app, keepalive_timeout=IDLE_S,
                         logger=_QuietParseErrors(logging.getLogger("aiohttp.server"), {}),
                         **kwargs)


def hold_port(host: str, port: int) -> list[socket.socket]:
    """host:port bound, not listening, for the relay workers to listen on (SO_REUSEPORT, this
    user's processes only): a port in use fails here, at the daemon's start, and nothing of
    another user's can take it while corral runs. A socket that does not listen is given no
    connections: they all go to the workers. Every address the host names, as asyncio's
    create_server binds them (IPv6 ones v6-only). Raises OSError."""
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


class Listener:
    """Serves `app_runner`'s app on host:port with at most `limit` client connections (the
    rest cut at once; None: connection_limit() at each accept, so a descriptor limit raised
    while corral runs, with prlimit, applies). A site of its own rather than web.TCPSite: the
    cap needs the accept, and aiohttp offers no hook there."""

    def __init__(self, app_runner: web.AppRunner, host: str, port: int,
                 limit: int | None = None, reuse_port: bool = False) -> None:
        """`reuse_port`: the port is shared with the relay workers (SO_REUSEPORT: the kernel
        spreads new connections over every socket bound to it)."""
        self._runner = app_runner
        self._reuse_port = reuse_port
        self._host = host
        self._port = port
        self.limit = limit
        self._server: asyncio.Server | None = None
        self.refused = 0
        self._window = 0  # where the next look for idle connections starts

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # A burst of hundreds of streams connects at once: a short accept queue (asyncio's
        # default is 100, web.TCPSite's 128) drops SYNs past it, and a dropped SYN costs the
        # client a 1 s retransmit before its first token. The kernel caps it at somaxconn.
        self._server = await loop.create_server(self._protocol, self._host, self._port,
                                                reuse_address=True, backlog=BACKLOG,
                                                reuse_port=self._reuse_port or None)

    async def stop(self) -> None:
        """No new connections; open ones stay, for the runner's shutdown."""
        if self._server is not None:
            self._server.close()

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None, "the runner is set up before the listener starts"
        connections = server.connections  # oldest first
        limit = connection_limit() if self.limit is None else self.limit
        if len(connections) < limit or self._evict_idle(connections):
            return _handler(server)
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("proxy.connections_full", limit=limit, refused=self.refused,
                        note="client connections at the cap, none idle: new ones are cut")
        return _Refused()

    def _evict_idle(self, connections: list[web.RequestHandler]) -> bool:
        """At the cap: close up to _EVICT idle connections (between requests, or with no whole
        head yet) in a window that moves on with each call, so that the cost of an accept
        stays bounded however many connections there are. Whether any was closed."""
        count = len(connections)
        if not count:
            return False
        start = self._window % count
        self._window += _WINDOW
        evicted = 0
        for handler in connections[start:start + _WINDOW]:
            if _idle(handler):
                handler.force_close()  # its descriptor is freed on the loop's next turn
                evicted += 1
                if evicted == _EVICT:
                    break
        return evicted > 0


def _idle(handler: web.RequestHandler) -> bool:
    """Whether `handler` waits for a request (its head not whole, or none begun): aiohttp's
    own test in its keep-alive timer, on a private field; where a release lacks it, no
    connection counts as idle and the cap only refuses."""
    waiter = getattr(handler, "_waiter", None)
    return isinstance(waiter, asyncio.Future) and not waiter.done()


class _Refused(asyncio.Protocol):
    """A connection over the cap: cut as soon as it is made (its descriptor freed)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.Transport):
            transport.abort()
        else:
            transport.close()
