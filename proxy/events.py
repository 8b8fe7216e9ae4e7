"""GET /admin/events: the daemon's events as Server-Sent Events (state changes, loads with
their progress, stops and why, reloads, group outcomes, requests); GET /admin/requests: the
latest requests with their timings. Both read the daemon's bus and never count as use."""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from aiohttp import web

from corral.proxy.accounting import Accounting
from corral.proxy.sse import KEEPALIVE, named, sse_headers
from corral.supervisor.port import Supervisor

_KEEPALIVE_EVERY = 15.0
_WRITE_TIMEOUT = 30.0

log = structlog.get_logger("corral.proxy")


def add_routes(app: web.Application, daemon_key: web.AppKey[Supervisor],
               accounting_key: web.AppKey[Accounting]) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        bus = request.app[daemon_key].events
        kinds = request.query.get("kinds")
        wanted = frozenset(k for k in kinds.split(",") if k) if kinds else None
        # A reconnecting EventSource says where it stopped; ?since= does the same by hand.
        after = _int(request.headers.get("Last-Event-ID") or request.query.get("since"))
        sub = bus.subscribe(after=after, kinds=wanted)
        response = web.StreamResponse(headers=sse_headers())

        async def send(data: bytes) -> None:
            # A reader that stops reading (its socket buffer full) must not pin this handler.
            async with asyncio.timeout(_WRITE_TIMEOUT):
                await response.write(data)

        try:
            await response.prepare(request)
            await send(b"retry: 2000\n\n")
            while True:
                try:
                    event = await sub.next(_KEEPALIVE_EVERY)
                except StopAsyncIteration:
                    break
                if event is None:
                    await send(KEEPALIVE)
                    continue
                await send(named(event.id, event.kind, event.as_dict()))
            if sub.lagged:
                # Fell a whole queue behind: told, and cut off; EventSource reconnects with
                # Last-Event-ID and the history replays what it can.
                # No id: the reader's last id stays the last event it got.
                await send(b'event: lagged\ndata: {"kind": "lagged"}\n\n')
        except TimeoutError:
            log.info("events.reader_stuck", seconds=_WRITE_TIMEOUT)
            return response  # aiohttp drops the connection: nothing more can be written
        finally:
            bus.unsubscribe(sub)
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            async with asyncio.timeout(_WRITE_TIMEOUT):
                await response.write_eof()
        return response

    async def recent(request: web.Request) -> web.Response:
        given = _int(request.query.get("limit"))
        limit = max(1, min(100 if given is None else given, 1000))
        return web.json_response(
            {"requests": request.app[accounting_key].recent_requests(limit)})

    app.router.add_get("/admin/events", stream)
    app.router.add_get("/admin/requests", recent)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
