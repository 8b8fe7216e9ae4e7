"""GET /admin/history: the last hour as time series, for the status page's charts: memory per
device (corral's children and everyone else), requests and generation speed per model, and
the loads, stops (evictions among them) and failures as marks on the timeline.

One `History` per app, fed by the daemon's event bus (requests, loads, stops) and by a sampler
the app owns, which reads the daemon's latest memory sample every `step` seconds. Every series
is a bounded ring (one hour of steps), and a model's ring holds only the steps in which it
answered something, so an idle model costs nothing. The keys are those of the page's other
sources: a device sample has /admin/memory's, a model sample /admin/requests', a mark is an
/admin/events event."""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from corral.proxy.validate import bad
from corral.supervisor.events import Event
from corral.supervisor.port import Supervisor

log = structlog.get_logger("corral.proxy")

STEP = 5.0  # seconds between samples
WINDOW_MINUTES = 60
# Marks kept at most, whatever their age: a crash loop must not grow the list without end.
MOST_MARKS = 1000
# A device sample's keys, as GET /admin/memory names them.
_DEVICE_KEYS = ("total_mib", "used_mib", "corral_mib", "other_mib", "capacity_mib")


@dataclass
class _Bucket:
    """One model's requests since the last sample."""

    requests: int = 0
    errors: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    timed_tokens: int = 0  # the tokens of requests whose generation speed is known
    generating_s: float = 0.0  # and the time spent generating them

    def add(self, request: dict[str, Any]) -> None:
        self.requests += 1
        status = request.get("status")
        if isinstance(status, int) and status >= 400:
            self.errors += 1
        self.tokens_in += request.get("tokens_in") or 0
        out = request.get("tokens_out") or 0
        self.tokens_out += out
        speed = request.get("tokens_per_s")
        if out and speed:
            self.timed_tokens += out
            self.generating_s += out / speed

    def sample(self, at: float) -> dict[str, Any]:
        # Tokens over the time spent generating them: a request of 500 tokens weighs more
        # than one of 5, as it does for whoever waits on them.
        speed = round(self.timed_tokens / self.generating_s, 1) if self.generating_s else None
        return {"time": at, "requests": self.requests, "errors": self.errors,
                "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "tokens_per_s": speed}


def is_mark(event: Event) -> bool:
    """Whether an event belongs on the timeline: a model loaded, failed to load, stopped (an
    eviction is a stop whose cause is lru or memory), or a serving child died."""
    if event.kind in ("loaded", "load_failed", "stop"):
        return True
    return event.kind == "state" and event.data.get("new") == "failed" \
        and event.data.get("old") in ("ready", "draining")


class History:
    def __init__(self, daemon: Supervisor, step: float = STEP,
                 clock: Callable[[], float] = time.time) -> None:
        self.daemon = daemon
        self.step = step
        self.clock = clock
        self.keep = math.ceil(WINDOW_MINUTES * 60 / step)  # samples per series
        self.times: collections.deque[float] = collections.deque(maxlen=self.keep)
        self.devices: dict[str, tuple[str, collections.deque[dict[str, Any]]]] = {}
        self.models: dict[str, collections.deque[dict[str, Any]]] = {}
        self.marks: collections.deque[dict[str, Any]] = collections.deque(maxlen=MOST_MARKS)
        self._open: dict[str, _Bucket] = {}
        daemon.events.listen(self.on_event)

    def on_event(self, event: Event) -> None:
        if event.kind == "request":
            model = event.data.get("model")
            if isinstance(model, str):  # the accounting's label: a configured name or _unknown
                self._open.setdefault(model, _Bucket()).add(event.data)
        elif is_mark(event):
            self.marks.append(event.as_dict())

    def sample(self) -> None:
        """Close the step: the devices' memory now, each model's requests since the last."""
        at = round(self.clock(), 2)
        self.times.append(at)
        for device in self.daemon.memory_status()["devices"]:
            _, ring = self.devices.setdefault(
                device["name"], (device["kind"], collections.deque(maxlen=self.keep)))
            ring.append({"time": at, **{k: device.get(k) for k in _DEVICE_KEYS}})
        for model, bucket in self._open.items():
            self.models.setdefault(model, collections.deque(maxlen=self.keep)).append(
                bucket.sample(at))
        self._open.clear()
        self._forget(at - WINDOW_MINUTES * 60)

    def _forget(self, before: float) -> None:
        """Drop what is older than the window: a model that answered nothing for an hour, or
        a device no longer read (a reload's new GPU reader), leaves no empty series behind."""
        for name, ring in list(self.models.items()):
            if not _trim(ring, before):
                del self.models[name]
        for name, (_, ring) in list(self.devices.items()):
            if not _trim(ring, before):
                del self.devices[name]
        while self.marks and self.marks[0]["time"] <= before:
            self.marks.popleft()

    def as_dict(self, minutes: int = WINDOW_MINUTES, since: float | None = None,
                ) -> dict[str, Any]:
        now = self.clock()
        start = now - minutes * 60
        if since is not None:
            start = max(start, since)

        def recent(ring: collections.deque[dict[str, Any]]) -> list[dict[str, Any]]:
            return [s for s in ring if s["time"] > start]

        return {
            "step": self.step, "minutes": minutes, "now": round(now, 2),
            "times": [t for t in self.times if t > start],
            "devices": [{"name": name, "kind": kind, "samples": samples}
                        for name, (kind, ring) in self.devices.items()
                        if (samples := recent(ring))],
            "models": [{"name": name, "samples": samples}
                       for name, ring in sorted(self.models.items())
                       if (samples := recent(ring))],
            "marks": recent(self.marks),
        }

    async def run(self) -> None:
        """Sample every step, on the step's wall-clock boundary (samples at :00, :05, ...)."""
        while True:
            try:
                self.sample()
            except Exception:
                log.exception("history.sample_failed")  # one bad sample is not the end
            delay = self.step - self.clock() % self.step
            # A wake-up a hair before the boundary would sample twice in a row.
            await asyncio.sleep(delay if delay > self.step / 10 else delay + self.step)


HISTORY: web.AppKey[History] = web.AppKey("history", History)


def add_routes(app: web.Application, daemon: Supervisor) -> None:
    app[HISTORY] = History(daemon)

    async def sampler(app: web.Application) -> AsyncIterator[None]:
        # The app owns the task: it runs while the app serves and is awaited at cleanup.
        task = asyncio.create_task(app[HISTORY].run(), name="history")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def history(request: web.Request) -> web.Response:
        minutes = _number(request.query.get("minutes", str(WINDOW_MINUTES)))
        if minutes is None or not 1 <= minutes <= WINDOW_MINUTES or minutes != int(minutes):
            raise bad(f"minutes must be a whole number from 1 to {WINDOW_MINUTES}", "minutes")
        since = None
        if "since" in request.query:
            since = _number(request.query["since"])
            if since is None:
                raise bad("since must be a time in seconds since the epoch (a sample's "
                          "`time`)", "since")
        return web.json_response(request.app[HISTORY].as_dict(int(minutes), since))

    app.cleanup_ctx.append(sampler)
    app.router.add_get("/admin/history", history)


def _trim(ring: collections.deque[dict[str, Any]], before: float) -> bool:
    """Drop the samples taken at or before `before`; whether any are left."""
    while ring and ring[0]["time"] <= before:
        ring.popleft()
    return bool(ring)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
