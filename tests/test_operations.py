"""Operations: per-request timings (Server-Timing, one log line, hits and misses), /metrics,
GET /admin/events (live events, loads with progress), loading progress in a chat stream, and
GET /admin/requests. One corral for the module, real llama-server children on tiny models; a
"slow" model whose binary is a wrapper that prints a line and sleeps before exec'ing the real
llama-server, so a load takes long enough to be watched."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from corral.proxy.accounting import MOST_RECENT, Accounting
from corral.proxy.timing import RequestRecord
from corral.supervisor.events import EventBus

from conftest import Corral, CorralFactory, llama_server_binary, sse_lines, tiny_config, wait_until

SLOW_START = 3.0


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Corral:
    folder = tmp_path_factory.mktemp("slow")
    wrapper = folder / "slow-llama-server"
    wrapper.write_text(f'#!/bin/sh\necho "warming up the slow model" >&2\nsleep {SLOW_START}\n'
                       f'exec "{llama_server_binary()}" "$@"\n')
    wrapper.chmod(0o755)
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b", "tiny-c"], policy={"max_loaded": 4})
    config["models"]["slow"] = {"model": str(tiny_models["tiny-c"]), "binary": str(wrapper),
                                "ctx": 2048}
    config["models"]["slow-progress"] = {"model": str(tiny_models["tiny-c"]),
                                         "binary": str(wrapper), "ctx": 2048,
                                         "loading_progress": True}
    config["groups"] = {"pair": {"type": "parallel", "models": ["tiny-a", "tiny-b"],
                                 "expose_as_model": True}}
    return start_corral_module(config)


def metrics(corral: Corral) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics, parsed by prometheus_client's own parser."""
    resp = corral.http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def server_timing(resp: httpx.Response) -> dict[str, float]:
    out = {}
    for part in resp.headers["server-timing"].split(","):
        name, *params = (p.strip() for p in part.split(";"))
        out[name] = next(float(p[4:]) for p in params if p.startswith("dur="))
    return out


def last_line(corral: Corral, model: str, rid: str | None = None) -> dict[str, Any]:
    """The newest `proxy.request` line of `model` (of request `rid`), waited for: a stream's
    line is written once its handler returns, which may be just after the client read the
    end of the stream."""
    def found() -> dict[str, Any] | None:
        lines = [e for e in request_lines(corral, model)
                 if rid is None or e.get("request_id") == rid]
        return lines[-1] if lines else None
    line: dict[str, Any] = wait_until(found, timeout=5)
    return line


def request_lines(corral: Corral, model: str) -> list[dict[str, Any]]:
    return [e for e in corral.log_events("proxy.request") if e.get("model") == model]


def unload(corral: Corral, name: str) -> None:
    assert corral.http.post(f"/admin/models/{name}/unload?force=1").status_code == 200


# -- per-request timing ----------------------------------------------------------------------------

def test_a_cold_request_is_a_miss_and_says_what_the_start_cost(corral):
    unload(corral, "slow")
    before = metrics(corral)
    # ignore_eos: the random tiny model may end at any token; 4 asked, 4 counted.
    resp = corral.chat("slow", max_tokens=4, ignore_eos=True)
    assert resp.status_code == 200, resp.text
    timing = server_timing(resp)
    # The wrapper sleeps 3 s before the real binary even starts: the start is most of the wait.
    assert timing["start"] >= SLOW_START * 1000, timing
    assert timing["queue"] < 1000 and 0 < timing["ttfb"] < 5000, timing
    line = last_line(corral, "slow", resp.headers["x-request-id"])
    assert line["hit"] is False and line["status"] == 200
    assert line["start_ms"] == pytest.approx(timing["start"], abs=0.2)
    assert line["tokens_out"] == 4 and line["tokens_in"] > 0
    assert line["request_id"] == resp.headers["x-request-id"]

    again = corral.chat("slow", max_tokens=4)
    assert server_timing(again)["start"] == 0
    assert last_line(corral, "slow", again.headers["x-request-id"])["hit"] is True
    after = metrics(corral)
    assert sample(after, "corral_model_misses_total", model="slow") \
        - sample(before, "corral_model_misses_total", model="slow") == 1
    assert sample(after, "corral_model_hits_total", model="slow") \
        - sample(before, "corral_model_hits_total", model="slow") == 1
    # The start's own duration, from spawn to ready, counted once.
    assert sample(after, "corral_model_start_duration_seconds_sum", model="slow") \
        - sample(before, "corral_model_start_duration_seconds_sum", model="slow") >= SLOW_START
    assert sample(after, "corral_start_wait_seconds_count", model="slow") \
        - sample(before, "corral_start_wait_seconds_count", model="slow") == 1


