"""What models there are, in the shapes clients read: OpenAI's `GET /v1/models` (plus
corral's state, capabilities and file facts), and llama.cpp router mode's `GET /models`,
`POST /models/load`, `POST /models/unload`, which Open WebUI's llama.cpp connection uses to show
which models are loaded and to load or unload them. Listing never counts as use."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from corral.proxy.access import ADMIN
from corral.proxy.client_io import DEADLINE
from corral.proxy.errors import ApiError, method_not_allowed
from corral.proxy.routing import GroupTarget, exposed_groups, resolve
from corral.proxy.validate import parse_json_object, read_body, require_json
from corral.supervisor.config import GroupSpec
from corral.supervisor.model.overrides import FIELDS as LOAD_FIELDS
from corral.supervisor.port import ModelStatus, State, Supervisor

# corral's states in llama.cpp router's words. A failed model is "unloaded" with `failed`:
# llama.cpp's shape, which Open WebUI and other router clients read.
_ROUTER_VALUE = {
    State.READY: "loaded", State.DRAINING: "loaded", State.STARTING: "loading",
    State.STOPPING: "unloaded", State.STOPPED: "unloaded", State.FAILED: "unloaded",
}


def model_entry(daemon: Supervisor, model: ModelStatus) -> dict[str, Any]:
    state = model.state
    status: dict[str, Any] = {"value": _ROUTER_VALUE[state]}
    if state is State.FAILED:
        # The reason stays in the admin API: it may quote the child's log.
        status["failed"] = True
    entry: dict[str, Any] = {
        "id": model.name,
        "object": "model",
        "created": int(model.since),
        "owned_by": "corral",
        "status": status,
        "state": str(state),
        "loaded": status["value"] == "loaded",
        "aliases": list(model.spec.aliases),
        "capabilities": list(model.spec.capabilities),
        "backend": model.spec.backend,
    }
    if model.answering is not None:  # a remote: did its last request succeed
        entry["answering"] = model.answering
    # The GGUF file's facts (architecture, parameters, quantization, native context), read
    # once per file by the daemon: absent for a moment after a start or reload.
    meta = daemon.inventory(model.name)
    if meta is not None:
        entry["meta"] = meta
    return entry


def group_entry(daemon: Supervisor, group: GroupSpec, created: int) -> dict[str, Any]:
    members = [daemon.status(m) for m in group.models if daemon.resolve(m) is not None]
    loaded = bool(members) and all(m.state is State.READY for m in members)
    return {"id": group.name, "object": "model", "created": created, "owned_by": "corral",
            "status": {"value": "loaded" if loaded else "unloaded"}, "state": "group",
            "loaded": loaded, "aliases": [], "capabilities": ["chat"],
            "group": {"type": group.type, "models": list(group.models)}}


def _entries(daemon: Supervisor) -> list[dict[str, Any]]:
    models = [model_entry(daemon, model) for model in daemon.statuses()]
    created = min((m["created"] for m in models), default=int(time.time()))
    return models + [group_entry(daemon, g, created) for g in exposed_groups(daemon).values()]


async def _read_only(request: web.Request) -> web.Response:
    return method_not_allowed(request.method, request.path, "GET, HEAD")


def add_routes(app: web.Application, key: web.AppKey[Supervisor]) -> None:
    async def list_models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": _entries(request.app[key])})

    async def get_model(request: web.Request) -> web.Response:
        daemon = request.app[key]
        target = resolve(daemon, request.match_info["model"])
        if isinstance(target, GroupTarget):
            return web.json_response(group_entry(daemon, target.group, int(time.time())))
        return web.json_response(model_entry(daemon, daemon.status(target.name)))

    async def load(request: web.Request) -> web.Response:
        daemon = request.app[key]
        for name in await _named(request, daemon, refuse=LOAD_FIELDS):
            daemon.load_soon(name)
        return web.json_response({"success": True})

    async def unload(request: web.Request) -> web.Response:
        daemon = request.app[key]
        for name in await _named(request, daemon):
            # A user key may not stop what the operator pins, nor cut others' requests.
            daemon.unload_soon(name, admin=request[ADMIN])
        return web.json_response({"success": True})

    app.router.add_get("/v1/models", list_models)
    # Read-only: any other method is a 405 here, whatever its body (a POST must not reach
    # the catch-all relay below, which would parse it and look for a model).
    app.router.add_route("*", "/v1/models", _read_only)
    app.router.add_get("/v1/models/{model:.+}", get_model)  # ids from subfolders have a "/"
    app.router.add_route("*", "/v1/models/{model:.+}", _read_only)
    # llama.cpp router mode's management API, outside /v1 as there.
    app.router.add_get("/models", list_models)
    app.router.add_post("/models/load", load)
    app.router.add_post("/models/unload", unload)


async def _named(request: web.Request, daemon: Supervisor,
                 refuse: tuple[str, ...] = ()) -> list[str]:
    """The models a load/unload body names: `{"model": name}` (a model, an alias, or a group
    exposed as a model: its members). A field of `refuse` is a 400: an admin load's override
    here would be ignored, and the issue's rule is that none is ever ignored silently."""
    require_json(request)
    body = parse_json_object(await read_body(request, request.app[DEADLINE].seconds()))
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "the 'model' field is required (an id from GET /models)",
                       "missing_model", param="model")
    target = resolve(daemon, name)  # first: the message below quotes a name that exists
    for field in refuse:
        if field in body:
            raise ApiError(400, f"{request.path} loads a model as configured: '{field}' is a "
                           f"load override, which only an admin load takes (POST "
                           f"/admin/models/{name}/load)", "invalid_override", param=field)
    if isinstance(target, GroupTarget):
        return list(target.group.models)
    return [target.name]
