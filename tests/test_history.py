"""The history behind GET /admin/history (proxy/history.py), on a clock of its own: what a
step holds, what the window and the rings keep, which events become marks. A real daemon's
history, the endpoint and the page's charts of it are in test_status_page.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from corral.proxy.history import MOST_MARKS, WINDOW_MINUTES, History
from corral.supervisor.events import EventBus


class FakeDaemon:
    """What History reads of the daemon: its bus and the latest memory sample."""

    def __init__(self) -> None:
        self.events = EventBus()
        self.devices = [{"name": "cpu", "kind": "cpu", "total_mib": 1000.0, "used_mib": 300.0,
                         "corral_mib": 100.0, "other_mib": 200.0, "capacity_mib": 700.0}]

    def memory_status(self) -> dict[str, Any]:
        return {"devices": [dict(d) for d in self.devices]}


class Clock:
    """Wall-clock time that moves only when told, from now: events keep their real times."""

    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
def history(daemon: FakeDaemon, clock: Clock) -> History:
    return History(daemon, step=5, clock=clock)  # type: ignore[arg-type]


def request(bus: EventBus, model: str, status: int = 200, tokens_out: int | None = 10,
            speed: float | None = 100.0) -> None:
    bus.publish("request", history=False, model=model, status=status, tokens_in=4,
                tokens_out=tokens_out, tokens_per_s=speed)


def test_a_step_holds_each_models_requests_and_the_devices_memory(
        history: History, daemon: FakeDaemon, clock: Clock) -> None:
    t0 = clock.now
    history.sample()
    request(daemon.events, "a", tokens_out=100, speed=100.0)  # 1 s of generation
    request(daemon.events, "a", tokens_out=100, speed=50.0)  # 2 s
    request(daemon.events, "a", status=502, tokens_out=None, speed=None)
    request(daemon.events, "b")
    clock.now += 5
    daemon.devices[0].update(used_mib=400.0, corral_mib=150.0, other_mib=250.0)
    history.sample()
    clock.now += 5
    history.sample()  # a step without requests: no sample for any model

    body = history.as_dict()
    assert body["step"] == 5 and body["times"] == [t0, t0 + 5, t0 + 10]
    a = {m["name"]: m["samples"] for m in body["models"]}["a"]
    # 200 tokens in 3 s of generating: the speed of the tokens, not a mean of the requests.
    assert a == [{"time": t0 + 5, "requests": 3, "errors": 1, "tokens_in": 12,
                  "tokens_out": 200, "tokens_per_s": 66.7}]
    assert [m["name"] for m in body["models"]] == ["a", "b"]
    (cpu,) = body["devices"]
    assert cpu["name"] == "cpu" and cpu["kind"] == "cpu"
    assert [s["corral_mib"] for s in cpu["samples"]] == [100.0, 150.0, 150.0]
    assert cpu["samples"][1] == {"time": t0 + 5, "total_mib": 1000.0,
                                 "used_mib": 400.0, "corral_mib": 150.0, "other_mib": 250.0,
                                 "capacity_mib": 700.0}


def test_loads_stops_failures_and_deaths_are_marks_nothing_else(
        history: History, daemon: FakeDaemon) -> None:
    bus = daemon.events
    bus.publish("load", model="a", instance="a", reason="demand", restart=False)
    bus.publish("load_progress", model="a", instance="a", elapsed=1.0, log="...")
    bus.publish("state", model="a", instance="a", old="starting", new="ready", pid=7, error=None)
    loaded = bus.publish("loaded", model="a", instance="a", pid=7, port=1, seconds=1.5)
    evicted = bus.publish("stop", model="a", instance="a", pid=7, reason="evicted", cause="lru",
                          drain=0)
    failed = bus.publish("load_failed", model="b", instance="b", seconds=0.2, error="no file")
    died = bus.publish("state", model="c", instance="c", old="ready", new="failed", pid=9,
                       error="exited with code -9")
    bus.publish("state", model="b", instance="b", old="starting", new="failed", pid=None,
                error="no file")  # its load_failed says it already
    request(bus, "a")
    assert history.as_dict()["marks"] == [
        e.as_dict() for e in (loaded, evicted, failed, died)]


def test_the_rings_keep_one_hour_and_forget_what_is_older(
        history: History, daemon: FakeDaemon, clock: Clock) -> None:
    steps = WINDOW_MINUTES * 60 // 5
    request(daemon.events, "old")
    daemon.events.publish("loaded", model="old", instance="old", pid=1, port=1, seconds=1.0)
    for _ in range(steps + 50):
        history.sample()
        request(daemon.events, "busy")
        clock.now += 5
    clock.now -= 5  # "now" is the last sample's time
    body = history.as_dict()
    assert len(body["times"]) == steps == len(history.times)
    assert all(body["now"] - 3600 < t for t in body["times"])
    models = {m["name"]: m["samples"] for m in body["models"]}
    # A model that answered nothing for an hour is gone, series and all; so is its mark.
    assert "old" not in models and "old" not in history.models and body["marks"] == []
    assert len(models["busy"]) == steps and len(history.models["busy"]) == steps
    assert len(body["devices"][0]["samples"]) == steps

    # A device no longer read goes the same way, once its last sample is an hour old.
    daemon.devices = []
    for _ in range(steps):
        clock.now += 5
        history.sample()
    assert history.devices == {} and history.as_dict()["devices"] == []


def test_marks_are_bounded_even_within_the_hour(history: History, daemon: FakeDaemon) -> None:
    for n in range(MOST_MARKS + 10):
        daemon.events.publish("stop", model="a", instance="a", pid=n, reason="crash loop",
                              cause="other", drain=0)
    marks = history.as_dict()["marks"]
    assert len(marks) == MOST_MARKS and marks[-1]["pid"] == MOST_MARKS + 9


def test_a_shorter_window_and_only_what_is_new_since_a_sample(
        history: History, daemon: FakeDaemon, clock: Clock) -> None:
    for _ in range(30):  # 150 s
        history.sample()
        request(daemon.events, "a")
        clock.now += 5
    clock.now -= 5  # "now" is the last sample's time
    minute = history.as_dict(minutes=1)
    assert minute["minutes"] == 1 and len(minute["times"]) == 12
    assert all(t > clock.now - 60 for t in minute["times"])
    samples = [s for m in minute["models"] for s in m["samples"]]
    assert samples and all(s["time"] in minute["times"] for s in samples)
    seen = history.as_dict()["times"][-3]
    newer = history.as_dict(since=seen)
    assert newer["times"] == history.as_dict()["times"][-2:]
    assert [s["time"] for s in newer["models"][0]["samples"]] == newer["times"]