def test_a_stream_carries_server_timing_and_its_tokens_are_counted(corral):
    before = metrics(corral)
    client = corral.client()
    with client.chat.completions.with_streaming_response.create(
            model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            stream=True, extra_body={"ignore_eos": True}) as raw:
        assert {"queue", "start", "ttfb"} <= set(server_timing(raw.http_response))
        chunks = [c for c in raw.parse() if c.choices and c.choices[0].delta.content]
    assert chunks  # byte-level tokens: some are half a character, and send no text
    line = last_line(corral, "tiny-a", raw.http_response.headers["x-request-id"])
    assert line["stream"] is True and line["tokens_out"] == 12
    assert line["ttft_ms"] > 0 and line["tokens_per_s"] > 0
    after = metrics(corral)
    assert sample(after, "corral_completion_tokens_total", model="tiny-a") \
        - sample(before, "corral_completion_tokens_total", model="tiny-a") == 12
    assert sample(after, "corral_time_to_first_token_seconds_count", model="tiny-a") \
        - sample(before, "corral_time_to_first_token_seconds_count", model="tiny-a") == 1


def test_requests_are_counted_by_model_endpoint_and_status_with_bounded_labels(corral):
    before = metrics(corral)
    assert corral.chat("tiny-b", max_tokens=2).status_code == 200
    hostile = 'x"} 1\ncorral_evil{a="'
    assert corral.chat(hostile).status_code == 404
    assert corral.http.post("/v1/chat/completions", content=b"{not json",
                            headers={"Content-Type": "application/json"}).status_code == 400
    assert corral.http.post("/v1/made/up/path", json={"model": "tiny-b"}).status_code == 404
    after = metrics(corral)

    def delta(**labels: str) -> float:
        return sample(after, "corral_requests_total", **labels) \
            - sample(before, "corral_requests_total", **labels)

    assert delta(model="tiny-b", endpoint="/v1/chat/completions", status="200") == 1
    # Neither the hostile name nor the made-up path becomes a label: bounded series.
    assert delta(model="_unknown", endpoint="/v1/chat/completions", status="404") == 1
    assert delta(model="_unknown", endpoint="/v1/chat/completions", status="400") == 1
    # The made-up path went to tiny-b's child (any POST /v1/* naming a model does), which
    # knows no such path: counted under the model, as "other".
    assert delta(model="tiny-b", endpoint="other", status="404") == 1
    text = corral.http.get("/metrics").text
    assert "corral_evil" not in text and "made/up" not in text
    # What is true now: loaded state and memory per model.
    assert sample(after, "corral_model_state", model="tiny-b", replica="tiny-b",
                  state="ready") == 1
    assert sample(after, "corral_in_flight", model="tiny-b") == 0
    # The memory series say what /admin/memory says (one view; figures move as the tracker
    # measures, so compared on reads taken together).
    def memory_agrees() -> bool:
        def figures() -> dict[str, Any]:
            view = corral.http.get("/admin/memory").json()
            return {"devices": view["devices"], "models": view["models"]}

        shown = figures()
        exported = metrics(corral)
        if shown != figures():
            return False  # the tracker measured in between: read again
        mib = 1024 * 1024
        rounding = 0.06 * mib  # /admin/memory shows MiB to one decimal
        [model] = [m for m in shown["models"] if m["name"] == "tiny-b"]
        assert model["footprint_mib"], model
        for dev, amount in model["footprint_mib"].items():
            if abs(sample(exported, "corral_model_memory_bytes", model="tiny-b",
                          replica="tiny-b", device=dev) - amount * mib) > rounding:
                return False
        for d in shown["devices"]:
            if abs(sample(exported, "corral_device_memory_bytes", device=d["name"],
                          kind="total") - d["total_mib"] * mib) > rounding:
                return False
        return True

    wait_until(memory_agrees, timeout=15, interval=0.2)


