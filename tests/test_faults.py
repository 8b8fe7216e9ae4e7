"""Faults and load through corral, with real children: floods, slow and vanishing clients,
children killed, frozen (SIGSTOP) or unable to start, unloads under a cancelled caller, and
queue bounds in every state. Outcomes are counted and asserted; waits are bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest

from conftest import Corral, gone, llama_server_binary, tiny_config, wait_until

GO = [{"role": "user", "content": "go"}]


# -- helpers -------------------------------------------------------------------------------------

def sse_events(text: str) -> list[Any]:
    """The data of each SSE event: parsed JSON, or the raw string ("[DONE]")."""
    events: list[Any] = []
    # Split at LF only, as SSE does: str.splitlines also splits at U+0085 and U+2028, which
    # JSON leaves unescaped inside a string and a tiny model's random tokens can hold.
    for line in text.split("\n"):
        if line.startswith("data:"):
            data = line[5:].strip()
            try:
                events.append(json.loads(data))
            except ValueError:
                events.append(data)
    return events


def error_events(events: list[Any]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if isinstance(e, dict) and "error" in e]


def resume(corral: Corral, pid: int) -> None:
    """SIGCONT a child a test stopped, unless it is gone (its pid may be someone else's)."""
    if pid in corral.still_running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": GO, **extra}


def assert_openai_error(resp: httpx.Response) -> dict[str, Any]:
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def retry_after(resp: httpx.Response) -> float:
    value = resp.headers.get("retry-after")
    assert value is not None, f"{resp.status_code} without Retry-After: {resp.text[:200]}"
    seconds = float(value)
    assert seconds > 0, value
    return seconds


@dataclass
class Stream:
    """A streamed chat read on a thread, so the test can act while it runs."""

    corral: Corral
    payload: dict[str, Any]
    timeout: float = 120
    status: int | None = None
    text: str = ""
    error: BaseException | None = None
    chunks: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout) as client, client.stream(
                    "POST", self.corral.url + "/v1/chat/completions",
                    json={**self.payload, "stream": True}) as resp:
                self.status = resp.status_code
                parts = []
                for part in resp.iter_text():
                    parts.append(part)
                    self.chunks += part.count("data:")
                    if self.chunks >= 5:
                        self.started.set()
                self.text = "".join(parts)
        except BaseException as exc:  # reported by the test, not lost on the thread
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()

    def wait_started(self, timeout: float = 30) -> None:
        assert self.started.wait(timeout), "the stream sent no chunks"
        assert self.error is None, self.error
        assert self.status == 200, (self.status, self.text)

    def result(self, timeout: float) -> list[Any]:
        assert self.done.wait(timeout), f"the stream did not end within {timeout}s"
        assert self.error is None, repr(self.error)
        assert self.status == 200, (self.status, self.text[:300])
        return sse_events(self.text)


# -- one daemon for the tests that do not disturb one another (each has its own model) -------

SHARED = {
    "load": {"parallel": 4, "max_queue": 1000},   # a: the 1,000-request flood
    "bounded": {"parallel": 4, "max_queue": 50},  # a: the flood against a small queue
    "trickle": {},                                # b: slow clients
    "single": {"parallel": 1},                    # c: hang-up while queued
    "crash": {"parallel": 4},                     # d: kill -9 under several streams
    "unload": {},                                 # f: unload from an impatient caller
}


@pytest.fixture(scope="module")
def shared(start_corral_module, tiny_models) -> Corral:
    # Drains get far longer than any generation here takes, even on a busy box.
    config = tiny_config(tiny_models, policy={"max_loaded": len(SHARED)}, shutdown_grace=150)
    config["models"] = {name: {"model": str(tiny_models["tiny-a"]), "ctx": 8192, **extra}
                        for name, extra in SHARED.items()}
    return start_corral_module(config)


# -- a. floods -----------------------------------------------------------------------------------

