"""Admin API: state, load/unload, logs, memory, config and reload, pulls. Reads the
supervisor's view; never counts as use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiohttp import web

from corral.proxy import client_io
from corral.proxy.errors import ApiError
from corral.proxy.sse import KEEPALIVE, frame, sse_headers
from corral.proxy.validate import bad, parse_json_object, read_body, require_json
from corral.supervisor import pull as pulling
from corral.supervisor.errors import BadOverride, SettingsDiffer, ShuttingDown
from corral.supervisor.port import Supervisor

# What each refusal of a pull means in HTTP: the request is wrong (400), or it clashes with
# what is there or running (409), or as many pulls run as may (429).
_PULL_REFUSALS: dict[type[pulling.PullError], tuple[int, str, str | None]] = {
    pulling.BadSource: (400, "invalid_source", "source"),
    pulling.NoModelsDir: (400, "no_models_dir", None),
    pulling.ModelExists: (409, "model_exists", "name"),
    pulling.PullRunning: (409, "pull_running", "name"),
    pulling.TooManyPulls: (429, "too_many_pulls", None),
}


# Quiet seconds before a followed log stream sends a keep-alive comment.
_KEEPALIVE_EVERY = 15.0


# Awaited after an applied POST /admin/reload, before its answer (each bounds its own wait).
RELOAD_HOOKS: web.AppKey[list[Callable[[], Awaitable[None]]]] = web.AppKey("reload_hooks",
                                                                           list)


def add_routes(app: web.Application, key: web.AppKey[Supervisor]) -> None:
    app[RELOAD_HOOKS] = []
    async def models(request: web.Request) -> web.Response:
        daemon = request.app[key]
        # `node`: which corral this is, in a fleet (the X-Corral-Node of every answer).
        return web.json_response({"node": daemon.loaded.config.node(),
                                  "models": daemon.describe()})

    async def load(request: web.Request) -> web.Response:
        # A body is optional: {"ctx": 8192, "cache_type_k": "q8_0", ..., "restart": true}
        # sets this load's starts (docs/api.md); none loads the model as configured.
        daemon = request.app[key]
        overrides: dict[str, Any] = {}
        if request.can_read_body:
            require_json(request)
            raw = await read_body(request, request.app[client_io.DEADLINE].seconds())
            overrides = parse_json_object(raw) if raw.strip() else {}
        restart = overrides.pop("restart", False)
        if not isinstance(restart, bool):
            raise bad("'restart' must be true or false", "restart")
        try:
            status = await daemon.load(request.match_info["name"], overrides, restart)
        except BadOverride as exc:
            raise bad(str(exc), exc.param, "invalid_override") from None
        except SettingsDiffer as exc:
            raise ApiError(409, str(exc), "settings_differ") from None
        return web.json_response(daemon.describe_one(status.name))

    async def unload(request: web.Request) -> web.Response:
        force = request.query.get("force", "").lower() in ("1", "true", "yes")
        daemon = request.app[key]
        status = await daemon.unload(request.match_info["name"], force=force)
        return web.json_response(daemon.describe_one(status.name))

    async def logs(request: web.Request) -> web.StreamResponse:
        # A replica's own log too: /admin/models/<model>#<n>/logs (the # URL-encoded).
        try:
            n = min(int(request.query.get("lines", "200")), 10_000)
        except ValueError:
            raise web.HTTPBadRequest(reason="lines must be an integer") from None
        daemon, name = request.app[key], request.match_info["name"]
        if request.query.get("follow", "").lower() in ("1", "true", "yes"):
            # lines=0: only what comes from now on.
            return await _follow(request, daemon.follow_logs(name, max(0, n), _KEEPALIVE_EVERY))
        return web.json_response(daemon.child_logs(name, max(1, n)))

    async def memory(request: web.Request) -> web.Response:
        return web.json_response(request.app[key].memory_status())

    async def prompt_cache(request: web.Request) -> web.Response:
        return web.json_response(request.app[key].prompt_cache_status())

    async def config(request: web.Request) -> web.Response:
        return web.json_response(request.app[key].config_status())

    async def reload(request: web.Request) -> web.Response:
        daemon = request.app[key]
        if daemon.closing:
            raise ShuttingDown("corral is shutting down")
        # The reload is the daemon's task: a client that hangs up does not stop it halfway.
        try:
            attempt = await asyncio.shield(daemon.reload("admin"))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or not daemon.closing:
                raise  # the client hung up
            # The shutdown cancelled the reload (not applied): say so, not a dropped answer.
            raise ShuttingDown("corral is shutting down; the reload was not applied") from None
        body: dict[str, Any] = attempt.as_dict()
        if attempt.ok:
            # What else must hold the new config before the answer says it is applied (the
            # relay workers: a key the reload removed must open nothing once it answered).
            for applied in request.app[RELOAD_HOOKS]:
                await applied()
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
        # The daemon runs it as its own task: a client that hangs up only stops waiting.
        status = await daemon.rebalance(request.match_info["name"])
        return web.json_response(daemon.describe_one(status.name))

    async def gguf(request: web.Request) -> web.Response:
        return web.json_response(await request.app[key].gguf_info(request.match_info["name"]))

    async def start_pull(request: web.Request) -> web.Response:
        daemon = request.app[key]
        if daemon.closing:
            raise ShuttingDown("corral is shutting down")
        require_json(request)
        body = parse_json_object(
            await read_body(request, request.app[client_io.DEADLINE].seconds()))
        source = body.get("source")
        if not isinstance(source, str) or not source.strip():
            raise bad("'source' is required: an http(s) URL or owner/repo:file.gguf", "source",
                      "missing_source")
        name, sha256, force = body.get("name"), body.get("sha256"), body.get("force", False)
        for field, value in (("name", name), ("sha256", sha256)):
            if value is not None and not isinstance(value, str):
                raise bad(f"'{field}' must be a string", field)
            try:
                if field == "name" and value is not None:
                    pulling.model_filename(value)
                elif field == "sha256":
                    pulling.check_sha256(value)
            except pulling.BadSource as exc:
                raise bad(str(exc), field) from None
        if not isinstance(force, bool):
            raise bad("'force' must be true or false", "force")
        try:
            # The download is the daemon's task: a client that hangs up does not stop it.
            job = daemon.pulls.start(source, name=name, sha256=sha256, force=force)
        except pulling.PullError as exc:
            status, code, param = _PULL_REFUSALS.get(type(exc), (400, "invalid_source", None))
            raise ApiError(status, str(exc), code, param=param,
                           kind="rate_limit_error" if status == 429 else "invalid_request_error",
                           ) from None
        return web.json_response({"pull": job.id, "file": job.file, "url": job.url,
                                  "state": job.state}, status=202)

    async def pulls(request: web.Request) -> web.Response:
        return web.json_response(
            {"pulls": [job.as_dict() for job in request.app[key].pulls.jobs()]})

    def job_of(request: web.Request) -> pulling.PullJob:
        job = request.app[key].pulls.get(request.match_info["id"])
        if job is None:
            raise ApiError(404, f"no pull {request.match_info['id'][:100]!r} (GET /admin/pulls "
                           "lists them)", "pull_not_found")
        return job

    async def one_pull(request: web.Request) -> web.Response:
        return web.json_response(job_of(request).as_dict())

    async def cancel_pull(request: web.Request) -> web.Response:
        daemon = request.app[key]
        job = job_of(request)
        daemon.pulls.cancel(job.id)
        # Until its file is closed: a pull started right after may take the same part. (A
        # client that hangs up stops waiting; the cancel goes on, as the puller's task.)
        await daemon.pulls.wait(job.id)
        return web.json_response(job.as_dict())

    app.router.add_post("/admin/pull", start_pull)
    app.router.add_get("/admin/pulls", pulls)
    app.router.add_get("/admin/pulls/{id}", one_pull)
    app.router.add_delete("/admin/pulls/{id}", cancel_pull)
    app.router.add_post("/admin/models/{name}/rebalance", rebalance)
    app.router.add_get("/admin/models/{name}/gguf", gguf)
    app.router.add_get("/admin/memory", memory)
    app.router.add_get("/admin/prompt-cache", prompt_cache)
    app.router.add_get("/admin/config", config)
    app.router.add_post("/admin/reload", reload)
    app.router.add_get("/admin/models", models)
    app.router.add_post("/admin/models/{name}/load", load)
    app.router.add_post("/admin/models/{name}/unload", unload)
    app.router.add_get("/admin/models/{name}/logs", logs)


async def _follow(request: web.Request,
                  batches: AsyncGenerator[dict[str, Any], None]) -> web.StreamResponse:
    """GET /admin/models/<m>/logs?follow=1: one SSE event per batch of lines (`model`, `pid`,
    `lines`, `skipped`), a keep-alive comment for a quiet spell, and a last event with `end`
    (why it ends) when corral shuts down or the model leaves the config."""
    response = web.StreamResponse(headers=sse_headers())
    # A reader that stops reading is cut off after client_write_timeout, like /admin/events'.
    out = client_io.writer(request, response, None)
    try:
        await out.prepare()
        first = True
        async for batch in batches:
            # The first batch always (it says which child, even with no lines yet); later,
            # one without lines is the keep-alive.
            quiet = not (first or batch.get("lines") or batch.get("skipped") or "end" in batch)
            await out.write(KEEPALIVE if quiet else frame(batch))
            first = False
    except client_io.ClientStalled:
        return response  # logged and counted by the writer; the connection is cut
    finally:
        await batches.aclose()
    with contextlib.suppress(ConnectionResetError):
        await out.finish()
    return response
