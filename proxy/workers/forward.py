"""What a relay worker does not serve itself goes to the daemon as it came: the admin API,
/metrics, events, the status page, groups, mounts, a model without a ready child (its start,
its loading progress), over a Unix socket to the daemon's own app.

The request is passed on whole (method, the path as sent, every header but the connection's
own, the body as it streams), the daemon checks and accounts for it as for any other, and
its answer comes back as it streams."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import hdrs, web
from aiohttp.streams import StreamReader
from multidict import CIMultiDict
from yarl import URL

from corral.proxy import client_io, request_id
from corral.proxy.app import COUNTED_AS_HEADER
from corral.proxy.errors import error_response

log = structlog.get_logger("corral.proxy.worker")

# Per-connection headers (RFC 9110 §7.6.1), and the ones aiohttp writes for each message.
_REQUEST_HOPS = frozenset({"connection", "keep-alive", "proxy-authorization",
                           "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                           "content-length"})
_ANSWER_HOPS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                          "date", "server", COUNTED_AS_HEADER.lower()})
# Whether a forwarded answer's head went out to the client.
_STARTED: web.RequestKey[bool] = web.RequestKey("forward_started", bool)
# A forwarded request may stream as long as the client's does (events, logs -f): no total.
_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10)


async def _as_it_comes(content: StreamReader) -> AsyncIterator[bytes]:
    """A client's body as it streams, after an empty first piece. aiohttp's client holds a
    request's head back until its body's first bytes (to send both in one write); an empty
    piece sends the head alone. The daemon must have the head at once: it routes the request
    (a path it lacks: a 404 without the body) and times the body (a 408 after
    client_write_timeout, a 413 on the length announced) as it does a client's own. Held
    back, a client that announced a body and sent none held a forwarded slot and a daemon
    connection until the daemon's idle timeout (75 s), then got a 503 saying corral was
    restarting."""
    yield b""
    async for chunk in content.iter_any():
        yield chunk


class ToDaemon:
    """The worker's one client to the daemon's Unix socket (connections kept and reused).

    At most `limit` requests forwarded at once: each holds a descriptor of the daemon's, and
    the workers together may hold many more client connections than the daemon alone would
    take (its cap keeps a reserve of its descriptors for its children, files and pipes:
    proxy/listener.py). Past it, a 503 at once; without it, a few hundred event streams or
    cold-model requests took every descriptor the daemon had: starts, the memory watch and
    every other forwarded request failed (Too many open files)."""

    def __init__(self, path: str, limit: int) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=path, limit=0),
            timeout=_TIMEOUT, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        self.limit = limit
        self.open = 0
        self._full_since: float | None = None  # said once per time it fills

    def refusal(self) -> web.Response | None:
        """The answer to a request that would pass the limit; None while there is room."""
        if self.open < self.limit:
            self._full_since = None
            return None
        if self._full_since is None:
            self._full_since = time.monotonic()
            log.warning("relay_worker.forwards_full", limit=self.limit,
                        note="as many requests forwarded to the daemon as its share of its "
                             "descriptors allows; more get a 503 until some end")
        return error_response(
            503, "corral is answering as many requests of this kind as it can take at once; "
                 "retry shortly", kind="server_error", code="too_many_connections",
            retry_after=1)

    async def close(self) -> None:
        await self._session.close()

    async def forward(self, request: web.Request, body: bytes | None, rid: str | None,
                      model: str | None = None) -> web.StreamResponse:
        """`request` to the daemon and its answer back; `body`: read already (else streamed
        from the client); `rid`: the request id the worker chose, which the daemon keeps;
        `model`: the model or group the answer is for, when known (a client cut off for
        stalling is counted under it: the worker, not the daemon, writes to the client).
        Counted against `limit` (refusal() said there was room) until it ends."""
        self.open += 1
        try:
            return await self._forward(request, body, rid, model)
        finally:
            self.open -= 1

    async def _forward(self, request: web.Request, body: bytes | None, rid: str | None,
                       model: str | None) -> web.StreamResponse:
        headers: CIMultiDict[str] = CIMultiDict(
            (name, value) for name, value in request.headers.items()
            if name.lower() not in _REQUEST_HOPS)
        if rid is not None:
            headers[request_id.HEADER] = rid
        if "Host" not in headers:
            # HTTP/1.0 without Host (a load balancer's health check): the daemon sees none
            # either (an empty one, which HTTP/1.1 asks for), not aiohttp's own `corral`, a
            # name corral does not answer to (a 403 host_not_allowed).
            headers["Host"] = ""
        data: object = body
        if body is None and request.body_exists:
            data = _as_it_comes(request.content)
            if request.content_length is not None:
                # The length as announced (an iterator alone goes chunked): the daemon
                # refuses one past its limit at once, as it does a client's own.
                headers[hdrs.CONTENT_LENGTH] = str(request.content_length)
        target = request.raw_path
        if not target.startswith("/"):
            # The absolute form (GET http://host/path: RFC 9112 3.2.2), which the daemon
            # alone routes on its path: the path and query, not the whole URL as a path.
            target = request.rel_url.raw_path_qs
        try:
            return await self._exchange(request, target, headers, data, model)
        except aiohttp.ClientError as exc:
            # The daemon went away under it (its shutdown, a crash): not a bug of corral's.
            if request.get(_STARTED):
                log.info("relay_worker.forward_cut", path=request.path, error=str(exc))
                # The head is out: the client must see the answer cut, not whole.
                raise ConnectionResetError("the daemon closed the forwarded answer") from exc
            log.warning("relay_worker.forward_failed", path=request.path, error=str(exc))
            return error_response(
                503, "corral is restarting or shutting down; retry shortly",
                kind="server_error", code="daemon_unavailable", retry_after=1)

    async def _exchange(self, request: web.Request, target: str,
                        headers: CIMultiDict[str], data: object,
                        model: str | None) -> web.StreamResponse:
        async with self._session.request(
                request.method, URL("http://corral" + target, encoded=True),
                headers=headers, data=data, allow_redirects=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type",
                                   "Accept")) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _ANSWER_HOPS:
                    response.headers.add(name, value)
            if upstream.content_length is not None and \
                    "chunked" not in upstream.headers.get("Transfer-Encoding", "").lower():
                response.content_length = upstream.content_length
            # Each write under the client's deadline (client_write_timeout), as the daemon's;
            # a stall counted under what the daemon counts the request under.
            model = upstream.headers.get(COUNTED_AS_HEADER, model)
            out = client_io.writer(request, response, model)
            await out.prepare()
            request[_STARTED] = True
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.finish()
            return response
