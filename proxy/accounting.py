"""Every model request accounted for once, however it ends: one log line, the metrics, the
recent-requests list (GET /admin/requests, the status page) and a `request` event."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from corral.proxy.capabilities import POSTED
from corral.proxy.edge import REFUSED
from corral.proxy.metrics import UNKNOWN_MODEL, Metrics, model_label
from corral.proxy.mount import inner_path
from corral.proxy.timing import RequestRecord
from corral.supervisor.port import Supervisor

log = structlog.get_logger("corral.proxy")

RECORD: web.RequestKey[RequestRecord] = web.RequestKey("record", RequestRecord)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# nginx's "client closed request": the client hung up before the answer was whole.
CLIENT_GONE = 499
# The requests GET /admin/requests lists at most (its ?limit=), all of them kept: a list of
# fewer cut the limit short without saying so.
MOST_RECENT = 1000


class RequestAccounts:
    """A model request's record, finished once however the request ends: the daemon books it
    (Accounting), a relay worker ships it to the daemon (proxy/workers)."""

    def finish(self, record: RequestRecord, status: int, refused: bool = False) -> None:
        """`refused`: by the edge (a web page's request: proxy/edge.REFUSED)."""
        raise NotImplementedError

    async def account(self, request: web.Request,
                      answer: Callable[[web.Request, Handler], Awaitable[web.StreamResponse]],
                      handler: Handler) -> web.StreamResponse:
        """`answer(request, handler)`, accounted for once however it ends (a model request:
        POST /v1/...)."""
        record = RequestRecord(UNKNOWN_MODEL, _endpoint(request))
        request[RECORD] = record
        try:
            response = await answer(request, handler)
        except asyncio.CancelledError:
            # A client that hangs up once the stream's last event is in (while the relay
            # waits for the child's end of it) got the answer whole: not a 499.
            self.finish(record, 200 if record.delivered() else CLIENT_GONE)
            raise
        except web.HTTPException as exc:
            self.finish(record, exc.status)
            raise
        except BaseException:
            self.finish(record, 500)
            raise
        status = response.status
        if status == CLIENT_GONE and record.delivered():
            status = 200  # its last write failed, after the whole answer went out
        self.finish(record, status, refused=request.get(REFUSED, False))
        return response



class Accounting(RequestAccounts):
    def __init__(self, daemon: Supervisor, keep: int = MOST_RECENT) -> None:
        self.daemon = daemon
        self.metrics = Metrics(daemon)
        self.recent: collections.deque[RequestRecord] = collections.deque(maxlen=keep)

    def finish(self, record: RequestRecord, status: int, refused: bool = False) -> None:
        record.finish(status)
        # A client's string never becomes a label or a key.
        record.model = model_label(self.daemon, record.model)
        self.book(record, refused)

    def book(self, record: RequestRecord, refused: bool, logged: bool = False) -> None:
        """A finished record, labelled: counted, and (unless refused) logged, listed and
        published. A relay worker's records are booked here too, as they arrive (`logged`:
        the worker wrote its log line, off the daemon's one core)."""
        self.metrics.observe(record)
        if record.status == 401 or refused:
            return  # counted; an anonymous flood writes no log line, event or list entry
        self.recent.append(record)
        summary = record.as_dict()
        if not logged:
            log_request(summary)
        self.daemon.events.publish("request", history=False, **summary)

    def recent_requests(self, limit: int) -> list[dict[str, Any]]:
        return [r.as_dict() for r in list(self.recent)[-limit:]]


def log_request(summary: dict[str, Any]) -> None:
    """A request's one `proxy.request` line (RequestRecord.as_dict's figures)."""
    log.info("proxy.request", **{k: v for k, v in summary.items()
                                 if v is not None and k != "time"})


# Any other path a client sends counts as "other": a made-up path never becomes a label.


def _endpoint(request: web.Request) -> str:
    # A model's mount (/w/<name>/v1/...) counts under the top-level path it stands for.
    path = inner_path(request) or request.path
    return path if path in POSTED else "other"
