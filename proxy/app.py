"""The aiohttp application: routes, auth, body limits and OpenAI error shapes."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from corral.proxy import (
    admin,
    capabilities,
    client_io,
    events,
    filters,
    history,
    models_api,
    peer,
    progress,
    request_id,
    ui,
)
from corral.proxy import mount as model_mount
from corral.proxy.access import ADMIN, CALLER
from corral.proxy.accounting import RECORD, Accounting, RequestAccounts
from corral.proxy.child_http import ChildPool
from corral.proxy.edge import REFUSED as EDGE_REFUSED
from corral.proxy.edge import Edge
from corral.proxy.errors import (
    ApiError,
    UpstreamFailed,
    child_error,
    error_response,
    http_error,
    method_not_allowed,
    shape_of,
)
from corral.proxy.forward import relay
from corral.proxy.group_routes import GROUP_FAMILIES, batch_execute, chain_execute, group_as_model
from corral.proxy.groups import GroupRunner
from corral.proxy.routing import GroupTarget, resolve, upstream_body
from corral.proxy.upstream import leased
from corral.proxy.validate import (
    check_fields,
    check_messages,
    parse_json_object,
    read_body,
    require_json,
)
from corral.supervisor.config import split_listen
from corral.supervisor.errors import ShuttingDown, StartFailed, SupervisorError
from corral.supervisor.port import CALLER as PINNED_FOR
from corral.supervisor.port import Supervisor

log = structlog.get_logger("corral.proxy")

DAEMON: web.AppKey[Supervisor] = web.AppKey("daemon", Supervisor)
ACCOUNTING: web.AppKey[Accounting] = web.AppKey("accounting", Accounting)
# The one client to children: the relay's and the groups' connections.
CHILDREN: web.AppKey[ChildPool] = web.AppKey("children", ChildPool)
GROUPS: web.AppKey[GroupRunner] = web.AppKey("groups", GroupRunner)
EDGE: web.AppKey[Edge] = web.AppKey("edge", Edge)
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
NODE_HEADER = "X-Corral-Node"
# Whether the response's head went out (a stream began): no second response after that.
STARTED: web.RequestKey[bool] = web.RequestKey("started", bool)

# A relay worker's request that the daemon answers (proxy/workers/forward.py): the daemon
# accounts for it and heads its answer.
FORWARDED: web.RequestKey[bool] = web.RequestKey("forwarded", bool)
# On the daemon's answer to a forwarded request (it came over the workers' Unix socket): the
# model or group the daemon counts it under, which the worker, who writes it to the client,
# counts a stalled client under too (a group's /v1/batch, a model that was loading). The
# worker takes it off.
COUNTED_AS_HEADER = "X-Corral-Counted-As"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]



def create_app(daemon: Supervisor, listen_host: str | None = None) -> web.Application:
    """`listen_host`: the address served (`serve --listen` may override the config's): a
    Host header naming it is corral's own."""
    cfg = daemon.loaded.config
    accounting = Accounting(daemon)
    edge = Edge(lambda: daemon.loaded.config,
                listen_host if listen_host is not None else split_listen(cfg.listen)[0])
    app = web.Application(
        client_max_size=int(cfg.max_body_mb * 1024 * 1024),
        # Bodies arrive as sent: a Content-Encoding aiohttp cannot decode (br without Brotli)
        # would otherwise be refused below the middlewares, in plain text. read_json_body
        # refuses compressed bodies itself, in the OpenAI shape.
        handler_args={"auto_decompress": False},
        middlewares=[front_middleware(daemon, accounting, edge)],
    )
    app[DAEMON] = daemon
    app[EDGE] = edge
    app[ACCOUNTING] = accounting
    # Read per response: a reload's new client_write_timeout applies to the next ones.
    app[client_io.DEADLINE] = client_io.WriteDeadline(
        seconds=lambda: daemon.loaded.config.client_write_timeout,
        stalled=accounting.metrics.client_stalled)
    app.on_response_prepare.append(send_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", accounting.metrics.handler)
    models_api.add_routes(app, DAEMON)
    app.router.add_post("/v1/batch/execute", batch)
    app.router.add_post("/v1/chain/execute", chain)
    # Any other POST /v1/* whose body names a model goes to that model's child: chat,
    # completions, embeddings, responses, rerank, Anthropic-style messages, and whatever else
    # the child implements.
    app.router.add_post("/v1/{path:.+}", relay_openai)
    # Any other method: a 405 on the paths that answer POST, else simply not there.
    app.router.add_route("*", "/v1/{path:.+}", _not_posted)
    # Each model's and exposed group's own mount, /w/<quoted name>/...: a router that takes
    # one model per worker URL (smg) sees one worker per model of this node.
    model_mount.add_routes(app, DAEMON, relay_openai, STARTED, health)
    admin.add_routes(app, DAEMON)
    events.add_routes(app, DAEMON, ACCOUNTING)
    history.add_routes(app, daemon)
    ui.add_routes(app)
    if daemon.lender is not None:
        peer.add_routes(app, DAEMON)
    app.cleanup_ctx.append(_upstream_session)
    return app


async def _upstream_session(app: web.Application) -> Any:
    app[CHILDREN] = ChildPool()
    app[GROUPS] = GroupRunner(app[DAEMON], app[CHILDREN])
    yield
    app[CHILDREN].close()


# -- middlewares -------------------------------------------------------------------------------

def front_middleware(daemon: Supervisor, accounting: RequestAccounts, edge: Edge) -> Any:
    """Every request's way in, outermost first: its id (X-Request-Id, bound to every log line),
    the accounting of a model request, answers in the OpenAI error shape for whatever goes
    wrong, the edge (Host, Origin, content type: proxy/edge.py) and the API keys. One aiohttp
    middleware rather than five: each costs a partial, a coroutine and an await per request,
    and they have no order to change."""
    ids = request_id.Ids()
    refused = auth_check(daemon)

    async def guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            # Compared with None: a response is a mapping (its own state), falsy when empty.
            denied = edge.refusal(request)
            if denied is None:
                denied = refused(request)
            if denied is not None:
                return denied
            # The leases this request takes (a group's members too) pin in its caller's
            # namespace of the prompt cache.
            token = PINNED_FOR.set(request.get(CALLER))
            try:
                return await handler(request)
            finally:
                PINNED_FOR.reset(token)
        except Exception as exc:
            if request.get(STARTED) and not isinstance(exc, ConnectionResetError):
                # The status line and part of the body are out: a second response would land
                # inside this one's body. Logged; aiohttp closes the connection.
                log.exception("proxy.failed_mid_response", method=request.method,
                              path=request.path)
                raise
            return _error_answer(request, exc)

    @web.middleware
    async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = ids.choose(request.headers.get(request_id.HEADER))
        request[REQUEST_ID] = rid
        token = ids.bind(rid)
        try:
            if request.method == "POST" and request.path.startswith(_MODEL_REQUESTS):
                return await accounting.account(request, guarded, handler)
            return await guarded(request, handler)
        finally:
            ids.unbind(token)

    return front


# POSTs to these are model requests, accounted for: the top level's and the mounts'.
_MODEL_REQUESTS = ("/v1/", model_mount.PREFIX)


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # A signal, not the middleware: a streamed response sends its headers before the
    # handler returns.
    request[STARTED] = True
    if request.get(FORWARDED):
        return  # a relay worker's: the daemon's answer, which has these already
    request.app[EDGE].add_cors(request, response)
    ui.guard_answer(request, response)
    # Which node answered: behind a router (docs/fleet.md), where the request ran. Not on
    # the edge's refusals: the host name is not a web page's to read (edge.REFUSED).
    if not request.get(EDGE_REFUSED):
        response.headers[NODE_HEADER] = request.app[DAEMON].loaded.config.node()
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[request_id.HEADER] = rid
    record = request.get(RECORD)
    if record is not None and record.model is not None and _from_a_worker(request):
        response.headers[COUNTED_AS_HEADER] = record.model


def _from_a_worker(request: web.Request) -> bool:
    """Whether `request` came over the relay workers' Unix socket (a TCP client's sockname
    is a tuple)."""
    transport = request.transport
    return transport is not None and isinstance(transport.get_extra_info("sockname"), str)


def _error_answer(request: web.Request, exc: Exception) -> web.StreamResponse:
    if isinstance(exc, (SupervisorError, UpstreamFailed)):
        return _failure(request.app[DAEMON], exc)
    if isinstance(exc, ApiError):
        return exc.response()
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return error_response(413, f"request body too large: {exc.text}",
                              code="request_too_large")
    if isinstance(exc, web.HTTPMethodNotAllowed):  # the router's, on a path of fixed methods
        return method_not_allowed(request.method, request.path, exc.headers["Allow"])
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}",
                              code=exc.reason.lower().replace(" ", "_"))
    if isinstance(exc, ConnectionResetError):
        # The client hung up while we wrote to it: nobody to answer, and nothing upstream
        # is to blame. 499 is nginx's "client closed request", for the record only.
        log.info("proxy.client_gone", method=request.method, path=request.path)
        return web.Response(status=499)
    # A bug. The client gets the OpenAI shape and the request id; the daemon log gets the
    # traceback under the same id.
    log.error("proxy.unhandled", method=request.method, path=request.path,
              exc_info=exc)
    return error_response(500, "internal error in corral", kind="server_error",
                          code="internal_error")


