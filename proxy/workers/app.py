"""A relay worker's aiohttp app: the daemon's own middleware and model relay, over the
daemon's snapshot; what it does not serve itself goes to the daemon (forward.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web

from corral.proxy import client_io
from corral.proxy.accounting import RECORD, RequestAccounts, log_request
from corral.proxy.app import (
    CHILDREN,
    DAEMON,
    EDGE,
    FORWARDED,
    RELAYABLE,
    REQUEST_ID,
    front_middleware,
    read_json_body,
    relay_to_model,
    send_request_id,
)
from corral.proxy.child_http import ChildPool
from corral.proxy.edge import Edge
from corral.proxy.metrics import model_label
from corral.proxy.timing import RequestRecord
from corral.proxy.workers.forward import ToDaemon
from corral.proxy.workers.remote import Link, RemoteDaemon
from corral.supervisor.port import Supervisor

TO_DAEMON: web.AppKey[ToDaemon] = web.AppKey("to_daemon", ToDaemon)
# POST /v1/* paths that are the daemon's alone: groups run there, with their reservations.
_DAEMON_ONLY = frozenset({"/v1/batch/execute", "/v1/chain/execute", "/v1/models"})
_MODELS = "/v1/models/"  # the daemon's GET routes (a POST there is its 405, not a relay)


class ShippedAccounts(RequestAccounts):
    """A worker's records, finished here and booked by the daemon (metrics, the recent list,
    the log line, the `request` event), sent a loop's turn later in one frame with the
    others finished meanwhile. A forwarded request is the daemon's to account for."""

    def __init__(self, daemon: Supervisor, link: Link, index: int) -> None:
        self._daemon = daemon
        self._index = index
        self._link = link
        self._pending: list[tuple[RequestRecord, bool]] = []
        self._flush: asyncio.Handle | None = None
        self._forwarded: set[int] = set()

    def forwarded(self, record: RequestRecord) -> None:
        self._forwarded.add(id(record))

    def finish(self, record: RequestRecord, status: int, refused: bool = False) -> None:
        if id(record) in self._forwarded:
            self._forwarded.discard(id(record))
            return
        record.finish(status)
        record.model = model_label(self._daemon, record.model)
        record.worker = self._index
        if record.status != 401 and not refused:
            log_request(record.as_dict())  # here, beside the others, not on the daemon's core
        self._pending.append((record, refused))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._flush = None
        batch, self._pending = self._pending, []
        self._link.note("records", batch)


def create_worker_app(remote: RemoteDaemon, link: Link, to_daemon: ToDaemon,
                      listen_host: str, index: int) -> web.Application:
    # The part of the port a worker's requests reach (remote.py): reads and leases.
    daemon = cast(Supervisor, remote)
    accounts = ShippedAccounts(daemon, link, index)
    edge = Edge(lambda: remote.loaded.config, listen_host)
    app = web.Application(
        client_max_size=int(remote.loaded.config.max_body_mb * 1024 * 1024),
        handler_args={"auto_decompress": False},
        middlewares=[front_middleware(daemon, accounts, edge)])
    app[DAEMON] = daemon
    app[EDGE] = edge
    app[TO_DAEMON] = to_daemon
    app[_ACCOUNTS] = accounts
    app[client_io.DEADLINE] = client_io.WriteDeadline(
        seconds=lambda: remote.loaded.config.client_write_timeout,
        stalled=lambda model: link.note("stalled", model))
    app.on_response_prepare.append(send_request_id)
    app.router.add_post("/v1/{path:.+}", _served)
    app.router.add_route("*", "/{tail:.*}", _forwarded)
    app.cleanup_ctx.append(_children)
    return app


_ACCOUNTS: web.AppKey[ShippedAccounts] = web.AppKey("accounts", ShippedAccounts)


async def _children(app: web.Application) -> Any:
    app[CHILDREN] = ChildPool()
    yield
    app[CHILDREN].close()


async def _served(request: web.Request) -> web.StreamResponse:
    """A model request: relayed from here when its model has a ready child, else the
    daemon's (a start, loading progress, a group, an unknown name: its answers)."""
    path = request.path
    if path in _DAEMON_ONLY or path.startswith(_MODELS) or not RELAYABLE.fullmatch(path):
        return await _forwarded(request)
    raw, body = await read_json_body(request)
    daemon = request.app[DAEMON]
    name = body.get("model")
    canonical = daemon.resolve(name) if isinstance(name, str) else None
    if canonical is None or not daemon.ready_now(canonical):
        # What the daemon's answer is for (a model, an exposed group): a client that stalls
        # on it is counted under that, as by the daemon alone.
        label = canonical
        if label is None and isinstance(name, str) and name in daemon.groups():
            label = name
        return await _forwarded(request, raw, label)
    record = request[RECORD]
    record.model = canonical
    record.stream = body.get("stream") is True
    return await relay_to_model(request, raw, body, canonical, loading_progress=False)


async def _forwarded(request: web.Request, body: bytes | None = None,
                     model: str | None = None) -> web.StreamResponse:
    to_daemon = request.app[TO_DAEMON]
    full = to_daemon.refusal()
    if full is not None:
        return full  # the worker's own answer, headed and accounted for here
    request[FORWARDED] = True
    record = request.get(RECORD)
    if record is not None:
        request.app[_ACCOUNTS].forwarded(record)
    return await to_daemon.forward(request, body, request.get(REQUEST_ID), model)
