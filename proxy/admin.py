"""Admin API: state, load/unload, logs, memory, config and reload. Reads the supervisor's
view; never counts as use."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from corral.supervisor.daemon import Daemon
from corral.supervisor.errors import ShuttingDown


def add_routes(app: web.Application, key: web.AppKey[Daemon]) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"models": request.app[key].describe()})

    async def load(request: web.Request) -> web.Response:
        inst = await request.app[key].load(request.match_info["name"])
        return web.json_response(inst.describe())

    async def unload(request: web.Request) -> web.Response:
        force = request.query.get("force", "").lower() in ("1", "true", "yes")
        inst = await request.app[key].unload(request.match_info["name"], force=force)
        return web.json_response(inst.describe())

    async def logs(request: web.Request) -> web.Response:
        # A replica's own log too: /admin/models/<model>#<n>/logs (the # URL-encoded).
        inst = request.app[key].member(request.match_info["name"])
        try:
            n = max(1, min(int(request.query.get("lines", "200")), 10_000))
        except ValueError:
            raise web.HTTPBadRequest(reason="lines must be an integer") from None
        body: dict[str, Any] = {"model": inst.name, "pid": inst.pid,
                                "lines": inst.process.tail(n) if inst.process else []}
        return web.json_response(body)

    async def memory(request: web.Request) -> web.Response:
        return web.json_response(request.app[key].memory_status())

    async def config(request: web.Request) -> web.Response:
        return web.json_response(request.app[key].config_status())

    async def reload(request: web.Request) -> web.Response:
        daemon = request.app[key]
        if daemon.closing:
            raise ShuttingDown("corral is shutting down")
        # The reload is the daemon's task: a client that hangs up does not stop it halfway.
        attempt = await asyncio.shield(daemon.reload("admin"))
        body: dict[str, Any] = attempt.as_dict()
        if attempt.ok:
            return web.json_response(body)
        # The config on disk is invalid; the running one stays. 422: the request was fine,
        # what it asked to load was not.
        message = "the config is invalid; the running config stays active: " + "; ".join(
            str(i) for i in attempt.issues)
        body["error"] = {"message": message, "type": "invalid_request_error",
                         "code": "invalid_config", "param": None}
        return web.json_response(body, status=422)

    async def rebalance(request: web.Request) -> web.Response:
        daemon = request.app[key]
        # The daemon's task: a client that hangs up does not leave the model stopped.
        inst = await asyncio.shield(daemon.rebalance(request.match_info["name"]))
        return web.json_response(inst.describe())

    async def gguf(request: web.Request) -> web.Response:
        return web.json_response(await request.app[key].gguf_info(request.match_info["name"]))

    app.router.add_post("/admin/models/{name}/rebalance", rebalance)
    app.router.add_get("/admin/models/{name}/gguf", gguf)
    app.router.add_get("/admin/memory", memory)
    app.router.add_get("/admin/config", config)
    app.router.add_post("/admin/reload", reload)
    app.router.add_get("/admin/models", models)
    app.router.add_post("/admin/models/{name}/load", load)
    app.router.add_post("/admin/models/{name}/unload", unload)
    app.router.add_get("/admin/models/{name}/logs", logs)