class Sampler:
    """Polls /admin/models on its own thread (the flood keeps the test's event loop busy)
    and keeps the largest queue, in-flight count and their sum seen for one model."""

    def __init__(self, corral: Corral, model: str):
        self.corral, self.model = corral, model
        self.peaks = {"queue": 0, "in_flight": 0, "total": 0}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        with httpx.Client(base_url=self.corral.url, timeout=5) as admin:
            while not self._stop.is_set():
                # A poll under load may be slow or refused: the flood is what is measured.
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    state = next(m for m in admin.get("/admin/models").json()["models"]
                                 if m["name"] == self.model)
                    self.samples += 1
                    state["total"] = state["queue"] + state["in_flight"]
                    for key in self.peaks:
                        self.peaks[key] = max(self.peaks[key], state[key])
                self._stop.wait(0.02)


async def _flood(corral: Corral, model: str, n: int, bound: float,
                 ) -> tuple[Counter[str], list[str]]:
    """n concurrent streamed chats; every outcome classified. The client is aiohttp's (C
    parser): httpx's async client took ~25 CPU-s of the test's own process per thousand
    streams on 2 cores, beside the daemon it floods."""
    payload = body(model, stream=True, max_tokens=16)
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    # Each connect (pool wait included) and each read bounded, as httpx.Timeout(bound) was.
    timeout = aiohttp.ClientTimeout(total=None, connect=bound, sock_read=bound)

    async def one(client: aiohttp.ClientSession) -> None:
        try:
            async with client.post("/v1/chat/completions", json=payload) as resp:
                text = (await resp.read()).decode()
                status = resp.status
                if status == 200:
                    events = sse_events(text)
                    if error_events(events):
                        kind, detail = "error_event", str(error_events(events))
                    elif not events or events[-1] != "[DONE]":
                        kind, detail = "no_done", text[-200:]
                    else:
                        kind, detail = "200", ""
                elif status in (429, 503):
                    kind, detail = str(status), ""
                    if float(resp.headers.get("retry-after") or 0) <= 0:
                        kind, detail = f"{status}_without_retry_after", text[:200]
                else:
                    kind, detail = f"http_{status}", text[:200]
        except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
            kind, detail = "hung", repr(exc)
        except aiohttp.ClientError as exc:
            kind, detail = "connection_error", repr(exc)
        outcomes[kind] += 1
        if detail and len(problems) < 20:
            problems.append(f"{kind}: {detail}")

    connector = aiohttp.TCPConnector(limit=n + 100)
    async with aiohttp.ClientSession(corral.url, connector=connector, timeout=timeout) as client:
        await asyncio.wait_for(asyncio.gather(*(one(client) for _ in range(n))), bound + 30)
    return outcomes, problems


@pytest.mark.timeout(600)
def test_a_thousand_concurrent_streams_none_lost_none_hung(shared):
    assert shared.chat("load", max_tokens=1).status_code == 200  # warm: the flood, not a start
    started = time.monotonic()
    outcomes, problems = asyncio.run(_flood(shared, "load", 1000, bound=300))
    elapsed = time.monotonic() - started
    print(f"\n1000 streams in {elapsed:.1f}s: {dict(outcomes)}")
    assert sum(outcomes.values()) == 1000
    # Each one answered: a whole stream ending in [DONE], or an explicit refusal to retry.
    assert set(outcomes) <= {"200", "429", "503"}, (dict(outcomes), problems)
    assert outcomes["200"] > 0
    state = shared.model("load")
    assert (state["in_flight"], state["queue"], state["state"]) == (0, 0, "ready"), state


@pytest.mark.timeout(600)
def test_flood_against_a_small_queue_is_refused_with_429_and_the_rest_finish(shared):
    assert shared.chat("bounded", max_tokens=1).status_code == 200
    with Sampler(shared, "bounded") as sampler:
        outcomes, problems = asyncio.run(_flood(shared, "bounded", 1000, bound=300))
    peaks = sampler.peaks
    print(f"\n1000 streams, max_queue 50: {dict(outcomes)}; peaks {peaks} "
          f"in {sampler.samples} samples")
    assert sum(outcomes.values()) == 1000
    assert set(outcomes) <= {"200", "429"}, (dict(outcomes), problems)
    assert outcomes["429"] > 0 and outcomes["200"] > 0
    # The bound held whenever we looked: never more in flight than parallel, never more
    # waiting than max_queue beyond them (a request woken for a freed slot still counts as
    # queued until it runs, so the sum is what is bounded); and we did look while the queue
    # was in use.
    assert 0 < peaks["in_flight"] <= 4 and 0 < peaks["total"] <= 4 + 50, peaks
    assert peaks["queue"] >= 40, peaks
    state = shared.model("bounded")
    assert (state["in_flight"], state["queue"]) == (0, 0), state


