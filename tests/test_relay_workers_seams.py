"""Relay workers at their seams with the rest of corral: what a worker serves, or forwards
to the daemon, behaves as the daemon alone does (tests/test_relay_workers.py has the workers'
own machinery)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from fake_upstream import exchanges
from raw_server import RawServer

from conftest import (
    Corral,
    CorralFactory,
    flooding_stream,
    post_reading_little,
    sse_lines,
    tiny_config,
    wait_until,
)


def _config(tiny_models: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    return tiny_config(tiny_models, ["tiny-a", "tiny-b"], relay_workers=2, **overrides)


def test_sigterm_ends_an_event_stream_forwarded_by_a_worker_cleanly(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    corral = start_corral(_config(tiny_models))
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 2, timeout=30)
    with httpx.Client(base_url=corral.url, timeout=30) as http, \
            http.stream("GET", "/admin/events") as resp:
        assert resp.status_code == 200
        rest = []
        for line in sse_lines(resp):
            if line and not rest:
                corral.proc.send_signal(signal.SIGTERM)
            rest.append(line)
    # The daemon's last words reach the client whole through the worker, then the end.
    assert "event: stopped" in rest, rest
    assert corral.proc.wait(30) == 0


def test_a_stalled_client_of_a_forwarded_stream_is_counted_once_under_its_model(
        start_corral: CorralFactory, smol_model: Path) -> None:
    """A cold model's request goes to the daemon whole (its start, its progress) and the
    worker writes the daemon's answer to the client: a client that stops reading is cut off
    as without workers, named and counted under its model, once."""
    corral = start_corral({
        "client_write_timeout": 2, "relay_workers": 2,
        "defaults": {"ttl": 300, "stop_grace": 5, "queue_timeout": 30},
        "models": {"smol": {"model": str(smol_model), "ctx": 4096, "parallel": 1}},
    })
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 2, timeout=30)
    body = flooding_stream("smol")
    sock = post_reading_little(corral.url, "/v1/chat/completions", body, "stuck-cold")
    try:
        wait_until(lambda: corral.model("smol")["in_flight"] == 1, timeout=60)
        wait_until(lambda: corral.model("smol")["in_flight"] == 0, timeout=120, interval=0.2)
        wait_until(lambda: [e for e in corral.log_events("proxy.request")
                            if e.get("request_id") == "stuck-cold"], timeout=10)
        stalled = corral.log_events("proxy.client_stalled")
        assert [(e["model"], e["request_id"]) for e in stalled] == [("smol", "stuck-cold")]
        metrics = corral.http.get("/metrics").text
        timeouts = [m for m in metrics.splitlines()
                    if m.startswith("corral_client_write_timeouts_total{")]
        assert timeouts == ['corral_client_write_timeouts_total{model="smol"} 1.0'], timeouts
        accounted = [e for e in corral.log_events("proxy.request")
                     if e.get("request_id") == "stuck-cold"]
        assert [e["status"] for e in accounted] == [499], accounted
    finally:
        sock.close()


def _both_ways(start_corral: CorralFactory, config: dict[str, Any],
               scenario: Callable[[Corral], dict[str, Any]],
               expected: tuple[str, ...] = ()) -> dict[str, Any]:
    """`scenario` on a corral without workers, then on one with two: what a client and an
    operator see must be the same (which worker served a request aside)."""
    seen = []
    for workers in (0, 2):
        corral = start_corral({**config, "relay_workers": workers})
        corral.expect(*expected)
        if workers:
            wait_until(lambda c=corral: len(c.log_events("relay_worker.ready")) == 2,
                       timeout=30)
        seen.append(scenario(corral))
    assert seen[0] == seen[1], seen
    return seen[1]


def _stream_cut(corral: Corral, cut: Callable[[], None]) -> dict[str, Any]:
    """A stream of tiny-a, ready and known so to the workers, cut by `cut` after its first
    events: what its client saw, how it was booked, and what the next request found."""
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    if corral.relay_worker_pids():
        wait_until(lambda: _ready_in_workers(corral), timeout=10)
    body = {"model": "tiny-a", "stream": True, "max_tokens": 3000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "on and on"}]}
    tail: list[str] = []
    rid = f"cut-{time.monotonic_ns()}"
    with httpx.Client(base_url=corral.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body,
                        headers={"X-Request-Id": rid}) as resp:
        status = resp.status_code
        for seen, line in enumerate(sse_lines(resp)):
            if seen == 6:
                cut()
            if seen > 6 and line:
                tail.append(line)
    wait_until(lambda: _booked(corral, rid), timeout=10)
    booked = _booked(corral, rid)
    after = corral.chat("tiny-a", max_tokens=2)
    return {"status": status, "last": tail[-1].replace(rid, "RID") if tail else None,
            "booked": [(r["status"], r["model"], r["stream"]) for r in booked],
            "served by a worker": [r["worker"] is not None for r in booked]
            == [bool(corral.relay_worker_pids())],
            "in_flight": corral.model("tiny-a")["in_flight"], "next": after.status_code,
            "restarts": corral.model("tiny-a")["restarts"]}


def _booked(corral: Corral, rid: str) -> list[dict[str, Any]]:
    """The request's `proxy.request` lines (a worker's carry `worker`)."""
    return [{"worker": None, **line} for line in corral.log_events("proxy.request")
            if line.get("request_id") == rid]


def _ready_in_workers(corral: Corral) -> bool:
    """Whether a worker served a request of tiny-a, so its snapshot has it ready."""
    rid = f"probe-{time.monotonic_ns()}"
    corral.http.post("/v1/chat/completions", headers={"X-Request-Id": rid}, json={
        "model": "tiny-a", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    wait_until(lambda: _booked(corral, rid), timeout=10)
    return _booked(corral, rid)[0]["worker"] is not None


def test_a_forced_unload_cuts_a_workers_stream_as_the_daemons(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    def scenario(corral: Corral) -> dict[str, Any]:
        def unload() -> None:
            assert corral.http.post("/admin/models/tiny-a/unload?force=true").status_code == 200
        return _stream_cut(corral, unload)

    seen = _both_ways(start_corral, tiny_config(tiny_models, ["tiny-a"]), scenario,
                      ("proxy.upstream_failed", "proxy.request_failed"))
    assert seen["booked"] == [(502, "tiny-a", True)] and seen["next"] == 200
    assert seen["last"] is not None and '"upstream_failed"' in seen["last"]


def test_a_child_killed_under_a_workers_stream_is_reported_as_the_daemons(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    def scenario(corral: Corral) -> dict[str, Any]:
        return _stream_cut(corral, lambda: os.kill(corral.model("tiny-a")["pid"],
                                                   signal.SIGKILL))

    seen = _both_ways(start_corral, tiny_config(tiny_models, ["tiny-a"]), scenario,
                      ("proxy.upstream_failed", "proxy.request_failed",
                       "instance.health_failed", "instance.exited"))
    # The next request got a fresh child: the daemon learnt of the death across the link.
    assert seen["restarts"] == 1 and seen["next"] == 200


def _answer(corral: Corral, model: str) -> tuple[int, Any]:
    resp = corral.http.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    body = resp.json()
    error = body.get("error")
    return resp.status_code, (error["code"], error["message"]) if error else body["model"]


def test_an_eviction_and_a_reload_look_the_same_through_a_worker(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], policy={"max_loaded": 1})
    config["models"]["tiny-a"]["aliases"] = ["first"]

    def scenario(corral: Corral) -> dict[str, Any]:
        seen: dict[str, Any] = {"a": _answer(corral, "first")}
        if corral.relay_worker_pids():
            wait_until(lambda: _ready_in_workers(corral), timeout=10)
        # tiny-b takes tiny-a's room; tiny-a, ready to the workers a moment ago, comes back.
        seen["b"] = _answer(corral, "tiny-b")
        seen["a again"] = _answer(corral, "tiny-a")
        seen["states"] = {n: corral.model(n)["state"] for n in ("tiny-a", "tiny-b")}
        # The alias renamed, tiny-b removed: the old names are gone at once, the new one works.
        changed = {**config, "relay_workers": config.get("relay_workers", 0),
                   "models": {"tiny-a": {**config["models"]["tiny-a"], "aliases": ["second"]}}}
        changed["relay_workers"] = 2 if corral.relay_worker_pids() else 0
        corral.reload_with(changed)
        seen["old alias"] = _answer(corral, "first")
        seen["new alias"] = _answer(corral, "second")
        seen["removed"] = _answer(corral, "tiny-b")
        return seen

    seen = _both_ways(start_corral, config, scenario)
    assert seen["a again"] == (200, "tiny-a") and seen["new alias"] == (200, "tiny-a")
    assert seen["old alias"][0] == seen["removed"][0] == 404


def test_the_books_count_each_request_once_as_the_daemon_alone_does(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    """Requests a worker serves, ones it forwards (a cold start, an unknown name) and ones
    it refuses itself (a bad body): /admin/requests, /metrics and the log lines hold each
    once, with the same figures as without workers."""
    def scenario(corral: Corral) -> dict[str, Any]:
        assert _answer(corral, "tiny-a")[0] == 200  # a start: the daemon's
        if corral.relay_worker_pids():
            wait_until(lambda: _ready_in_workers(corral), timeout=10)
        before = len(corral.http.get("/admin/requests").json()["requests"])
        counted_before, logged_before = _counted(corral), len(corral.log_events("proxy.request"))
        chats = [_answer(corral, "tiny-a") for _ in range(4)]
        streamed = corral.http.post("/v1/chat/completions", json={
            "model": "tiny-a", "stream": True, "max_tokens": 3, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]})
        unknown = _answer(corral, "no-such-model")
        bad = corral.http.post("/v1/chat/completions", content=b"{not json",
                               headers={"Content-Type": "application/json"})
        # tiny-b's cold start, as the daemon answers it (through a worker: forwarded).
        cold = _answer(corral, "tiny-b")

        def listed() -> list[dict[str, Any]]:
            requests: list[dict[str, Any]] = corral.http.get(
                "/admin/requests").json()["requests"][before:]
            return requests

        wait_until(lambda: len(listed()) >= 8, timeout=10)
        wait_until(lambda: len(corral.log_events("proxy.request")) >= logged_before + 8,
                   timeout=10)
        counted = _counted(corral)
        return {
            "answers": [*chats, streamed.status_code, unknown, bad.status_code, cold],
            "listed": sorted((r["model"], r["endpoint"], r["status"], r["stream"], r["hit"],
                              r["tokens_out"]) for r in listed()),
            "counted": {k: v - counted_before.get(k, 0.0) for k, v in counted.items()
                        if v != counted_before.get(k, 0.0)},
            "logged": len(corral.log_events("proxy.request")) - logged_before,
        }

    seen = _both_ways(start_corral, tiny_config(tiny_models, ["tiny-a", "tiny-b"]), scenario)
    assert len(seen["listed"]) == seen["logged"] == 8, seen


def _counted(corral: Corral) -> dict[str, float]:
    """The request counters of /metrics, by series."""
    series = {}
    for line in corral.http.get("/metrics").text.splitlines():
        if line.startswith(("corral_requests_total{", "corral_completion_tokens_total{",
                            "corral_model_hits_total{", "corral_model_misses_total{")):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def _expecting_continue(corral: Corral, model: str) -> tuple[bytes, int]:
    """A POST that asks `Expect: 100-continue` (curl's way for a big body): the interim
    answer, then the status of the final one."""
    address = urlsplit(corral.url)
    assert address.hostname and address.port
    body = json.dumps({"model": model, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n"
                     b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n"
                     % (address.netloc.encode(), len(body)))
        interim = sock.recv(4096)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return interim.split(b"\r\n", 1)[0], int(answer.split(b" ", 2)[1])


def test_a_client_that_expects_100_continue_is_answered_as_by_the_daemon(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    def scenario(corral: Corral) -> dict[str, Any]:
        cold = _expecting_continue(corral, "tiny-a")  # forwarded to the daemon's start
        if corral.relay_worker_pids():
            wait_until(lambda: _ready_in_workers(corral), timeout=10)
        return {"cold": cold, "warm": _expecting_continue(corral, "tiny-a")}

    seen = _both_ways(start_corral, tiny_config(tiny_models, ["tiny-a"]), scenario)
    assert seen["warm"] == (b"HTTP/1.1 100 Continue", 200)


def test_a_ttl_stop_and_a_changed_model_are_followed_by_the_workers(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    config = tiny_config(tiny_models, ["tiny-a"])

    def scenario(corral: Corral) -> dict[str, Any]:
        seen: dict[str, Any] = {"first": _answer(corral, "tiny-a")}
        if corral.relay_worker_pids():
            wait_until(lambda: _ready_in_workers(corral), timeout=10)
        first_pid = corral.model("tiny-a")["pid"]
        # An in-place change (the TTL), then the TTL stops the model under the workers.
        ttl = {**config, "relay_workers": 2 if corral.relay_worker_pids() else 0,
               "models": {"tiny-a": {**config["models"]["tiny-a"], "ttl": 1}}}
        seen["in place"] = corral.reload_with(ttl)["ok"], corral.model("tiny-a")["pid"] \
            == first_pid
        wait_until(lambda: corral.model("tiny-a")["state"] == "stopped", timeout=20)
        seen["after the ttl"] = _answer(corral, "tiny-a")
        if corral.relay_worker_pids():
            wait_until(lambda: _ready_in_workers(corral), timeout=10)
        # Changed arguments: a new child; the next request is the new child's.
        old_pid = corral.model("tiny-a")["pid"]
        changed = {**ttl, "models": {"tiny-a": {**ttl["models"]["tiny-a"], "ttl": 300,
                                                "ctx": 4096}}}
        seen["changed"] = corral.reload_with(changed)["ok"]
        wait_until(lambda: corral.model("tiny-a")["state"] == "ready"
                   and corral.model("tiny-a")["pid"] != old_pid, timeout=30)
        seen["after the change"] = _answer(corral, "tiny-a")
        return seen

    seen = _both_ways(start_corral, config, scenario)
    assert seen["after the ttl"] == seen["after the change"] == (200, "tiny-a")


def test_a_remotes_errors_reach_the_client_as_from_the_daemon_never_its_key(
        start_corral: CorralFactory) -> None:
    """A remote endpoint's answers through a worker (its lease carries the remote's key):
    its refusals and Retry-After pass as without workers, its key never does."""
    from test_remote_edges import KEY, Remote

    remote = Remote()
    base = f"http://127.0.0.1:{remote.port}"
    names = ("echo", "echo-400", "busy", "moved", "fine")
    config = {"models": {name: {"backend": "remote", "url": f"{base}/v1/", "api_key": KEY,
                                "served_name": name} for name in names}}

    def scenario(corral: Corral) -> dict[str, Any]:
        corral.expect("proxy.request_failed", "proxy.upstream_failed")
        seen: dict[str, Any] = {}
        for name in names:
            answers = []
            for i in range(3):  # the first starts it (the daemon's); the next, a worker's
                rid = f"{name}-{i}-{time.monotonic_ns()}"
                for stream in (False, True):
                    resp = corral.http.post("/v1/chat/completions", headers={
                        "X-Request-Id": rid + str(stream)}, json={
                        "model": name, "stream": stream,
                        "messages": [{"role": "user", "content": "hi"}]})
                    assert KEY not in resp.text, resp.text
                    answers.append((resp.status_code, resp.headers.get("Retry-After"),
                                    resp.text.replace(rid + str(stream), "RID")))
                if i == 0 and corral.relay_worker_pids():
                    wait_until(lambda n=name: corral.model(n)["state"] == "ready", timeout=10)
            seen[name] = answers
        served = {line.get("model") for line in corral.log_events("proxy.request")
                  if line.get("worker") is not None}
        seen["through a worker"] = served == set(names) if corral.relay_worker_pids() \
            else True
        assert KEY not in corral.log_path.read_text()
        return seen

    try:
        seen = _both_ways(start_corral, config, scenario)
    finally:
        remote.close()
    assert seen["busy"][-1][:2] == (429, "7") and seen["echo"][-1][0] == 502


class _BigAnswers(RawServer):
    """A remote endpoint whose chat answers are 1.5 MB each: a group's whole answer holds
    every member's, more than every buffer between corral and a client that reads nothing."""

    def serve(self, conn: socket.socket) -> None:
        for _method, _path, _headers, raw in exchanges(conn):
            model = json.loads(raw or b"{}").get("model")
            body = json.dumps({"id": "r", "object": "chat.completion", "model": model,
                               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                   "role": "assistant", "content": "x" * 1_500_000}}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                         "total_tokens": 2}}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def test_a_client_that_stops_reading_a_groups_whole_answer_is_cut_off_under_the_group(
        start_corral: CorralFactory) -> None:
    """/v1/batch's answer (every member's, whole) to a client that reads nothing: aiohttp
    would have waited on it for as long as it stayed connected, the answer held. Cut off
    after client_write_timeout and counted under the group, with workers as without (a
    worker, which writes the daemon's answer, counted it under `_none`)."""
    remote = _BigAnswers()
    base = f"http://127.0.0.1:{remote.port}"
    config = {"client_write_timeout": 2,
              "models": {name: {"backend": "remote", "url": base} for name in ("big-a", "big-b")},
              "groups": {"pair": {"type": "parallel", "models": ["big-a", "big-b"]}}}

    def scenario(corral: Corral) -> dict[str, Any]:
        body = json.dumps({"group": "pair", "messages": [
            {"role": "user", "content": "hi"}]}).encode()
        sock = post_reading_little(corral.url, "/v1/batch/execute", body, "stuck-batch")
        try:
            wait_until(lambda: corral.log_events("proxy.client_stalled"), timeout=60,
                       interval=0.2)
            wait_until(lambda: _booked(corral, "stuck-batch"), timeout=60, interval=0.2)
        finally:
            sock.close()
        metrics = corral.http.get("/metrics").text
        booked = [(r["status"], r["model"]) for r in _booked(corral, "stuck-batch")]
        # Booked once, under the group. The status is what the daemon handed on: without
        # workers the client cut off (499); with them the worker, whose buffers may have
        # taken the whole answer before its client stalled (200), as a kernel's send buffer
        # may for a daemon alone with a smaller answer.
        assert booked == [(499, "pair")] or (corral.relay_worker_pids()
                                             and booked == [(200, "pair")]), booked
        return {"stalled": [(e["model"], e["request_id"])
                            for e in corral.log_events("proxy.client_stalled")],
                "metric": [m for m in metrics.splitlines()
                           if m.startswith("corral_client_write_timeouts_total{")]}

    try:
        seen = _both_ways(start_corral, config, scenario)
    finally:
        remote.close()
    assert seen == {"stalled": [("pair", "stuck-batch")],
                    "metric": ['corral_client_write_timeouts_total{model="pair"} 1.0']}, seen