def _failure(daemon: Supervisor, exc: SupervisorError | UpstreamFailed) -> web.Response:
    if daemon.closing and isinstance(exc, (UpstreamFailed, StartFailed)):
        # Its child was stopped by the shutdown, not broken: try again (elsewhere) later.
        log.info("proxy.stopped_by_shutdown", error=str(exc))
        exc = ShuttingDown("corral is shutting down")
    shape = shape_of(exc)
    if shape.status >= 500:
        log.warning("proxy.request_failed", status=shape.status, code=shape.code,
                    error=str(exc))
    return http_error(exc)


def auth_check(daemon: Supervisor) -> Callable[[web.Request], web.Response | None]:
    """The keys' check: None when `request` may go on (and request[ADMIN] set), else the 401."""
    # The keys of the config active now (a reload may change them), worked out once per config.
    cache: dict[str, Any] = {}

    def key_sets() -> tuple[list[bytes], list[bytes], list[bytes]]:
        cfg = daemon.loaded.config
        if cache.get("config") is not cfg:
            user = [k.get_secret_value().encode() for k in cfg.api_keys]
            # Without admin keys, admin falls back to the API keys (or stays open when there
            # are none).
            admin_only = [k.get_secret_value().encode() for k in cfg.admin_api_keys] or user
            # An admin key opens /v1 too: the operator may do what users do, and run every
            # group.
            v1 = user + admin_only if user else []
            # Worker mode: heads send worker.token (required, so never open).
            worker = [cfg.worker.token.get_secret_value().encode()] if cfg.worker.token \
                else [b"\0never"]
            # Each key's name for the prompt cache's namespaces: a digest, so the key itself
            # goes no further than this check (the cache salts the name again).
            names = {k: hashlib.sha256(b"corral-caller\0" + k).hexdigest() for k in v1}
            cache.update(config=cfg, keys=(admin_only, v1, worker), names=names)
        keys: tuple[list[bytes], list[bytes], list[bytes]] = cache["keys"]
        return keys

    def matched(request: web.Request, keys: list[bytes]) -> bytes | None:
        """The key of `keys` the request carries (b"" when none are needed), else None."""
        if not keys:
            return b""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            text = token.strip()
        else:
            # Anthropic's SDKs and Claude Code (ANTHROPIC_API_KEY) send the key as x-api-key.
            # Like Authorization, a header no web page can send without asking first.
            text = request.headers.get("x-api-key", "").strip()
            if not text:
                return None
        # The bytes as sent: aiohttp decoded bytes that are not UTF-8 to surrogates, which a
        # strict encode raised on (a 500, a traceback per request, for anyone).
        given = text.encode("utf-8", "surrogateescape")
        return next((k for k in keys if hmac.compare_digest(given, k)), None)

    def allowed(request: web.Request, keys: list[bytes]) -> bool:
        return matched(request, keys) is not None

    def refused(request: web.Request) -> web.Response | None:
        path = request.path
        admin_only, v1, worker = key_sets()
        # /metrics says what runs and what it holds: the operator's, like /admin. /models:
        # llama.cpp router's management API, which Open WebUI calls with its /v1 key.
        if path.startswith("/admin") or path == "/metrics":
            keys = admin_only
        elif path.startswith(("/v1/", "/models")) or path == "/v1" or (
                path.startswith(model_mount.PREFIX) and not model_mount.open_path(request)):
            keys = v1
        else:
            keys = worker if path.startswith("/peer") else []
            if path.startswith(model_mount.PREFIX):  # a mount's health: open, per model with a key
                request[model_mount.ANONYMOUS] = bool(v1) and matched(request, v1) is None
        key = matched(request, keys)
        if key is None:
            return error_response(401, "missing or invalid API key (Authorization: Bearer ... "
                                       "or x-api-key: ...)",
                                  code="invalid_api_key")
        request[ADMIN] = keys is admin_only or allowed(request, admin_only)
        request[CALLER] = cache["names"].get(key) if keys is v1 else None
        return None

    return refused


