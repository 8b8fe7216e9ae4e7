"""Prometheus exposition (prometheus_client): requests and their timings, from the proxy (kept
as plain numbers by proxy/request_metrics, folded in at scrape time); starts, stops, reloads
and group outcomes, from the daemon's events; state, queues and memory, read from the daemon
at scrape time.

One registry per app, not prometheus_client's global one: no state outside the daemon's
objects, and two corrals in one process (the tests) do not share counters. Label sets are
bounded: model and group names come from the config (a request naming an unknown model counts
under "_unknown"), endpoints from the routes, stop causes from events.STOP_CAUSES."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from corral.proxy.request_metrics import START, RequestSeries
from corral.proxy.timing import RequestRecord
from corral.supervisor.events import Event
from corral.supervisor.port import Supervisor

UNKNOWN_MODEL = "_unknown"
# A stream that answers for no model (GET /admin/events).
NO_MODEL = "_none"

def model_label(daemon: Supervisor, name: str) -> str:
    """A request's model as a metrics label: a configured model or group, else UNKNOWN_MODEL
    (a client's string never becomes a label)."""
    if daemon.resolve(name) == name or name in daemon.loaded.config.groups:
        return name
    return UNKNOWN_MODEL


class Metrics:
    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        model = ["model"]
        # First, as the per-request families were when they were Counters and Histograms.
        self.per_request = RequestSeries()
        r.register(self.per_request)
        self.starts = Counter("corral_model_starts", "Child starts begun", model, registry=r)
        self.start_failures = Counter("corral_model_start_failures", "Child starts that "
                                      "failed", model, registry=r)
        self.start_duration = Histogram("corral_model_start_duration_seconds", "Spawn to "
                                        "ready, per successful start", model, buckets=START,
                                        registry=r)
        self.restarts = Counter("corral_model_restarts", "Starts after a failure (crash, "
                                "failed start, watchdog kill)", model, registry=r)
        self.crashes = Counter("corral_model_crashes", "Serving children that died or were "
                               "killed as unresponsive", model, registry=r)
        self.stops = Counter("corral_model_stops", "Children stopped, by cause (ttl, lru, "
                             "memory, kv, unload, reload, ...)", ["model", "cause"], registry=r)
        self.evictions = Counter("corral_evictions", "Models stopped to make room, by reason "
                                 "(lru: for another model's start; memory: pressure)",
                                 ["model", "reason"], registry=r)
        self.reloads = Counter("corral_reloads", "Config reloads by result", ["result"],
                               registry=r)
        self.group_requests = Counter("corral_group_requests", "Group runs by group, type and "
                                      "result (ok: answered complete; partial: answered with "
                                      "complete false; failed: an error; cancelled: the client "
                                      "hung up first)",
                                      ["group", "type", "result"], registry=r)
        self.member_outcomes = Counter("corral_group_member_outcomes", "Group members' "
                                       "outcomes (ok, error, timeout, retried, replaced, "
                                       "cancelled, skipped)", ["group", "model", "outcome"],
                                       registry=r)
        self.votes = Counter("corral_group_votes", "Group votes by group, comparison and "
                             "agreement (majority: more than half the answers agree; "
                             "plurality: fewer, but more than agree on any other answer; "
                             "no_majority: a tie, or no two agree; none: no answer cast a "
                             "vote)", ["group", "compare", "agreement"], registry=r)
        self.vote_agreeing = Counter("corral_group_vote_agreeing_answers", "Answers in the "
                                     "winning bloc of a vote (over corral_group_vote_answers: "
                                     "the mean winning share)", ["group"], registry=r)
        self.vote_answers = Counter("corral_group_vote_answers", "Answers counted in votes",
                                    ["group"], registry=r)
        self.quorums = Counter("corral_group_quorums", "Votes of groups with a quorum, by "
                               "whether it was reached (met, missed)", ["group", "result"],
                               registry=r)
        self.client_write_timeouts = Counter(
            "corral_client_write_timeouts", "Clients cut off after taking no bytes for "
            "client_write_timeout seconds, by the model answering them", model, registry=r)
        self.cache_saves = Counter("corral_prompt_cache_saves", "Slots saved to disk (the "
                                   "prompt cache: at idle and at a stop)", model, registry=r)
        self.cache_saved_bytes = Counter("corral_prompt_cache_saved_bytes", "Bytes of slots "
                                         "saved to disk", model, registry=r)
        self.cache_restores = Counter("corral_prompt_cache_restores", "Saved slots restored "
                                      "into a child before a request", model, registry=r)
        self.cache_restored_tokens = Counter("corral_prompt_cache_restored_tokens", "Prompt "
                                             "tokens restored instead of prefilled", model,
                                             registry=r)
        self.cache_dropped = Counter("corral_prompt_cache_dropped", "Saved slots deleted "
                                     "(budget, superseded, truncated, refused)", model,
                                     registry=r)
        self.cache_unused_restores = Counter(
            "corral_prompt_cache_unused_restores", "Restores whose tokens the child's answer "
            "did not reuse (timings.cache_n); the first turns that setup's restores off",
            model, registry=r)
        self.cache_prefill_saved = Counter(
            "corral_prompt_cache_prefill_saved_seconds", "Prefill time the restored tokens "
            "would have taken, estimated at the child's prefill speed for the request", model,
            registry=r)
        self.cache_key_waits = Counter(
            "corral_prompt_cache_key_waits", "Requests llama-server places itself "
            "(/v1/messages) that waited for other API keys' requests on their child to end",
            model, registry=r)
        self.cache_key_wait_seconds = Counter(
            "corral_prompt_cache_key_wait_seconds", "Seconds those requests waited", model,
            registry=r)
        r.register(_LiveState(daemon))
        daemon.events.listen(self.on_event)

    def model_label(self, name: str) -> str:
        return model_label(self.daemon, name)

    def observe(self, record: RequestRecord) -> None:
        """`record.model` is a label already (model_label): the accounting sets it so."""
        self.per_request.observe(record)
        if record.restored is not None and record.prompt_ms_per_token is not None:
            self.cache_prefill_saved.labels(record.model).inc(
                record.restored.tokens * record.prompt_ms_per_token / 1000)

    def client_stalled(self, model: str | None) -> None:
        """A client cut off by proxy/client_io (rare: no series cached)."""
        label = NO_MODEL if model is None else self.model_label(model)
        self.client_write_timeouts.labels(label).inc()

    def on_event(self, event: Event) -> None:
        data, kind = event.data, event.kind
        if kind == "request":
            return  # one per request, counted in observe(): not down the chain below
        if kind == "load":
            self.starts.labels(data["model"]).inc()
            if data.get("restart"):
                self.restarts.labels(data["model"]).inc()
        elif kind == "loaded":
            self.start_duration.labels(data["model"]).observe(data["seconds"])
        elif kind == "load_failed":
            self.start_failures.labels(data["model"]).inc()
        elif kind == "state":
            if data["new"] == "failed" and data["old"] in ("ready", "draining"):
                self.crashes.labels(data["model"]).inc()
        elif kind == "stop":
            self.stops.labels(data["model"], data["cause"]).inc()
            if data["cause"] in ("lru", "memory"):
                self.evictions.labels(data["model"], data["cause"]).inc()
        elif kind == "prompt_cache_saved":
            self.cache_saves.labels(data["model"]).inc()
            self.cache_saved_bytes.labels(data["model"]).inc(data["bytes"])
        elif kind == "prompt_cache_restored":
            self.cache_restores.labels(data["model"]).inc()
            self.cache_restored_tokens.labels(data["model"]).inc(data["tokens"])
        elif kind == "prompt_cache_dropped":
            self.cache_dropped.labels(data["model"]).inc()
        elif kind == "prompt_cache_restore_unused":
            self.cache_unused_restores.labels(data["model"]).inc()
        elif kind == "prompt_cache_key_wait":
            self.cache_key_waits.labels(data["model"]).inc()
            self.cache_key_wait_seconds.labels(data["model"]).inc(data["seconds"])
        elif kind == "reload":
            self.reloads.labels("ok" if data["ok"] else "failed").inc()
        elif kind == "group":
            self.group_requests.labels(data["group"], data["type"], data["result"]).inc()
            for member in data["members"]:
                self.member_outcomes.labels(data["group"], member["model"],
                                            member["status"]).inc()
            vote = data.get("vote")
            if vote:
                self.votes.labels(data["group"], vote["compare"], vote["agreement"]).inc()
                self.vote_agreeing.labels(data["group"]).inc(vote["agree"])
                self.vote_answers.labels(data["group"]).inc(vote["of"])
                if vote["quorum_met"] is not None:
                    self.quorums.labels(data["group"],
                                        "met" if vote["quorum_met"] else "missed").inc()

    async def handler(self, request: web.Request) -> web.Response:
        # The format the scraper asks for (OpenMetrics or the text format), as
        # prometheus_client's own server negotiates it.
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.registry), headers={"Content-Type": content_type})