def test_a_forwarded_request_whose_body_never_comes_is_answered_as_by_the_daemon(
        start_corral: CorralFactory) -> None:
    """A head that announces a body and no body, on paths a worker forwards whole (a group's,
    a mount's, one corral lacks): a body past max_body_mb is a 413 at once, one that never
    comes a 408 after client_write_timeout, a path corral lacks a 404 at once, as from the
    daemon alone. The worker's client held the head back until the body's first bytes: the
    daemon never saw the request, and the client waited 75 s (the daemon's idle timeout on
    the worker's connection) for a 503 saying corral was restarting, holding one of the
    worker's forwarded slots meanwhile, without a key."""
    config = {"max_body_mb": 1, "client_write_timeout": 2, "api_keys": ["user-key"],
              "models": {"far": {"backend": "remote", "url": "http://127.0.0.1:9"}},
              "groups": {"pair": {"type": "parallel", "models": ["far"],
                                  "expose_as_model": True}}}
    too_big = (b"/v1/batch/execute", b"/v1/chain/execute", b"/w/far/v1/chat/completions",
               b"/w/pair/v1/chat/completions")
    heads = [(target, 2 << 20) for target in too_big] + [
        (b"/v1/batch/execute", 100), (b"/w/pair/v1/chat/completions", 100), (b"/nowhere", 100)]

    def scenario(corral: Corral) -> dict[str, Any]:
        address = urlsplit(corral.url)
        assert address.hostname and address.port
        seen = {}
        for target, length in heads:
            # Within the daemon's 75 s: what comes after that is not an answer to the head.
            with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
                sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer user-key"
                             b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (target, address.netloc.encode(), length))
                got = b""
                while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                    chunk = sock.recv(65536)
                    assert chunk, got
                    got += chunk
            head, _, body = got.partition(b"\r\n\r\n")
            seen[f"{target.decode()} {length}"] = (int(head.split(b" ", 2)[1]),
                                                   json.loads(body)["error"]["code"])
        return seen

    seen = _both_ways(start_corral, config, scenario)
    assert seen == {**{f"{target.decode()} {2 << 20}": (413, "request_too_large")
                       for target in too_big},
                    "/v1/batch/execute 100": (408, "request_timeout"),
                    "/w/pair/v1/chat/completions 100": (408, "request_timeout"),
                    "/nowhere 100": (404, "not_found")}, seen
