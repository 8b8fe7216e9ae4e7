"""The per-model mount: `/w/<quoted name>/...` on every node, for every model and exposed group,
so a router that takes one model per worker URL (smg) sees a corral node as one worker per model.

What smg 1.13.0 does with such a worker URL, read in its source (github:smg-project/smg, the
newest snapshot there is v1.9.0+; 1.13.0's own tags are not in it, so each point below was also
checked against the 1.13.0 wheel from PyPI on loopback, `http://127.0.0.1:P/w/alpha` as the
worker):
- (a) The URL keeps its path. Every call is `format!("{}{}", worker.url(), route)`:
  model_gateway/src/worker/worker.rs (`http_health_check`: base_url + health_endpoint),
  model_gateway/src/worker/monitor.rs (`probe_native_loads`: `{url}/v1/loads?include=...`), the
  HTTP router's `{url}/v1/chat/completions`. On loopback 1.13.0 called /w/alpha/health,
  /w/alpha/v1/models, /w/alpha/v1/loads?include=core,disagg,queues,memory, POST
  /w/alpha/v1/chat/completions, and probed /w/alpha/{get_model_info,get_server_info,
  model_info,server_info,version,loads?model=alpha} (404 here, as at the top level: it moves on).
- (b) `GET /v1/loads` parses into `WorkerLoadResponse` (crates/protocols/src/worker.rs:
  `timestamp`, `dp_rank_count`, `loads: [SchedulerLoadSnapshot]`, every field
  `#[serde(default)]`, unknown fields ignored). A 200 whose `loads` is empty is "inconclusive";
  404/405/501 or a 200 that is not this shape is "absent" and remembered (monitor.rs). least_load
  and power_of_two (model_gateway/src/policies/least_load.rs, power_of_two.rs; power_of_two
  scores its two picks with least_load's `select_min_expected_wait`) score a worker as
      (queued_tokens + tokens sent since the last poll) / throughput + w * k / (1 - k)
  with queued_tokens = Σ num_waiting_uncached_tokens, or when that is 0
  Σ num_waiting_reqs × mean_prefill_tokens (--least-load-mean-prefill-tokens, 1024);
  throughput = Σ gen_throughput, or when 0 --least-load-default-throughput (2000); k = the mean
  token_usage clamped to [0, 0.999]; w = --least-load-kv-pressure-weight (0.15). The lowest
  score wins. Worker overload protection (on by default in 1.13.0) leaves a worker out while
  another is under both thresholds: waiting requests >= --worker-overload-waiting-requests (8)
  or token_usage >= --worker-overload-token-usage (0.8).
- (c) `GET /health`: any 2xx is a pass, anything else (or no answer) a failure; after
  --health-failure-threshold failures in a row (3) the worker leaves rotation, after
  --health-success-threshold passes (2) it is back (worker.rs `http_health_check`). The worker's
  api_key goes along as a bearer token on loads, requests and later health checks, but not on
  the health checks at registration (seen on loopback with --api-key): the mount's health
  answers without a key. Without one, on a node with keys, it says what the top level's /health
  says, the node's liveness, the same for any name (a per-name 200/404 would tell anyone the
  node's model names); with the key, or on a node without keys, the model's own answer.

So a model that is not ready reports COLD_TOKENS more queued tokens in
num_waiting_uncached_tokens: 1000 requests of smg's default mean prefill, 1,024,000 / 2000 ≈
512 s of expected wait, so a node where it is ready wins while its own queue is under about
1,000 requests, more than any corral queue holds (max_queue). The penalty stays out of
num_waiting_reqs and token_usage, the overload veto's signals: vetoed, a cold node is left out
even where the only other node serving the model failed, and smg answered 503
no_available_workers instead of starting the model there. A model cold everywhere ties
everywhere, and smg picks at random. A model starting now is half that far from ready
(STARTING_TOKENS): the node already loading it wins over one where it is stopped, or the
next request, while the first one's node was loading, went to the other node (smg counts
the tokens it sent the loading one since its last poll) and started the model there too.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, unquote

from aiohttp import web

from corral.proxy import capabilities
from corral.proxy.errors import ApiError, error_response, method_not_allowed
from corral.proxy.models_api import group_entry, model_entry
from corral.proxy.routing import GroupTarget, ModelTarget, resolve
from corral.supervisor.port import State, Supervisor

PREFIX = "/w/"
# Waiting requests a model that is not ready adds to its load (see the module's docstring),
# and the tokens smg's least_load counts for each (its default --least-load-mean-prefill-tokens).
COLD_WAITING = 1000
MEAN_PREFILL_TOKENS = 1024
COLD_TOKENS = COLD_WAITING * MEAN_PREFILL_TOKENS
# A model starting now: half the penalty, so the node loading it wins over a cold one.
STARTING_WAITING = COLD_WAITING // 2
STARTING_TOKENS = STARTING_WAITING * MEAN_PREFILL_TOKENS

# The relay of POST /v1/* (proxy/app.py), told which mount the request came in by.
Relay = Callable[..., Awaitable[web.StreamResponse]]


def base(name: str) -> str:
    """A model's or group's mount: `/w/` and its name quoted whole (names hold `/` and `:`)."""
    return PREFIX + quote(name, safe="")


def inner_path(request: web.Request) -> str | None:
    """The top-level path a request to a mount stands for (`/w/a%2Fb/v1/chat/completions` →
    `/v1/chat/completions`); None for any other path. Read from the raw path: the decoded one
    cannot tell a `/` of the name from the path's own."""
    raw = request.raw_path
    if not raw.startswith(PREFIX):
        return None
    _, slash, rest = raw[len(PREFIX):].partition("/")
    return unquote("/" + rest.partition("?")[0]) if slash else None