@pytest.mark.expect_log("daemon.reload_failed")
def test_stops_are_counted_by_cause_and_reloads_by_result(corral):
    corral.http.post("/admin/models/tiny-c/load")
    before = metrics(corral)
    unload(corral, "tiny-c")
    assert corral.http.post("/admin/reload").status_code == 200
    original = corral.config_path.read_text()
    corral.config_path.write_text("models: [this is not: a mapping\n")
    try:
        assert corral.http.post("/admin/reload").status_code == 422
    finally:
        corral.config_path.write_text(original)
    after = metrics(corral)
    assert sample(after, "corral_model_stops_total", model="tiny-c", cause="unload") \
        - sample(before, "corral_model_stops_total", model="tiny-c", cause="unload") == 1
    assert sample(after, "corral_reloads_total", result="ok") \
        - sample(before, "corral_reloads_total", result="ok") >= 1
    assert sample(after, "corral_reloads_total", result="failed") \
        - sample(before, "corral_reloads_total", result="failed") >= 1


def test_group_runs_and_member_outcomes_are_counted(corral):
    before = metrics(corral)
    resp = corral.chat("pair", max_tokens=3)
    assert resp.status_code == 200, resp.text
    after = metrics(corral)
    assert sample(after, "corral_group_requests_total", group="pair", type="parallel",
                  result="ok") - sample(before, "corral_group_requests_total", group="pair",
                                        type="parallel", result="ok") == 1
    for member in ("tiny-a", "tiny-b"):
        labels = {"group": "pair", "model": member, "outcome": "ok"}
        assert sample(after, "corral_group_member_outcomes_total", **labels) \
            - sample(before, "corral_group_member_outcomes_total", **labels) == 1
    # The group's own request, counted under the group's name.
    assert sample(after, "corral_requests_total", model="pair",
                  endpoint="/v1/chat/completions", status="200") \
        - sample(before, "corral_requests_total", model="pair",
                 endpoint="/v1/chat/completions", status="200") == 1


def test_recent_requests_list_their_timings(corral):
    resp = corral.chat("tiny-a", max_tokens=2, ignore_eos=True)
    rid = resp.headers["x-request-id"]
    recent = corral.http.get("/admin/requests", params={"limit": 5}).json()["requests"]
    mine = recent[-1]
    assert mine["model"] == "tiny-a" and mine["status"] == 200 and mine["hit"] is True
    assert mine["total_ms"] >= mine["ttfb_ms"] > 0 and mine["tokens_out"] == 2, mine
    assert len(recent) <= 5 and rid  # the id is in the log line; the list is the page's


# -- events ----------------------------------------------------------------------------------------

class EventReader:
    """GET /admin/events in a thread, collecting (kind, data) until stopped."""

    def __init__(self, corral: Corral, query: str = "") -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ids: list[int] = []
        self._stop = threading.Event()
        self._corral = corral
        self._query = query
        self.opened = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.opened.wait(10)

    def _run(self) -> None:
        with httpx.stream("GET", self._corral.url + "/admin/events" + self._query,
                          timeout=30) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            self.opened.set()
            kind, data = None, None
            for line in sse_lines(resp):
                if self._stop.is_set():
                    return
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("id: "):
                    self.ids.append(int(line[4:]))
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                elif line == "" and kind and data is not None:
                    self.events.append((kind, data))
                    kind, data = None, None

    def of(self, kind: str, model: str | None = None) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind and (model is None
                                                               or d.get("model") == model)]

    def close(self) -> None:
        self._stop.set()


