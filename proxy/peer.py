"""The worker API a head corral talks to (worker mode only; Bearer worker.token): what this
machine has free, and rpc-servers on loan, each kept alive by the head's renewals."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from corral.proxy.errors import error_response
from corral.proxy.validate import bad, parse_json_object, require_json
from corral.supervisor.errors import ShuttingDown
from corral.supervisor.port import Supervisor
from corral.supervisor.rpc.lender import Lender, TooManyLoans
from corral.supervisor.rpc.workers import RpcError

__all__ = ["add_routes"]


def add_routes(app: web.Application, key: web.AppKey[Supervisor]) -> None:
    def lender_of(request: web.Request) -> Lender:
        lender = request.app[key].lender
        assert lender is not None  # the routes exist only in worker mode
        return lender

    async def info(request: web.Request) -> web.Response:
        return web.json_response(await lender_of(request).info())

    async def lend(request: web.Request) -> web.Response:
        daemon = request.app[key]
        if daemon.closing:
            raise ShuttingDown("this worker is shutting down")
        require_json(request)
        body = parse_json_object(await request.read())
        model = body.get("model")
        if not isinstance(model, str) or not 0 < len(model) <= 200:
            raise bad("`model` is the name of the model the rpc-server is for (1-200 chars)",
                      "model")
        lender = lender_of(request)
        try:
            # The loan is the lender's task: a head that hangs up mid-start does not leave
            # an rpc-server nobody knows about (the lease ends it).
            loan, version = await lender.lend(model)
        except TooManyLoans as exc:
            return error_response(429, str(exc), kind="rate_limit_error", code="too_many_loans")
        except RpcError as exc:
            # The message names the rpc-server and its exit code; its output is in our log.
            return error_response(503, str(exc), kind="server_error",
                                  code="rpc_server_failed")
        answer: dict[str, Any] = {"id": loan.id, "host": lender.config.bind, "port": loan.port,
                                  "free": loan.free, "device": loan.device,
                                  "rpc_version": version, "lease": lender.config.lease}
        return web.json_response(answer)

    async def renew(request: web.Request) -> web.Response:
        if not lender_of(request).renew(request.match_info["id"]):
            return error_response(404, "no such rpc-server (it ended)", code="not_found")
        return web.json_response({"ok": True})

    async def end(request: web.Request) -> web.Response:
        lender = lender_of(request)
        ended = await lender.end(request.match_info["id"], "the head released it")
        if not ended:
            return error_response(404, "no such rpc-server", code="not_found")
        return web.json_response({"ok": True})

    app.router.add_get("/peer/info", info)
    app.router.add_post("/peer/rpc-servers", lend)
    app.router.add_post("/peer/rpc-servers/{id}/renew", renew)
    app.router.add_delete("/peer/rpc-servers/{id}", end)