def open_path(request: web.Request) -> bool:
    """A mount's health answers without a key, as /health does: smg's health checks at a
    worker's registration carry none."""
    return inner_path(request) == "/health"


# Set by the key check on a mount's health: True when the node has keys and the request
# carries none of them. Such a caller gets the node's liveness only, whatever the name.
ANONYMOUS: web.RequestKey[bool] = web.RequestKey("mount_anonymous", bool)


def add_routes(app: web.Application, key: web.AppKey[Supervisor], relay: Relay,
               started: web.RequestKey[bool], liveness: Callable[
                   [web.Request], Awaitable[web.StreamResponse]]) -> None:
    """`relay`: the top-level POST /v1/* handler, which takes `mount=`; `started`: the request
    key that says the response's head went out; `liveness`: the top level's GET /health, the
    answer of a mount's health to a caller without a key (ANONYMOUS)."""

    async def health(request: web.Request) -> web.StreamResponse:
        if request.get(ANONYMOUS):
            return await liveness(request)
        return await _health(request, request.app[key], request.match_info["name"])

    app.router.add_get(PREFIX + "{name}/health", health)
    app.router.add_get(PREFIX + "{name}/v1/models", _with(key, _models))
    app.router.add_get(PREFIX + "{name}/v1/loads", _with(key, _loads))
    app.router.add_get(PREFIX + "{name}/get_load", _with(key, _get_load))
    for path in ("health", "v1/models", "v1/loads", "get_load"):
        app.router.add_route("*", PREFIX + "{name}/" + path, _read_only)

    async def post(request: web.Request) -> web.StreamResponse:
        daemon = request.app[key]
        name = request.match_info["name"]
        resolve(daemon, name)  # an unknown mount: 404 before the body is read
        path = "/v1/" + request.match_info["path"]
        # The same handler as the top level's, on the top-level path: every check it makes
        # of request.path (relayable, served, the family, progress) holds for the mount.
        inner = request.clone(rel_url=request.rel_url.with_path(path, keep_query=True))
        try:
            return await relay(inner, mount=name)
        finally:
            # The clone's head went out (it has its own copy of the request's state): the
            # middleware must know, or a failure mid-stream would get a second response.
            if inner.get(started):
                request[started] = True

    app.router.add_post(PREFIX + "{name}/v1/{path:.+}", post)
    app.router.add_route("*", PREFIX + "{name}/v1/{path:.+}", _not_posted)


def checked_body(daemon: Supervisor, mount: str, body: dict[str, Any]) -> dict[str, Any]:
    """A body posted to `mount`: without `model` it is the mount's; a `model` that names
    anything else (the mount's aliases and canonical name are the same model) is a 404."""
    model = body.get("model")
    if model is None or model == "":
        return {**body, "model": mount}
    if not isinstance(model, str) or _same(resolve(daemon, mount), model, daemon):
        return body  # the same model (or no name at all: the top level's 400 says so)
    raise ApiError(404, f"{str(model)[:100]!r} is not served here: this is the mount of "
                   f"{mount[:100]!r} ({base(mount)[:200]}); send its name, one of its aliases, "
                   "or no model", "model_not_found", param="model")


def _same(target: ModelTarget | GroupTarget, model: str, daemon: Supervisor) -> bool:
    if isinstance(target, GroupTarget):
        return model == target.group.name
    return daemon.resolve(model) == target.name


Handler = Callable[[web.Request, Supervisor, str], Awaitable[web.StreamResponse]]