def test_events_tell_a_load_with_its_progress_and_a_stop_with_its_reason(corral):
    unload(corral, "slow")
    reader = EventReader(corral)
    try:
        assert corral.http.post("/admin/models/slow/load").status_code == 200
        unload(corral, "slow")
        wait_until(lambda: reader.of("stop", "slow") and any(
            d["new"] == "stopped" for d in reader.of("state", "slow")), timeout=10)
    finally:
        reader.close()
    assert reader.of("load", "slow")[0]["reason"] == "demand"
    progress = reader.of("load_progress", "slow")
    # One a second while it loads; honest: time so far and the child's own last line.
    assert len(progress) >= 2, reader.events
    assert progress[0]["log"] == "warming up the slow model"
    assert progress[-1]["elapsed"] >= 2
    loaded = reader.of("loaded", "slow")[0]
    assert loaded["seconds"] >= SLOW_START and loaded["pid"] > 0
    states = [(d["old"], d["new"]) for d in reader.of("state", "slow")]
    assert states == [("stopped", "starting"), ("starting", "ready"), ("ready", "stopping"),
                      ("stopping", "stopped")]
    stop = reader.of("stop", "slow")[0]
    assert stop["cause"] == "unload" and "unloaded by admin" in stop["reason"]
    assert reader.ids == sorted(reader.ids)


def test_events_filter_by_kind_and_replay_from_an_id(corral):
    unload(corral, "tiny-c")
    reader = EventReader(corral, "?kinds=request")
    try:
        corral.chat("tiny-a", max_tokens=1)
        wait_until(lambda: reader.of("request"), timeout=5)
    finally:
        reader.close()
    assert {k for k, _ in reader.events} == {"request"}
    before = reader.ids[-1]
    corral.http.post("/admin/models/tiny-c/load")
    corral.chat("tiny-a", max_tokens=1)
    # A reconnecting reader gives its last id (Last-Event-ID) and gets what it missed from
    # history: the state changes and loads, not every request (those would crowd them out).
    replayed: list[tuple[int, str]] = []
    with httpx.stream("GET", corral.url + "/admin/events",
                      headers={"Last-Event-ID": str(before)}, timeout=10) as resp:
        event_id = None
        for line in sse_lines(resp):
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("event: ") and event_id is not None:
                replayed.append((event_id, line[7:]))
                if line[7:] == "loaded":
                    break
    assert replayed and all(i > before for i, _ in replayed)
    kinds = [k for _, k in replayed]
    assert "request" not in kinds and {"state", "load", "loaded"} <= set(kinds), kinds


def test_event_ids_count_from_one_and_a_reader_from_before_a_restart_gets_all_history():
    before = EventBus()
    ids = [before.publish("state", n=n).id for n in range(1000)]
    assert ids == list(range(1, 1001))  # `id: 7`, as README shows, not a timestamp
    last = ids[-1]
    after = EventBus()  # the daemon restarted: its ids start again at 1
    first = after.publish("state", n=0)
    after.publish("loaded", model="m")
    assert first.id == 1
    # EventSource's Last-Event-ID from the daemon before: an id this bus never reached.
    replayed = after.subscribe(after=last).pending()
    assert [e.kind for e in replayed] == ["state", "loaded"]
    # An id it did reach: only what came after it.
    assert [e.kind for e in after.subscribe(after=first.id).pending()] == ["loaded"]
    assert after.subscribe(after=2).pending() == []


def test_a_new_reader_may_start_with_the_last_events_of_history():
    bus = EventBus(history=10)
    for n in range(20):
        bus.publish("state" if n % 2 else "loaded", n=n)
    bus.publish("request", history=False)  # live only: never replayed
    assert [e.data["n"] for e in bus.subscribe(last=3).pending()] == [17, 18, 19]
    loaded = bus.subscribe(last=3, kinds=frozenset({"loaded"})).pending()
    assert [e.data["n"] for e in loaded] == [14, 16, 18]
    assert bus.subscribe().pending() == []  # by default a reader gets what happens next
    assert len(bus.subscribe(last=500).pending()) == 10  # no more than history holds


