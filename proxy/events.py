"""GET /admin/events: the daemon's events as Server-Sent Events (state changes, loads with
their progress, stops and why, reloads, group outcomes, requests), from now on, or after the
id a reconnecting reader saw, or after the `?last=N` most recent ones; GET /admin/requests:
the latest requests with their timings. Both read the daemon's bus and never count as use."""

from __future__ import annotations

import contextlib

from aiohttp import web

from corral.proxy import client_io
from corral.proxy.accounting import MOST_RECENT, Accounting
from corral.proxy.sse import KEEPALIVE, named, sse_headers
from corral.proxy.validate import bad
from corral.supervisor.port import Supervisor

_KEEPALIVE_EVERY = 15.0
# The most events `?last=` replays: the bus's history (supervisor/events.py) holds 500.
_MOST_REPLAYED = 500


def add_routes(app: web.Application, daemon_key: web.AppKey[Supervisor],
               accounting_key: web.AppKey[Accounting]) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        bus = request.app[daemon_key].events
        kinds = request.query.get("kinds")
        wanted = frozenset(k for k in kinds.split(",") if k) if kinds else None
        # A reconnecting EventSource says where it stopped; ?since= does the same by hand.
        after = _int(request.headers.get("Last-Event-ID") or request.query.get("since"))
        # A new reader (the status page's first connection) may start with what just
        # happened; a reconnecting one gets what it missed instead (above).
        last = _int(request.query.get("last", "0"))
        if last is None or not 0 <= last <= _MOST_REPLAYED:
            raise bad(f"last must be an integer from 0 to {_MOST_REPLAYED}", "last")
        sub = bus.subscribe(after=after, kinds=wanted, last=last)
        response = web.StreamResponse(headers=sse_headers())
        # A reader that stops reading (its socket buffer full) must not pin this handler nor
        # its subscription: client_write_timeout, then it is cut off.
        out = client_io.writer(request, response, None)
        send = out.write
        try:
            await out.prepare()
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
        except client_io.ClientStalled:
            return response  # logged and counted by the writer; the connection is cut
        finally:
            bus.unsubscribe(sub)
        with contextlib.suppress(ConnectionResetError):
            await out.finish()
        return response

    async def recent(request: web.Request) -> web.Response:
        given = _int(request.query.get("limit"))
        limit = max(1, min(100 if given is None else given, MOST_RECENT))
        return web.json_response(
            {"requests": request.app[accounting_key].recent_requests(limit)})

    app.router.add_get("/admin/events", stream)
    app.router.add_get("/admin/requests", recent)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
