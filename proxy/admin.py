"""Admin API: state, load/unload, logs. Reads the supervisor's view; never counts as use."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from corral.supervisor.daemon import Daemon


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
        inst = request.app[key].instance(request.match_info["name"])
        try:
            n = max(1, min(int(request.query.get("lines", "200")), 10_000))
        except ValueError:
            raise web.HTTPBadRequest(reason="lines must be an integer") from None
        body: dict[str, Any] = {"model": inst.name, "pid": inst.pid,
                                "lines": inst.process.tail(n) if inst.process else []}
        return web.json_response(body)

    app.router.add_get("/admin/models", models)
    app.router.add_post("/admin/models/{name}/load", load)
    app.router.add_post("/admin/models/{name}/unload", unload)
    app.router.add_get("/admin/models/{name}/logs", logs)