class _LiveState(Collector):
    """What is true now, read at scrape time: no bookkeeping on the hot path for it."""

    def __init__(self, daemon: Supervisor) -> None:
        self.daemon = daemon

    def describe(self) -> list[Metric]:
        return []  # unchecked: families depend on the config of the moment

    def collect(self) -> Iterator[Metric]:
        models = self.daemon.describe()
        in_flight = GaugeMetricFamily("corral_in_flight", "Requests being answered",
                                      labels=["model"])
        queued = GaugeMetricFamily("corral_queue_depth", "Requests waiting (for a slot, room "
                                   "or a start)", labels=["model"])
        # "replica", not "instance": Prometheus gives every series an `instance` label (the
        # scrape target) and would rename ours.
        state = GaugeMetricFamily("corral_model_state", "1 for the state each replica is in",
                                  labels=["model", "replica", "state"])
        totals: dict[str, list[int]] = {}
        for m in models:
            model = m["replica_of"] or m["name"]
            counts = totals.setdefault(model, [0, 0])
            counts[0] += m["in_flight"]
            counts[1] += m["queue"]
            state.add_metric([model, m["name"], m["state"]], 1)
        for model, (flying, waiting) in totals.items():
            in_flight.add_metric([model], flying)
            queued.add_metric([model], waiting)
        yield from (in_flight, queued, state)
        yield from _memory_families(self.daemon.memory_status())


