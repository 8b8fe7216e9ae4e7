"""Relay workers (`relay_workers`, proxy/workers): processes that serve the daemon's port beside
it, on real llama-server children. The relay's own tests run again with workers on under
`make test-workers`; these are about what workers add: leases held by the daemon for them,
their records booked by it, a worker that dies, a client that leaves while queued, the keys
of a reload, a drain at SIGTERM, and a port in use."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from conftest import Corral, CorralFactory, gone, sse_lines, tiny_config, wait_until

LONG = {"max_tokens": 3000, "ignore_eos": True}  # seconds of generation on the tiny model


def _config(tiny_models: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b"], relay_workers=2, **overrides)
    config["models"]["tiny-a"]["parallel"] = 2
    return config


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    return _up(start_corral_module(_config(tiny_models)))


def _up(corral: Corral) -> Corral:
    """`corral` once both its workers serve: /health answers through the first one to come
    up, and on a loaded machine the second may still be starting."""
    wait_until(lambda: corral.log_events("corral.listening"), timeout=30)
    assert len(corral.log_events("relay_worker.ready")) == 2
    return corral


def _workers(corral: Corral) -> list[int]:
    """The pids of the relay workers running now."""
    return [p.pid for p in psutil.Process(corral.proc.pid).children()
            if "corral.proxy.workers.main" in " ".join(p.cmdline())]


def test_the_workers_serve_the_port_and_the_daemon_books_their_requests(corral: Corral) -> None:
    workers = _workers(corral)
    assert len(workers) == 2
    # The workers listen on the port; the daemon holds it without listening (no client's
    # request waits behind the daemon's own work).
    port = int(corral.url.rsplit(":", 1)[1])
    listening = {c.pid for c in psutil.net_connections("tcp")
                 if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    assert listening == set(workers)
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200  # a start: the daemon's
    wait_until(lambda: _served_by_worker(corral, "tiny-a"), timeout=10)
    served = set()
    for i in range(12):
        rid = f"worker-book-{i}"
        # A connection of its own each: the kernel spreads connections over the workers.
        with httpx.Client(base_url=corral.url, timeout=60) as http:
            resp = http.post("/v1/chat/completions", headers={"X-Request-Id": rid}, json={
                "model": "tiny-a", "max_tokens": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"hi {i}"}]})
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Request-Id"] == rid
        assert resp.json()["usage"]["completion_tokens"] == 4
        served.add(_logged(corral, rid)["worker"])
    assert served == {0, 1}
    metrics = corral.http.get("/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("corral_requests_total{")
                and 'model="tiny-a"' in m and 'status="200"' in m)
    assert float(line.rsplit(" ", 1)[1]) >= 12


def _logged(corral: Corral, rid: str) -> dict[str, Any]:
    """The daemon's `proxy.request` line of request `rid` (it comes a loop's turn after the
    answer, from the worker's record)."""
    def found() -> dict[str, Any] | None:
        return next((e for e in corral.log_events("proxy.request")
                     if e.get("request_id") == rid), None)
    event = wait_until(found, timeout=10)
    assert isinstance(event, dict)
    return event


def test_a_workers_stream_holds_a_lease_in_the_daemon(corral: Corral) -> None:
    body = {"model": "tiny-a", "stream": True, **LONG,
            "messages": [{"role": "user", "content": "a long one"}]}
    events = 0
    with httpx.Client(base_url=corral.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body,
                        headers={"X-Request-Id": "worker-stream"}) as resp:
        assert resp.status_code == 200
        last = ""
        for line in sse_lines(resp):
            if not line:
                continue
            events += 1
            last = line
            if events == 5:
                # The daemon counts it in flight: TTL, drains and evictions see it.
                assert corral.model("tiny-a")["in_flight"] == 1
        assert last == "data: [DONE]"
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 0, timeout=10)
    assert _logged(corral, "worker-stream")["tokens_out"] == LONG["max_tokens"]