# -- b. a slow client ----------------------------------------------------------------------------

def test_client_trickling_its_headers_does_not_delay_others(shared):
    assert shared.chat("trickle", max_tokens=1).status_code == 200
    address = urlsplit(shared.url)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nX-Slow-Client: one-byte-a-second\r\n"
            b"Content-Length: 64\r\n\r\n")
    stop = threading.Event()
    sent = [0, 0, 0]

    def trickle(i: int) -> None:
        with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
            for byte in head:
                if stop.is_set():
                    return
                sock.sendall(bytes([byte]))
                sent[i] += 1
                stop.wait(1.0)

    slow = [threading.Thread(target=trickle, args=(i,), daemon=True) for i in range(3)]
    for t in slow:
        t.start()
    try:
        wait_until(lambda: min(sent) >= 2, timeout=10)
        latencies = []
        for _ in range(20):
            started = time.monotonic()
            # ignore_eos: a random tiny model may end at any token; 8 asked, 8 answered.
            resp = shared.chat("trickle", max_tokens=8, ignore_eos=True)
            latencies.append(time.monotonic() - started)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 8
        print(f"\n20 chats beside 3 trickling clients: max {max(latencies):.2f}s")
        assert max(latencies) < 5, latencies
        # The slow clients were mid-headers the whole time, and still sending.
        assert all(t.is_alive() for t in slow)
        assert all(2 <= n < len(head) for n in sent), sent
    finally:
        stop.set()
        for t in slow:
            t.join(5)


# -- c. a client that hangs up while queued ------------------------------------------------------

def test_client_hangup_while_queued_leaves_nothing_behind(shared):
    assert shared.chat("single", max_tokens=1).status_code == 200
    first = Stream(shared, body("single", max_tokens=3000, ignore_eos=True), timeout=150)
    first.wait_started()
    assert shared.model("single")["in_flight"] == 1
    # The second request waits for the one slot; its client then goes away.
    address = urlsplit(shared.url)
    queued = json.dumps(body("single", max_tokens=3000, ignore_eos=True)).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(queued), queued))
    wait_until(lambda: shared.model("single")["queue"] == 1, timeout=10)
    sock.close()
    # Out of the queue at once, while the first request still holds the slot.
    wait_until(lambda: shared.model("single")["queue"] == 0, timeout=5)
    assert not first.done.is_set(), "the first stream ended before the check could be made"
    assert shared.model("single")["in_flight"] == 1
    events = first.result(timeout=150)
    assert events[-1] == "[DONE]" and not error_events(events)
    # Nothing was left to take the slot next (the vanished request would hold it for its
    # 3000 tokens): it is free, and a new request gets it.
    wait_until(lambda: shared.model("single")["in_flight"] == 0, timeout=5)
    assert shared.model("single")["queue"] == 0
    resp = shared.chat("single", max_tokens=4)
    assert resp.status_code == 200, resp.text
    state = shared.model("single")
    assert (state["in_flight"], state["queue"], state["state"]) == (0, 0, "ready")


# -- d. kill -9 under several streams (the single-stream case is in test_lifecycle) ---------------

# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("instance.health_failed")
def test_child_killed_under_several_streams_ends_each_with_an_error_event(shared):
    assert shared.chat("crash", max_tokens=1).status_code == 200
    pid = shared.model("crash")["pid"]
    streams = [Stream(shared, body("crash", max_tokens=2000, ignore_eos=True))
               for _ in range(4)]
    for stream in streams:
        stream.wait_started()
    wait_until(lambda: shared.model("crash")["in_flight"] == 4, timeout=10)
    os.kill(pid, signal.SIGKILL)
    for stream in streams:
        events = stream.result(timeout=15)
        errors = error_events(events)
        assert errors, f"stream ended without an error event: {stream.text[-300:]}"
        assert isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
        assert errors[-1]["code"] == "upstream_failed" and "crash" in errors[-1]["message"]
    wait_until(lambda: gone(pid), timeout=10)
    wait_until(lambda: shared.model("crash")["in_flight"] == 0, timeout=10)
    # The very next request is answered by a new child.
    resp = shared.chat("crash", max_tokens=4)
    assert resp.status_code == 200, resp.text
    new_pid = shared.model("crash")["pid"]
    assert new_pid != pid and not gone(new_pid)
    assert shared.spawned_pids("crash") == [pid, new_pid]


# -- f. unload while a stream runs, from a caller that gives up ----------------------------------

def test_unload_from_an_impatient_caller_still_drains_and_stops(shared):
    assert shared.chat("unload", max_tokens=1).status_code == 200
    pid = shared.model("unload")["pid"]
    stream = Stream(shared, body("unload", max_tokens=3000, ignore_eos=True,
                                 stream_options={"include_usage": True}), timeout=150)
    stream.wait_started()
    with pytest.raises(httpx.TimeoutException):
        # The unload drains first, so it outlasts this caller's patience: its handler is
        # cancelled mid-drain.
        httpx.post(shared.url + "/admin/models/unload/unload", timeout=1)
    events = stream.result(timeout=150)
    assert events[-1] == "[DONE]" and not error_events(events), stream.text[-300:]
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 3000  # the whole generation
    # The stop went on without its caller, to the end.
    wait_until(lambda: shared.model("unload")["state"] == "stopped", timeout=20)
    wait_until(lambda: gone(pid), timeout=10)
    started = time.monotonic()
    resp = shared.chat("unload", max_tokens=4)
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - started < 10
    state = shared.model("unload")
    assert state["state"] == "ready" and state["pid"] != pid


# -- e. a frozen child (SIGSTOP) -----------------------------------------------------------------

WATCHDOG = {"first_byte_timeout": 3, "health_interval": 0.5, "health_timeout": 0.5,
            "health_failures": 3}


@pytest.fixture(scope="module")
def frozen(start_corral_module, tiny_models) -> Corral:
    models = {
        # The brief's watchdog: 3 missed probes, 0.5 s apart, 0.5 s each.
        # Its first-byte limit well after the watchdog's worst case (3 probes, each up to
        # 0.5 s late and 0.5 s long: 3 s), so the kill, not the timeout, ends the request.
        "watched": {**WATCHDOG, "first_byte_timeout": 10},
        # The same first-byte limit, with a watchdog too slow to act first: what a request
        # gets from a frozen child, untangled from the kill.
        "frozen-request": {**WATCHDOG, "health_failures": 100},
        # idle_timeout on a stream; the watchdog far slower than it.
        "silent": {"idle_timeout": 2, "health_interval": 30},
    }
    config = tiny_config(tiny_models, policy={"max_loaded": len(models)})
    config["models"] = {name: {"model": str(tiny_models["tiny-b"]), "ctx": 8192, **extra}
                        for name, extra in models.items()}
    # Teardown continues any child still stopped before it stops the daemon.
    return start_corral_module(config)


@pytest.mark.expect_log("instance.health_failed", "proxy.upstream_failed", "proxy.request_failed")
def test_frozen_child_request_gets_504_in_openai_shape(frozen):
    assert frozen.chat("frozen-request", max_tokens=1).status_code == 200
    pid = frozen.model("frozen-request")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        resp = httpx.post(frozen.url + "/v1/chat/completions", timeout=30,
                          json=body("frozen-request", max_tokens=4))
        elapsed = time.monotonic() - started
        assert resp.status_code == 504, (resp.status_code, resp.text)
        error = assert_openai_error(resp)
        assert error["code"] == "upstream_timeout", error
        assert "first_byte_timeout" in error["message"] or "3s" in error["message"], error
        assert 2.5 <= elapsed < 10, elapsed  # after the first-byte limit, not a hang
        # Given back (through a relay worker the release is a message of its own, which may
        # reach the daemon a moment after the answer reaches the client).
        wait_until(lambda: frozen.model("frozen-request")["in_flight"] == 0, timeout=5)
    finally:
        resume(frozen, pid)