# -- handlers ----------------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    states = [i["state"] for i in daemon.describe()]
    return web.json_response({
        "status": "shutting_down" if daemon.closing else "ok",
        "models": len(states),
        "ready": states.count("ready"),
    }, status=503 if daemon.closing else 200)




async def _not_posted(request: web.Request) -> web.StreamResponse:
    if request.path in capabilities.POSTED:
        return method_not_allowed(request.method, request.path, "POST")
    raise web.HTTPNotFound()


async def read_json_body(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The raw body (relayed as is) and its parsed form (read for routing)."""
    require_json(request)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(400, f"Content-Encoding {encoding[:40]!r} is not accepted: send the JSON "
                       "body uncompressed", "unsupported_content_encoding")
    raw = await read_body(request, request.app[client_io.DEADLINE].seconds())
    return raw, parse_json_object(raw)


def requested_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "the 'model' field is required (a model name from GET /v1/models)",
                       "missing_model", param="model")
    return model


# The paths relayed to a child: /v1/ and plain segments. No dot segments, no percent
# signs, no query: a path that the client (or yarl) would normalise into another endpoint of
# the child (/v1/../slots) never leaves corral.
RELAYABLE = re.compile(r"/v1(?:/[A-Za-z0-9_-]+)+")


async def relay_openai(request: web.Request, mount: str | None = None) -> web.StreamResponse:
    """POST /v1/*; `mount`: the model (or group) whose mount it came in by (proxy/mount.py),
    which the body's `model` must name, or stands for when the body has none."""
    daemon = request.app[DAEMON]
    record = request[RECORD]
    if not RELAYABLE.fullmatch(request.path):
        raise web.HTTPNotFound()
    raw, body = await read_json_body(request)
    if mount is not None:
        record.model = mount  # a refusal below counts under the model it came in by
        mounted = model_mount.checked_body(daemon, mount, body)
        if mounted is not body:  # the mount's name went in: the child must see it too
            raw, body = upstream_body(raw, mounted, mounted["model"], changed=True), mounted
    name = requested_model(body)
    record.model = name
    record.stream = body.get("stream") is True
    target = resolve(daemon, name)
    if isinstance(target, GroupTarget):
        family = GROUP_FAMILIES.get(request.path)
        if family is None:
            raise ApiError(400, f"{name!r} is a group; groups answer /v1/chat/completions, "
                           "/v1/responses and /v1/messages", "group_endpoint", param="model")
        try:
            return await group_as_model(request, request.app[GROUPS], target.group, body,
                                        family)
        except ApiError as exc:
            # The group ran the request as chat: a Responses client sent `input`.
            if family == "responses" and (exc.param or "").startswith("messages"):
                exc.param = "input"
            raise
    return await relay_to_model(request, raw, body, target.name)


async def relay_to_model(request: web.Request, raw: bytes, body: dict[str, Any],
                         canonical: str, loading_progress: bool = True) -> web.StreamResponse:
    """A request for one configured model (`canonical`), its body read (`raw`, parsed
    `body`): checked against the model's spec and relayed to a child of it (the daemon's
    way and a relay worker's: proxy/workers, which leaves `loading_progress` to the daemon)."""
    daemon, record = request.app[DAEMON], request[RECORD]
    record.model = canonical
    spec = daemon.spec(canonical)
    # Only what its backend serves (proxy/capabilities.py): a 404 before anything starts.
    capabilities.refuse_path(spec, request.path)
    # What the child would choke on (some of it with a 500) is refused here, clearly.
    check_fields(body, request.path)
    if request.path == "/v1/chat/completions":
        check_messages(body, required=False)
    # Refused here, before anything starts: the child would answer 501 only after loading.
    capabilities.check(spec, request.path, body)
    filtered = filters.apply(body, spec.request, request.path)
    raw = upstream_body(raw, filtered, canonical, changed=filtered is not body)
    body = filtered
    if loading_progress and not daemon.ready_now(canonical) \
            and progress.wanted(request, body, spec.loading_progress):
        return await _relay_after_progress(request, canonical, raw)
    async with leased(daemon, canonical) as lease:
        record.leased(lease)
        # request.path was checked against RELAYABLE above.
        response = await relay(request, request.app[CHILDREN], raw, canonical, lease, record,
                               parsed=_as_sent(body, canonical),
                               answer_limit=_answer_limit(daemon))
    # A whole answer is written once the lease is back: a slow client holds no slot.
    return await client_io.send(request, _documented(response, canonical), canonical)


def _answer_limit(daemon: Supervisor) -> int:
    return int(daemon.loaded.config.max_answer_mb * 1024 * 1024)


def _as_sent(body: dict[str, Any], canonical: str) -> dict[str, Any]:
    """What the body relayed (upstream_body's bytes) parses to, without parsing it again."""
    return body if body.get("model") == canonical else {**body, "model": canonical}


async def _relay_after_progress(request: web.Request, model: str,
                                raw: bytes) -> web.StreamResponse:
    """A streamed chat request for a cold model, opted in to loading progress: once the wait
    lasts, the stream opens with the load's progress, and the answer follows in it. Failures
    after that are error events in the stream (the status line is gone)."""
    daemon, record = request.app[DAEMON], request[RECORD]
    stream = progress.ProgressStream(request, model)
    try:
        async with leased(daemon, model, stream.acquire(daemon)) as lease:
            record.leased(lease)
            response = await relay(request, request.app[CHILDREN], raw, model, lease, record,
                                   started=stream.out if stream.opened else None,
                                   answer_limit=_answer_limit(daemon))
    except ConnectionResetError:
        raise  # the client is gone (or was cut off): nobody to tell, in a stream or not
    except (SupervisorError, UpstreamFailed) as exc:
        if not stream.opened:
            raise  # refused before the stream began: the plain error response
        shape = shape_of(exc)
        record.error_status = shape.status
        log.warning("proxy.request_failed", status=shape.status, code=shape.code,
                    error=str(exc), after="loading progress")
        return await stream.fail(str(exc), shape.code)
    except Exception:
        if not stream.opened:
            raise
        # A bug after the stream began: said in the stream, never a second response.
        log.exception("proxy.unhandled", method=request.method, path=request.path)
        record.error_status = 500
        return await stream.fail("internal error in corral", "internal_error")
    return await client_io.send(request, _documented(response, model), model)


def _documented(response: web.StreamResponse, model: str) -> web.StreamResponse:
    """A child's whole (unstreamed) error answer or redirect, reshaped: our error shape, our
    statuses."""
    if response.prepared or response.status < 300 or not isinstance(response, web.Response):
        return response
    body = response.body if isinstance(response.body, bytes) else b""
    if response.status >= 500:
        log.warning("proxy.child_error", model=model, status=response.status,
                    body=body[:300].decode(errors="replace"))
    elif response.status < 400:
        log.warning("proxy.child_redirect", model=model, status=response.status,
                    location=response.headers.get("Location", "")[:300])
    return child_error(response.status, body, model, response.headers.get("Retry-After"))


async def batch(request: web.Request) -> web.StreamResponse:
    _, body = await read_json_body(request)
    return await batch_execute(request, request.app[GROUPS], body, admin=request[ADMIN])


async def chain(request: web.Request) -> web.StreamResponse:
    _, body = await read_json_body(request)
    return await chain_execute(request, request.app[GROUPS], body, admin=request[ADMIN])