def _with(key: web.AppKey[Supervisor], handler: Handler) -> Callable[
        [web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await handler(request, request.app[key], request.match_info["name"])
    return handle


async def _read_only(request: web.Request) -> web.Response:
    return method_not_allowed(request.method, request.path, "GET, HEAD")


async def _not_posted(request: web.Request) -> web.StreamResponse:
    if "/v1/" + request.match_info["path"] in capabilities.POSTED:
        return method_not_allowed(request.method, request.path, "POST")
    raise web.HTTPNotFound()


# -- the reads (never a use of the model) ------------------------------------------------------

async def _health(request: web.Request, daemon: Supervisor, name: str) -> web.StreamResponse:
    target = resolve(daemon, name)
    canonical, states = _states(daemon, target)
    state = "group" if isinstance(target, GroupTarget) else str(states[0])
    if daemon.closing:
        return error_response(503, "corral is shutting down", kind="server_error",
                              code="shutting_down")
    if State.FAILED in states:
        return error_response(503, f"{canonical!r} failed to start (GET /admin/models says "
                              "why); its next request tries again", kind="server_error",
                              code="model_failed")
    return web.json_response({"status": "ok", "model": canonical, "state": state})


async def _models(request: web.Request, daemon: Supervisor, name: str) -> web.StreamResponse:
    target = resolve(daemon, name)
    if isinstance(target, GroupTarget):
        entry = group_entry(daemon, target.group, int(time.time()))
    else:
        entry = model_entry(daemon, daemon.status(target.name))
    return web.json_response({"object": "list", "data": [entry]})


async def _loads(request: web.Request, daemon: Supervisor, name: str) -> web.StreamResponse:
    load = Load.of(daemon, resolve(daemon, name))
    return web.json_response(load.smg())


async def _get_load(request: web.Request, daemon: Supervisor, name: str) -> web.StreamResponse:
    return web.json_response({"load": Load.of(daemon, resolve(daemon, name)).total()})


def _states(daemon: Supervisor,
            target: ModelTarget | GroupTarget) -> tuple[str, list[State]]:
    """The target's canonical name and its models' states (a group: its members')."""
    if isinstance(target, GroupTarget):
        members = [m for m in target.group.models if daemon.resolve(m) is not None]
        return target.group.name, [daemon.status(m).state for m in members]
    return target.name, [daemon.status(target.name).state]


class Load:
    """A model's (or a group's members') requests now, whether it is ready, and else how far
    from it (`starting`: each model not ready is starting now)."""

    def __init__(self, model: str, running: int, queued: int, slots: int, ready: bool,
                 starting: bool = False):
        self.model, self.running, self.queued = model, running, queued
        self.slots, self.ready, self.starting = slots, ready, starting

    def _penalty(self) -> tuple[int, int]:
        """The cold-start penalty in (requests, tokens)."""
        if self.ready:
            return 0, 0
        return (STARTING_WAITING, STARTING_TOKENS) if self.starting \
            else (COLD_WAITING, COLD_TOKENS)

    @classmethod
    def of(cls, daemon: Supervisor, target: ModelTarget | GroupTarget) -> Load:
        canonical, states = _states(daemon, target)
        # A group may name its members by alias: the instances carry canonical names.
        members = [c for c in map(daemon.resolve, target.group.models) if c is not None] \
            if isinstance(target, GroupTarget) else [target.name]
        now = daemon.requests_now(members)
        ready = bool(states) and all(s is State.READY for s in states)
        starting = bool(states) and all(s in (State.READY, State.STARTING) for s in states)
        return cls(canonical, now.in_flight, now.queued, now.slots, ready, starting)

    def total(self) -> int:
        """vllm-router's one number: requests in flight and waiting, the cold penalty in."""
        return self.running + self.queued + self._penalty()[0]

    def smg(self) -> dict[str, Any]:
        """smg's `WorkerLoadResponse`: one rank, plus corral's own view under `corral`."""
        # Cold: the queue in tokens, the penalty added (smg reads tokens first when there are
        # any). Warm: none, so smg counts the waiting requests at its own mean prefill.
        penalty = self._penalty()[1]
        tokens = 0 if self.ready else (self.queued * MEAN_PREFILL_TOKENS + penalty)
        return {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
            "dp_rank_count": 1,
            "loads": [{
                "dp_rank": 0,
                "num_running_reqs": self.running,
                "num_waiting_reqs": self.queued,
                "num_waiting_uncached_tokens": tokens,
                "num_total_reqs": self.running + self.queued,
                "token_usage": 0.0,
                "utilization": min(1.0, self.running / self.slots) if self.slots else 0.0,
                "max_running_requests": self.slots,
            }],
            "corral": {"model": self.model, "ready": self.ready, "in_flight": self.running,
                       "queued": self.queued,
                       "cold_penalty_tokens": penalty},
        }