@pytest.mark.expect_log("instance.health_failed", "proxy.request_failed")
def test_watchdog_kills_a_frozen_child_and_the_next_request_gets_a_new_one(frozen):
    assert frozen.chat("watched", max_tokens=1).status_code == 200
    pid = frozen.model("watched")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        # A request to the frozen child meanwhile: an answer (not a hang), in OpenAI's shape.
        started = time.monotonic()
        resp = httpx.post(frozen.url + "/v1/chat/completions", timeout=30,
                          json=body("watched", max_tokens=4))
        elapsed = time.monotonic() - started
        print(f"\nrequest to the frozen child: {resp.status_code} after {elapsed:.1f}s "
              f"{resp.text[:200]}")
        # Killed by the watchdog (before first_byte_timeout): still a gateway timeout that
        # says what happened, not a bare "connection reset".
        assert resp.status_code == 504, (resp.status_code, resp.text)
        assert_openai_error(resp)
        assert "stopped answering" in resp.json()["error"]["message"]
        assert elapsed < 9  # the watchdog's kill, before first_byte_timeout (10 s)
        # The watchdog killed it, and says why.
        wait_until(lambda: gone(pid), timeout=10)
        state = frozen.model("watched")
        assert state["state"] in ("failed", "stopped"), state
        assert re.search(r"health|unresponsive|stopped answering", state["last_error"] or "",
                         re.I), state["last_error"]
        health = state["health"]
        assert health["last_probe"] is not None and health["failures"] >= 3, health
    finally:
        resume(frozen, pid)
    resp = frozen.chat("watched", max_tokens=4)
    assert resp.status_code == 200, resp.text
    new_pid = frozen.model("watched")["pid"]
    assert new_pid != pid and not gone(new_pid)


@pytest.mark.expect_log("instance.health_failed", "proxy.upstream_failed", "proxy.request_failed")
def test_child_frozen_mid_stream_ends_it_with_upstream_timeout(frozen):
    assert frozen.chat("silent", max_tokens=1).status_code == 200
    pid = frozen.model("silent")["pid"]
    stream = Stream(frozen, body("silent", max_tokens=6000, ignore_eos=True), timeout=60)
    try:
        stream.wait_started()
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        events = stream.result(timeout=30)
        elapsed = stream.ended_at - frozen_at
        errors = error_events(events)
        assert errors, f"no error event; ended with {stream.text[-300:]!r}"
        assert isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
        assert errors[-1]["code"] == "upstream_timeout", errors
        # After idle_timeout of silence (give or take what was buffered), not a hang.
        assert 1.5 <= elapsed < 10, elapsed
        wait_until(lambda: frozen.model("silent")["in_flight"] == 0, timeout=5)
        # The silence made corral probe the child at once: it did not answer, so it was
        # killed, and the next request gets a fresh child (not the watchdog's 30 s later).
        wait_until(lambda: gone(pid), timeout=10)
        assert frozen.model("silent")["state"] == "failed"
    finally:
        resume(frozen, pid)
    resp = frozen.chat("silent", max_tokens=1)
    assert resp.status_code == 200, resp.text
    assert frozen.model("silent")["pid"] != pid


# -- g. a start that fails, and its back-off -----------------------------------------------------