def test_a_burst_of_streams_through_the_workers_each_gets_its_own_answer(
        corral: Corral) -> None:
    """Streams at once over both workers and the daemon's two slots: each whole, each its
    own (its id, its token count), none lost or crossed."""
    def stream(i: int) -> tuple[int, set[str], int]:
        body = {"model": "tiny-a", "stream": True, "max_tokens": 16 + i, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"burst {i}"}]}
        ids: set[str] = set()
        usage = -1
        with httpx.Client(base_url=corral.url, timeout=120) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in sse_lines(resp):
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    ids.add(chunk["id"])
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
        return i, ids, usage

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, range(16)))
    for i, ids, usage in results:
        assert len(ids) == 1 and usage == 16 + i, (i, ids, usage)
    assert len({next(iter(ids)) for _, ids, _ in results}) == 16
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 0, timeout=10)


def test_a_cold_model_starts_through_the_daemon(corral: Corral) -> None:
    """A worker has no ready child of tiny-b: the request goes to the daemon, which starts
    it (and accounts for the request itself)."""
    assert corral.model("tiny-b")["state"] == "stopped"
    with httpx.Client(base_url=corral.url, timeout=60) as http:
        resp = http.post("/v1/chat/completions", headers={"X-Request-Id": "worker-cold"},
                         json={"model": "tiny-b", "max_tokens": 2, "ignore_eos": True,
                               "messages": [{"role": "user", "content": "wake"}]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Request-Id"] == "worker-cold"
    logged = _logged(corral, "worker-cold")
    assert "worker" not in logged and logged["hit"] is False  # the daemon's own request
    assert corral.model("tiny-b")["state"] == "ready"
    # Once the snapshot says ready, the workers serve it themselves.
    wait_until(lambda: _served_by_worker(corral, "tiny-b"), timeout=10)


def _served_by_worker(corral: Corral, model: str) -> bool:
    rid = f"probe-{time.monotonic_ns()}"
    with httpx.Client(base_url=corral.url, timeout=60) as http:
        resp = http.post("/v1/chat/completions", headers={"X-Request-Id": rid},
                         json={"model": model, "max_tokens": 1,
                               "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 200, resp.text
    return _logged(corral, rid).get("worker") is not None


def test_the_daemons_own_paths_answer_through_a_worker(corral: Corral) -> None:
    """What a worker does not serve itself is the daemon's, answered as the daemon answers:
    models, admin, events, errors of its own, 405s."""
    with httpx.Client(base_url=corral.url, timeout=30) as http:
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} >= {"tiny-a", "tiny-b"}
        assert http.get("/health").json()["status"] == "ok"
        wrong = http.post("/v1/models", json={"model": "tiny-a"})
        assert wrong.status_code == 405 and wrong.headers["Allow"] == "GET, HEAD"
        unknown = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        bad = http.post("/v1/chat/completions", content=b"{nope",
                        headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        # One answer's head, not two: no header doubled by the worker.
        admin = http.get("/admin/models")
        assert admin.status_code == 200
        assert len(admin.headers.get_list("X-Request-Id")) == 1
        assert len(admin.headers.get_list("X-Content-Type-Options")) == 1
        # A stream of the daemon's (its events) comes through as it is written.
        with http.stream("GET", "/admin/events", params={"kinds": "request"}) as events:
            assert events.status_code == 200
            threading.Thread(target=lambda: corral.chat("tiny-a", max_tokens=1),
                             daemon=True).start()
            for line in sse_lines(events):
                if line.startswith("data:") and json.loads(line[5:])["kind"] == "request":
                    break


def test_a_client_that_leaves_while_queued_leaves_no_lease_behind(
        corral: Corral) -> None:
    """Both slots taken, a third request queues in the daemon (its acquire is the worker's
    call). The client leaves: the daemon drops the call, the queue empties, nothing holds."""
    busy = {"model": "tiny-a", "stream": True, **LONG,
            "messages": [{"role": "user", "content": "hold"}]}
    stop = threading.Event()

    def hold() -> None:
        with httpx.Client(base_url=corral.url, timeout=120) as http, \
                http.stream("POST", "/v1/chat/completions", json=busy) as resp:
            for _ in resp.iter_raw():
                if stop.is_set():
                    return

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
    for t in holders:
        t.start()
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 2, timeout=30)
    port = int(corral.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "tiny-a", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "queued"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (port, len(body), body))
    wait_until(lambda: corral.model("tiny-a")["queue"] == 1, timeout=10)
    sock.close()
    wait_until(lambda: corral.model("tiny-a")["queue"] == 0, timeout=10)
    stop.set()
    for t in holders:
        t.join(30)
    wait_until(lambda: corral.model("tiny-a")["in_flight"] == 0, timeout=30)
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200


def test_a_killed_worker_gives_its_leases_back_and_is_spawned_again(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    corral = _up(start_corral(_config(tiny_models)))
    corral.expect("relay_worker.exited", "relay_worker.leases_returned")
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    first = _workers(corral)
    body = {"model": "tiny-a", "stream": True, **LONG,
            "messages": [{"role": "user", "content": "cut"}]}
    broken = False
    with httpx.Client(base_url=corral.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        try:
            for n, _ in enumerate(line for line in sse_lines(resp) if line):
                if n == 3:
                    assert corral.model("tiny-a")["in_flight"] == 1
                    for pid in first:
                        os.kill(pid, signal.SIGKILL)
        except httpx.HTTPError:
            broken = True
    assert broken
    # The daemon gave the dead worker's lease back at once.
    returned = wait_until(lambda: corral.log_events("relay_worker.leases_returned"))
    assert [e["leases"] for e in returned] == [1]
    # Both spawned again, serving (the harness's kept connections died with the first ones).
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 4, timeout=30)
    corral.http.close()
    corral.http = httpx.Client(base_url=corral.url, timeout=60)
    assert corral.model("tiny-a")["in_flight"] == 0
    again = _workers(corral)
    assert len(again) == 2 and not set(again) & set(first)
    resp = corral.chat("tiny-a", max_tokens=4, ignore_eos=True)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    assert corral.model("tiny-a")["pid"] == corral.spawned_pids("tiny-a")[0]


def test_a_stopped_worker_is_killed_and_spawned_again(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    """A worker whose loop stops (here SIGSTOP: the kernel still hands it new connections,
    and its requests' leases stay held) answers no ping: the daemon kills it, gives its leases
    back and spawns another."""
    corral = _up(start_corral(_config(tiny_models)))
    corral.expect("relay_worker.unresponsive", "relay_worker.exited",
                  "relay_worker.leases_returned")
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    first = _workers(corral)
    body = {"model": "tiny-a", "stream": True, **LONG,
            "messages": [{"role": "user", "content": "stopped"}]}
    with httpx.Client(base_url=corral.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = (line for line in sse_lines(resp) if line)
        for _ in range(3):
            next(lines)
        for pid in first:
            os.kill(pid, signal.SIGSTOP)
        stopped = wait_until(lambda: len(corral.log_events("relay_worker.unresponsive")) == 2,
                             timeout=30)
        assert stopped
    unresponsive = corral.log_events("relay_worker.unresponsive")
    assert {e["pid"] for e in unresponsive} == set(first)
    # Returned once the killed worker is reaped, a moment after it was found unresponsive.
    returned = wait_until(lambda: corral.log_events("relay_worker.leases_returned"), timeout=30)
    assert [e["leases"] for e in returned] == [1]
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 4, timeout=30)
    corral.http.close()
    corral.http = httpx.Client(base_url=corral.url, timeout=60)
    assert corral.model("tiny-a")["in_flight"] == 0
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    assert not set(_workers(corral)) & set(first)


def test_a_killed_daemon_takes_its_workers_with_it_and_frees_its_port(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    """SIGKILL to the daemon (the OOM killer, kill -9) leaves nothing serving: its workers
    die with it (they would otherwise go on answering its port from a stale snapshot, their
    leases held by nobody), its children too, and the port is free for the next daemon."""
    corral = _up(start_corral(_config(tiny_models)))
    corral.expect(exit_code=-signal.SIGKILL)
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    workers = _workers(corral)
    assert len(workers) == 2
    # This daemon's own: its workers' argv names its socket (another test's do not).
    argv = psutil.Process(workers[0]).cmdline()
    rpc = argv[argv.index("--rpc") + 1]
    survivors = [corral.model("tiny-a")["pid"], *workers]
    corral.proc.send_signal(signal.SIGKILL)
    corral.proc.wait(10)
    wait_until(lambda: all(gone(pid) for pid in survivors), timeout=10)
    port = int(corral.url.rsplit(":", 1)[1])
    # No process of this corral listens on its port, and the port can be bound again (the
    # daemon held it bound for its workers). A test running beside this one may take a freed
    # port at once (seen once in CI: a probe's connect to it succeeded with every process of
    # this corral gone): such a holder is allowed, one of this corral's is not.
    others = []
    for held in psutil.net_connections(kind="tcp"):
        if held.laddr and held.laddr.port == port and not held.raddr and held.pid:
            try:
                holder = psutil.Process(held.pid).cmdline()
            except psutil.Error:
                continue  # gone meanwhile
            ours = rpc in holder or any(str(tiny_models["tiny-a"]) in arg for arg in holder)
            assert held.pid not in (corral.proc.pid, *survivors) and not ours, holder
            others.append(held.pid)
    try:
        with socket.create_server(("127.0.0.1", port)):
            pass
    except OSError:
        assert others, "the port is still bound, and nobody else listens there"


def test_a_reload_reaches_the_workers(start_corral: CorralFactory,
                                      tiny_models: dict[str, Path]) -> None:
    """Keys changed by a reload apply in the workers too (the daemon sends them its new
    config); relay_workers itself is read at the start only."""
    config = _config(tiny_models, api_keys=["old-key"])
    corral = _up(start_corral(config, api_key="old-key"))

    def status(key: str) -> int:
        with httpx.Client(base_url=corral.url, timeout=60) as http:
            return http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny-a", "max_tokens": 1,
                                   "messages": [{"role": "user", "content": "k"}]}).status_code

    assert [status("old-key") for _ in range(6)] == [200] * 6
    assert status("new-key") == 401
    report = corral.reload_with({**config, "api_keys": ["new-key"], "relay_workers": 3})
    assert "relay_workers" in json.dumps(report)
    # Every worker has the new keys by the time the reload answered (each connection is
    # new, so both workers are asked): a key the reload removed opens nothing after it.
    assert [status("old-key") for _ in range(8)] == [401] * 8
    assert [status("new-key") for _ in range(6)] == [200] * 6
    assert len(_workers(corral)) == 2  # relay_workers: 3 waits for a restart


def test_sigterm_lets_a_workers_stream_finish_then_everything_ends(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    corral = _up(start_corral(_config(tiny_models)))
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    workers = _workers(corral)
    body = {"model": "tiny-a", "stream": True, "max_tokens": 1500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "drain"}]}
    lines = []
    with httpx.Client(base_url=corral.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in sse_lines(resp):
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3:
                corral.proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    assert corral.proc.wait(30) == 0
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                               != psutil.STATUS_ZOMBIE for p in workers), timeout=10)


def test_a_port_in_use_fails_the_start_with_workers(tmp_path: Path,
                                                    tiny_models: dict[str, Path]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    path = tmp_path / "corral.yaml"
    path.write_text(yaml.safe_dump(_config(tiny_models)))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "corral.supervisor.cli", "serve", "-c", str(path),
             "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"),
             "--log-format", "json"], capture_output=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith(b"{")]
    failed = [e for e in events if e["event"] == "corral.listen_failed"]
    assert failed and "in use" in failed[0]["error"]
    assert not [e for e in events if e["event"] == "relay_worker.spawned"]