def _memory_families(status: dict[str, Any]) -> Iterator[Metric]:
    mib = 1024 * 1024
    device = GaugeMetricFamily("corral_device_memory_bytes", "Device memory: total, used (by "
                               "everyone), corral (its children), capacity (what corral may "
                               "use: budget and reserve applied)", labels=["device", "kind"])
    for d in status["devices"]:
        for kind, key in (("total", "total_mib"), ("used", "used_mib"),
                          ("corral", "corral_mib"), ("capacity", "capacity_mib")):
            if d.get(key) is not None:
                device.add_metric([d["name"], kind], d[key] * mib)
    model = GaugeMetricFamily("corral_model_memory_bytes", "What each loaded replica holds "
                              "per device (measured once running, estimated while loading)",
                              labels=["model", "replica", "device"])
    # Summed per series: during a switch-over the new child and the old one share a name.
    held: dict[tuple[str, str, str], float] = {}
    for m in status["models"]:
        if m["state"] in ("stopped", "failed"):
            continue
        owner = m["name"].split("#")[0]
        for dev, amount in (m.get("footprint_mib") or {}).items():
            series = (owner, m["name"], dev)
            held[series] = held.get(series, 0.0) + amount * mib
    for labels, amount in held.items():
        model.add_metric(list(labels), amount)
    yield from (device, model)