def test_event_bus_cuts_off_a_reader_that_falls_behind_and_survives_a_bad_listener():
    bus = EventBus(history=10)
    base = bus.publish("quiet", history=False).id  # ids count, history skips it
    assert bus.recent() == []
    seen: list[str] = []

    def broken(_event: Any) -> None:
        raise RuntimeError("listener bug")

    bus.listen(broken)
    bus.listen(lambda e: seen.append(e.kind))
    slow = bus.subscribe()
    for i in range(1001):
        bus.publish("tick", n=i)
    assert len(seen) == 1001  # the broken listener did not stop the next one
    assert slow.lagged and bus.subscribers == 0
    # Cut off with every event it had room for, none dropped for the end marker: it resumes
    # (Last-Event-ID) right after the last one it got.
    assert [e.data["n"] for e in slow.pending()] == list(range(1000))
    replay = bus.subscribe(after=base + 996)  # tick n has id base + n + 1
    assert [e.data["n"] for e in replay.pending()] == [996, 997, 998, 999, 1000]


def test_the_recent_requests_keep_as_many_as_the_largest_limit_asks():
    """GET /admin/requests?limit=1000 (docs/operations.md: at most 1,000) got 200: the list
    kept no more, and said nothing of the rest."""
    class Daemon:  # what the accounting reads of a daemon
        events = EventBus()
        loaded = SimpleNamespace(config=SimpleNamespace(groups={}))

        def resolve(self, name: str) -> str | None:
            return name if name == "m" else None

    accounting = Accounting(Daemon())  # type: ignore[arg-type]
    for i in range(MOST_RECENT + 1):
        accounting.finish(RequestRecord("m", "/v1/chat/completions", pid=i), 200)
    listed = accounting.recent_requests(MOST_RECENT)
    assert [r["pid"] for r in listed] == list(range(1, MOST_RECENT + 1))


# -- loading progress in a chat stream ------------------------------------------------------------

def _reasoning_and_content(stream: Any) -> tuple[str, str]:
    reasoning, content = [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = (delta.model_extra or {}).get("reasoning_content")
        if extra:
            reasoning.append(extra)
        if delta.content:
            content.append(delta.content)
    return "".join(reasoning), "".join(content)


def test_a_model_configured_for_it_streams_its_load_progress_before_the_answer(corral):
    unload(corral, "slow-progress")
    stream = corral.client().chat.completions.create(
        model="slow-progress", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        stream=True, extra_body={"ignore_eos": True})
    reasoning, content = _reasoning_and_content(stream)
    assert reasoning.startswith("Loading slow-progress…"), reasoning
    # Each second of the load: its stage and time, never the child's own log line (that
    # stays in the logs and /admin/events).
    assert re.search(r"\n(starting \d s\n)+slow-progress ready after \d\.\d s\.\n\n$",
                     reasoning), reasoning
    assert "warming up" not in reasoning
    assert "slow-progress ready after" in reasoning
    assert len(content) > 0
    line = last_line(corral, "slow-progress", stream.response.headers["x-request-id"])
    assert line["status"] == 200 and line["hit"] is False and line["tokens_out"] == 6


# An answer with some text in it from the random tiny model: ignore_eos (it may end at any
# token), and 4 byte-level tokens (a character takes at most 4; the child holds back a part of
# one until it is whole).
SOME_TEXT: dict[str, Any] = {"max_tokens": 4, "extra_body": {"ignore_eos": True}}


def test_progress_is_per_request_too_and_a_ready_model_gets_none(corral):
    unload(corral, "slow")
    client = corral.client()
    # Asked for by header (its model does not send it by default).
    stream = client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"X-Corral-Progress": "1"}, **SOME_TEXT)
    reasoning, content = _reasoning_and_content(stream)
    assert "Loading slow…" in reasoning and content
    # Ready now: nothing to report, the answer comes as it is.
    stream = client.chat.completions.create(
        model="slow", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"X-Corral-Progress": "1"}, **SOME_TEXT)
    reasoning, content = _reasoning_and_content(stream)
    assert reasoning == "" and content
    # And a header saying no turns a model's default off.
    unload(corral, "slow-progress")
    stream = client.chat.completions.create(
        model="slow-progress", messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"X-Corral-Progress": "0"}, **SOME_TEXT)
    reasoning, content = _reasoning_and_content(stream)
    assert reasoning == "" and content


