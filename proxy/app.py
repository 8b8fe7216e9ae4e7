"""The aiohttp application: routes, auth, body limits and OpenAI error shapes."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from corral.proxy import admin
from corral.proxy.errors import ApiError, UpstreamFailed, error_response, from_supervisor
from corral.proxy.forward import new_upstream_session, relay
from corral.proxy.group_routes import batch_execute, chain_execute, chat_with_group
from corral.proxy.groups import GroupRunner
from corral.proxy.routing import GroupTarget, exposed_groups, resolve, upstream_body
from corral.supervisor.config import GroupSpec
from corral.supervisor.daemon import Daemon
from corral.supervisor.errors import SupervisorError

log = structlog.get_logger("corral.proxy")

DAEMON: web.AppKey[Daemon] = web.AppKey("daemon", Daemon)
UPSTREAM: web.AppKey[aiohttp.ClientSession] = web.AppKey("upstream", aiohttp.ClientSession)
GROUPS: web.AppKey[GroupRunner] = web.AppKey("groups", GroupRunner)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# OpenAI endpoints relayed to the child as they are.
RELAYED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def create_app(daemon: Daemon) -> web.Application:
    cfg = daemon.loaded.config
    app = web.Application(
        client_max_size=int(cfg.max_body_mb * 1024 * 1024),
        middlewares=[_errors_middleware, _auth_middleware(cfg.api_keys, cfg.admin_api_keys)],
    )
    app[DAEMON] = daemon
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    for path in RELAYED:
        app.router.add_post(path, relay_openai)
    app.router.add_post("/v1/batch/execute", batch)
    app.router.add_post("/v1/chain/execute", chain)
    admin.add_routes(app, DAEMON)
    app.cleanup_ctx.append(_upstream_session)
    return app


async def _upstream_session(app: web.Application) -> Any:
    app[UPSTREAM] = new_upstream_session()
    app[GROUPS] = GroupRunner(app[DAEMON], app[UPSTREAM])
    yield
    await app[UPSTREAM].close()


# -- middlewares -------------------------------------------------------------------------------

@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SupervisorError as exc:
        return from_supervisor(exc)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"request body too large: {exc.text}",
                              code="request_too_large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}",
                              code=exc.reason.lower().replace(" ", "_"))


def _auth_middleware(api_keys: list[str], admin_keys: list[str]) -> Any:
    user = [k.encode() for k in api_keys]
    # Without admin keys, admin falls back to the API keys (or stays open when there are none).
    admin_only = [k.encode() for k in admin_keys] or user

    def allowed(request: web.Request, keys: list[bytes]) -> bool:
        if not keys:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip().encode()
        return scheme.lower() == "bearer" and any(hmac.compare_digest(given, k) for k in keys)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        keys = admin_only if path.startswith("/admin") else user if path.startswith("/v1") else []
        if not allowed(request, keys):
            return error_response(401, "missing or invalid API key (Authorization: Bearer ...)",
                                  code="invalid_api_key")
        return await handler(request)

    return middleware


# -- handlers ----------------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    states = [i["state"] for i in daemon.describe()]
    return web.json_response({
        "status": "shutting_down" if daemon.closing else "ok",
        "models": len(states),
        "ready": states.count("ready"),
    }, status=503 if daemon.closing else 200)


def _model_entry(desc: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": desc["name"],
        "object": "model",
        "created": int(desc["since"]),
        "owned_by": "corral",
        "status": desc["state"],
        "aliases": desc["aliases"],
    }


def _group_entry(group: GroupSpec, created: int) -> dict[str, Any]:
    return {"id": group.name, "object": "model", "created": created, "owned_by": "corral",
            "status": "group", "aliases": [],
            "group": {"type": group.type, "models": list(group.models)}}


async def list_models(request: web.Request) -> web.Response:
    # Read-only: never touches last_used, so a UI polling this keeps nothing alive.
    daemon = request.app[DAEMON]
    models = [_model_entry(d) for d in daemon.describe()]
    created = min((m["created"] for m in models), default=int(time.time()))
    models += [_group_entry(g, created) for g in exposed_groups(daemon).values()]
    return web.json_response({"object": "list", "data": models})


async def get_model(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    target = resolve(daemon, request.match_info["model"])
    if isinstance(target, GroupTarget):
        return web.json_response(_group_entry(target.group, int(time.time())))
    return web.json_response(_model_entry(daemon.instances[target.name].describe()))


async def read_json_body(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body (relayed as is) and its parsed form (read for routing)."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return raw, body


def requested_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "the 'model' field is required (a model name from GET /v1/models)",
                       "missing_model", param="model")
    return model


async def relay_openai(request: web.Request) -> web.StreamResponse:
    daemon = request.app[DAEMON]
    raw, body = await read_json_body(request)
    name = requested_model(body)
    target = resolve(daemon, name)
    if isinstance(target, GroupTarget):
        if request.path != "/v1/chat/completions":
            raise ApiError(400, f"{name!r} is a group; groups answer /v1/chat/completions",
                           "group_endpoint", param="model")
        return await chat_with_group(request, request.app[GROUPS], target.group, body)
    canonical = target.name
    raw = upstream_body(raw, body, canonical)
    lease = await daemon.acquire(canonical)
    try:
        return await relay(request, request.app[UPSTREAM], lease.base_url + request.path, raw,
                           canonical)
    except UpstreamFailed as exc:
        await lease.upstream_broke()
        detail = lease.instance.last_error
        message = f"{exc}" + (f" ({detail})" if detail else "")
        log.warning("proxy.upstream_failed", model=canonical, pid=lease.instance.pid,
                    error=message)
        return error_response(502, message, kind="server_error", code="upstream_failed")
    finally:
        lease.release()


async def batch(request: web.Request) -> web.StreamResponse:
    _, body = await read_json_body(request)
    return await batch_execute(request, request.app[GROUPS], body)


async def chain(request: web.Request) -> web.StreamResponse:
    _, body = await read_json_body(request)
    return await chain_execute(request, request.app[GROUPS], body)