@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_failed_start_backs_off_with_503_and_retry_after(start_corral, tiny_models, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))  # garbage after the magic
    config = tiny_config(tiny_models)
    config["models"]["broken"] = {"model": str(broken), "start_backoff": 3,
                                  "start_backoff_max": 30}
    corral = start_corral(config)

    first = corral.chat("broken")
    assert first.status_code == 502, first.text
    assert assert_openai_error(first)["code"] == "model_start_failed"
    assert len(corral.spawned("broken")) == 1
    state = corral.model("broken")
    assert state["last_error"] and state["retry_at"] is not None, state
    retry_at = state["retry_at"]
    assert time.time() < retry_at <= time.time() + 3.5, (retry_at, time.time())

    # During the back-off: 503 at once, with Retry-After, and no new child.
    for _ in range(3):
        started = time.monotonic()
        resp = corral.chat("broken")
        assert resp.status_code == 503, resp.text
        assert assert_openai_error(resp)["code"] == "model_start_backoff"
        assert 0 < retry_after(resp) <= 4
        assert time.monotonic() - started < 2
    assert time.time() < retry_at, "the back-off ran out before its requests were made"
    assert len(corral.spawned("broken")) == 1

    # After it (the daemon says so: no retry_at any more), the next request tries again and
    # fails again, backing off longer.
    wait_until(lambda: corral.model("broken")["retry_at"] is None, timeout=10)
    assert time.time() > retry_at - 0.05  # not before the back-off it announced
    again = corral.chat("broken")
    assert again.status_code == 502, again.text
    assert len(corral.spawned("broken")) == 2
    later = corral.model("broken")
    assert later["retry_at"] is not None and later["retry_at"] - time.time() > 3, later
    assert corral.chat("broken").status_code == 503
    assert corral.chat("tiny-a", max_tokens=2).status_code == 200  # others unaffected


# -- h. max_queue in every state: a cold model -----------------------------------------------------

def test_max_queue_holds_while_a_cold_model_starts(start_corral, tiny_models, tmp_path):
    # A start that takes 3 s for sure: every request below arrives while it runs.
    wrapper = tmp_path / "slow-llama-server"
    wrapper.write_text(f'#!/bin/sh\nsleep 3\nexec "{llama_server_binary()}" "$@"\n')
    wrapper.chmod(0o755)
    config = tiny_config(tiny_models)
    config["models"]["tiny-a"].update(parallel=1, max_queue=5, binary=str(wrapper))
    corral = start_corral(config)
    assert corral.model("tiny-a")["state"] == "stopped"

    async def fire() -> tuple[list[tuple[int, float, httpx.Response]], float | None, int]:
        ready_at: list[float] = []
        peak_queue = 0

        async def watch(admin: httpx.AsyncClient) -> None:
            nonlocal peak_queue
            while not ready_at:
                state = next(m for m in (await admin.get("/admin/models")).json()["models"]
                             if m["name"] == "tiny-a")
                peak_queue = max(peak_queue, state["queue"])
                if state["state"] == "ready":
                    ready_at.append(time.monotonic())
                await asyncio.sleep(0.05)

        async def one(client: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
            resp = await client.post("/v1/chat/completions", json=body("tiny-a", max_tokens=4))
            return resp.status_code, time.monotonic(), resp

        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=corral.url, timeout=120, limits=limits) as client, \
                httpx.AsyncClient(base_url=corral.url, timeout=10) as admin:
            watcher = asyncio.create_task(watch(admin))
            results = await asyncio.gather(*(one(client) for _ in range(50)))
            await asyncio.wait_for(watcher, 30)
        return list(results), (ready_at or [None])[0], peak_queue

    sent = time.monotonic()
    results, ready, peak_queue = asyncio.run(fire())
    statuses = Counter(status for status, _, _ in results)
    print(f"\n50 requests to a cold model (parallel 1, max_queue 5): {dict(statuses)}, "
          f"peak queue {peak_queue}")
    assert set(statuses) <= {200, 429}, statuses
    # One for the slot the start will open, five for the queue; the rest refused.
    assert statuses[200] == 6 and statuses[429] == 44, statuses
    assert peak_queue <= 6
    assert ready is not None
    for status, at, resp in results:
        if status == 429:
            assert assert_openai_error(resp)["code"] == "queue_full"
            retry_after(resp)
            # At once: before the model was ready, not after waiting for its start.
            assert at < ready, (at - sent, ready - sent)
    assert len(corral.spawned("tiny-a")) == 1