def test_a_client_that_hangs_up_during_the_progress_leaves_nothing_behind(corral):
    unload(corral, "slow-progress")

    async def hang_up() -> list[bytes]:
        got: list[bytes] = []
        async with httpx.AsyncClient(base_url=corral.url, timeout=10) as client:
            body = {"model": "slow-progress", "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for chunk in resp.aiter_bytes():
                    got.append(chunk)
                    if b"starting" in b"".join(got):
                        break  # leaves mid-load
        return got

    got = asyncio.run(hang_up())
    assert b"reasoning_content" in b"".join(got)
    # The load goes on for the next request; the hang-up took no slot with it.
    wait_until(lambda: corral.model("slow-progress")["state"] == "ready", timeout=15)
    state = corral.model("slow-progress")
    assert state["in_flight"] == 0 and state["queue"] == 0
    assert wait_until(lambda: request_lines(corral, "slow-progress")[-1]["status"] == 499,
                      timeout=5)
    assert corral.chat("slow-progress", max_tokens=2).status_code == 200


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_a_failed_load_after_the_progress_began_is_an_error_event(corral, tmp_path):
    unload(corral, "slow-progress")
    wait_until(lambda: corral.model("slow-progress")["state"] == "stopped", timeout=10)
    # Not a model file: the child exits during its load, after the stream began.
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    original = corral.config_path.read_text()
    config = yaml.safe_load(original)
    config["models"]["slow-progress"]["model"] = str(broken)
    corral.config_path.write_text(yaml.safe_dump(config))
    try:
        assert corral.http.post("/admin/reload").status_code == 200
        with httpx.stream("POST", corral.url + "/v1/chat/completions", timeout=30, json={
                "model": "slow-progress", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status_code == 200
            text = "".join(resp.iter_text())
    finally:
        corral.config_path.write_text(original)
        assert corral.http.post("/admin/reload").status_code == 200
    assert "Loading slow-progress" in text
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    error = events[-1]["error"]
    assert error["code"] == "model_start_failed" and "request id" in error["message"], error
    assert text.rstrip().endswith("data: [DONE]")
    assert wait_until(lambda: request_lines(corral, "slow-progress")[-1]["status"] == 502,
                      timeout=5)


def test_a_lease_granted_as_the_client_hangs_up_goes_back():
    """The slot comes free and the client leaves in the same moment: whichever way that
    race goes (the acquire may even swallow the cancel and return its lease), the lease is
    given back; every interleaving within a few loop turns is tried."""
    from aiohttp import web

    from corral.proxy.progress import ProgressStream

    class FakeLease:
        def __init__(self, daemon: FakeDaemon) -> None:
            self.daemon = daemon

        def release(self) -> None:
            self.daemon.released += 1
            self.daemon.slots.release()

    class FakeDaemon:  # only what ProgressStream.acquire touches
        def __init__(self) -> None:
            self.events = EventBus()
            self.instances: dict[str, Any] = {}
            self.slots = asyncio.Semaphore(0)
            self.granted = self.released = 0

        async def acquire(self, _model: str) -> FakeLease:
            # As Instance.take_slot waits for a slot when every slot is taken.
            await asyncio.wait_for(self.slots.acquire(), 30)
            self.granted += 1
            return FakeLease(self)

    async def race(turns: int) -> FakeDaemon:
        daemon = FakeDaemon()
        stream = ProgressStream.__new__(ProgressStream)
        stream.model, stream.response = "m", web.StreamResponse()
        handler = asyncio.ensure_future(stream.acquire(daemon))  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)
        daemon.slots.release()  # a slot frees up for this waiter...
        for _ in range(turns):
            await asyncio.sleep(0)
        handler.cancel()  # ...as the client hangs up
        try:
            lease = await handler
            lease.release()  # it won the race: the caller holds it, and gives it back
        except asyncio.CancelledError:
            pass
        for _ in range(5):
            await asyncio.sleep(0)
        return daemon

    for turns in range(4):
        daemon = asyncio.run(race(turns))
        assert daemon.released == daemon.granted, (turns, daemon.granted, daemon.released)
        assert daemon.slots._value == 1, turns  # the slot is free again
