"""RPC workers, kept tidy (issue 23):

- what a worker printed and what a peer answered stay out of /v1 error bodies (in corral's
  log; in /admin's last_error once the instance records RpcError.for_operators());
- waiting for an rpc-server to listen polls with connects, off psutil's table scans on the
  event loop, and still tells our rpc-server from another process on its port;
- /peer/info reads the loans on the loop; a worker lends at most worker.max_loans at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from corral.supervisor.config.schema.rpc import WorkerConfig
from corral.supervisor.process import ChildProcess
from corral.supervisor.rpc.lender import Lender, Loan
from corral.supervisor.rpc.workers import (
    RpcError,
    rpc_server_binary,
    rpc_version,
    start_local_rpc_server,
)

from conftest import Corral, CorralFactory, llama_server_binary
from tinymodel import write_tiny_llama

WORKER_SECRET = "WORKER-SECRET-3f9a sk-live-leaked"
PEER_SECRET = "PEER-SECRET-77c1 internal-host-10.9.8.7"
TOKEN = "lend-token"
PEER_TOKEN = "peer-token-3f9a2c1e"  # the head's token for box9, which box9 quotes back


# -- worker output and peer answers stay out of /v1 ---------------------------------------------

class _Refusing(BaseHTTPRequestHandler):
    """A peer that refuses every rpc-server, saying something clients must not see."""

    def do_POST(self) -> None:
        # It also quotes the credentials it was sent (as some proxies' error pages do).
        said = f"{PEER_SECRET} ({self.headers.get('Authorization')})"
        body = json.dumps({"error": {"message": said, "type": "server_error",
                                     "code": "rpc_server_failed"}}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def refusing_peer() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def failing(start_corral_module: CorralFactory, refusing_peer: str,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Corral, dict[str, httpx.Response]]:
    """A corral with `local` (its rpc-server prints a secret and exits) and `remote` (its
    peer refuses with a secret), and the /v1 answer to one request for each."""
    folder = tmp_path_factory.mktemp("failing")
    model = write_tiny_llama(folder / "tiny.gguf", seed=5, n_layer=2)
    corral = start_corral_module({
        "defaults": {"ttl": 600, "stop_grace": 5},
        "peers": {"box9": {"url": refusing_peer, "token": PEER_TOKEN}},
        "models": {
            "local": {"model": str(model), "ctx": 256, "binary": _failing_build(folder),
                      "rpc": {"workers": ["local"]}},
            "remote": {"model": str(model), "ctx": 256, "rpc": {"workers": ["box9"]}},
        },
    })
    return corral, {name: corral.chat(name, max_tokens=1) for name in ("local", "remote")}


def _failing_build(folder: Path, first_line: str | None = None) -> str:
    """A llama.cpp build whose rpc-server prints its banner (or `first_line`) and a secret,
    and exits with code 3; its llama-server's path."""
    build = folder / "build"
    build.mkdir()
    (build / "llama-server").symlink_to(llama_server_binary())
    banner = first_line or f"Starting RPC server v{rpc_version(rpc_server_binary(None))}"
    fake = build / "rpc-server"  # found beside the llama-server
    fake.write_text(f'#!/bin/sh\necho "{banner}"\necho "{WORKER_SECRET}"\nexit 3\n')
    fake.chmod(0o755)
    return str(build / "llama-server")


def _ask_peer_api(lender: Lender, method: str, path: str, **kwargs: Any
                  ) -> tuple[int, dict[str, Any]]:
    """One request to proxy/peer's routes, in this process, over `lender`."""
    from corral.proxy.peer import add_routes

    class Daemon:  # what the routes read of the daemon
        closing = False

        def __init__(self) -> None:
            self.lender = lender

    async def scenario() -> tuple[int, dict[str, Any]]:
        key: web.AppKey[Any] = web.AppKey("daemon", object)
        app = web.Application()
        app[key] = Daemon()
        add_routes(app, key)
        async with TestClient(TestServer(app)) as client:
            resp = await client.request(method, path, **kwargs)
            body: dict[str, Any] = await resp.json()
            return resp.status, body

    return asyncio.run(scenario())


@pytest.mark.expect_log("proxy.start_failed", "proxy.request_failed")
def test_a_workers_output_and_a_peers_answer_stay_out_of_the_v1_body(
        failing: tuple[Corral, dict[str, httpx.Response]]) -> None:
    corral, answers = failing
    local, remote = answers["local"], answers["remote"]
    for resp in (local, remote):
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "workers_unavailable"
        assert "WORKER-SECRET" not in resp.text and "PEER-SECRET" not in resp.text, resp.text
    # What failed, in corral's words: which worker and its exit code; which peer and status.
    assert "local/rpc#0: rpc-server exited with code 3 at start" in local.json()["error"][
        "message"]
    assert "peer box9 refused an rpc-server: HTTP 503" in remote.json()["error"]["message"]
    # The operators keep both, in the log.
    exited = corral.log_events("rpc.worker_exited_at_start")
    assert any(WORKER_SECRET in e["tail"] for e in exited), exited
    refused = corral.log_events("rpc.peer_refused")
    assert [(e["peer"], e["status"], e["answer"]) for e in refused] == [
        ("box9", 503, f"{PEER_SECRET} (Bearer [redacted])")]
    # The token the peer quoted reaches neither the log nor the admin API.
    assert PEER_TOKEN not in corral.log_path.read_text()
    assert PEER_TOKEN not in corral.http.get("/admin/models").text


def test_admin_shows_the_workers_output_and_the_peers_answer(
        failing: tuple[Corral, dict[str, httpx.Response]]) -> None:
    corral, _ = failing
    assert WORKER_SECRET in (corral.model("local")["last_error"] or "")
    assert PEER_SECRET in (corral.model("remote")["last_error"] or "")


# -- waiting for an rpc-server to listen ----------------------------------------------------------

def _record_scans(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """psutil's TCP table scans, each as whether it ran on the main (event loop) thread."""
    calls: list[bool] = []
    whole, own = psutil.net_connections, psutil.Process.net_connections

    def scan_all(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread() is threading.main_thread())
        return whole(*args, **kwargs)

    def scan_own(self: psutil.Process, *args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread() is threading.main_thread())
        return own(self, *args, **kwargs)

    monkeypatch.setattr(psutil, "net_connections", scan_all)
    monkeypatch.setattr(psutil.Process, "net_connections", scan_own)
    return calls


def _serve_one(start: Callable[[], Any], scans: list[bool] | None = None
               ) -> tuple[int, list[bool]]:
    """Start an rpc-server, check that it is it that listens, stop it; (its port, the
    `scans` recorded until it was ready)."""
    async def scenario() -> tuple[int, list[bool]]:
        proc, port = await start()
        until_ready = list(scans or [])
        try:
            assert proc.alive()
            # It is ours that listens there, and it accepts.
            listening = {c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN}
            assert port in listening
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return int(port), until_ready
        finally:
            await proc.stop(2.0)
    return asyncio.run(scenario())


def test_a_worker_becomes_ready_without_scanning_tcp_tables_on_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    binary = rpc_server_binary(None)
    _, scans = _serve_one(lambda: start_local_rpc_server(
        "t/rpc#0", binary, "127.0.0.1", 1, {}, None, 30), _record_scans(monkeypatch))
    assert not any(scans), f"{scans.count(True)} TCP table scans on the event loop"
    # Who listens is still checked: once a connect succeeds, in a thread.
    assert 1 <= len(scans) <= 3, scans


def test_a_port_someone_else_listens_on_is_not_taken_for_the_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process (here: this one) took the offered port first: a connect succeeds, but
    the rpc-server could not bind, and corral starts it again on another port."""
    binary = rpc_server_binary(None)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        port, _ = _serve_one(lambda: start_local_rpc_server(
            "t/rpc#0", binary, "127.0.0.1", 1, {}, None, 30, port=taken))
    assert port != taken


# -- /peer/info and the loan cap -------------------------------------------------------------------

def test_peer_info_reads_the_loans_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    described: list[bool] = []
    describe = Loan.describe

    def recorded(self: Loan) -> dict[str, Any]:
        described.append(threading.current_thread() is threading.main_thread())
        return describe(self)

    monkeypatch.setattr(Loan, "describe", recorded)
    lender = Lender(WorkerConfig(enabled=True, token=TOKEN), None, None,
                    lambda: {"cpu": 2**30})
    for n in range(3):
        lender.loans[f"l{n}"] = Loan(f"l{n}", "m", ChildProcess("m", ["true"], {}),
                                     5000 + n, "cpu", 2**30, 0.0)
    status, info = _ask_peer_api(lender, "GET", "/peer/info")
    assert status == 200, info
    assert described and all(described), "loans were read off the event loop"
    assert [loan["id"] for loan in info["loans"]] == ["l0", "l1", "l2"]
    assert info["max_loans"] == 8 and info["devices"] == {"cpu": 1024.0}


def test_a_lent_rpc_servers_output_stays_out_of_the_peers_answer(tmp_path: Path) -> None:
    lender = Lender(WorkerConfig(enabled=True, token=TOKEN), _failing_build(tmp_path), None,
                    lambda: {"cpu": 2**30})
    status, body = _ask_peer_api(lender, "POST", "/peer/rpc-servers", json={"model": "m"})
    assert status == 503 and body["error"]["code"] == "rpc_server_failed", body
    assert "WORKER-SECRET" not in json.dumps(body), body
    assert "rpc-server exited with code 3 at start" in body["error"]["message"]
    assert lender.loans == {}


def test_an_rpc_server_without_a_banner_is_named_without_its_output(tmp_path: Path) -> None:
    binary = rpc_server_binary(_failing_build(tmp_path, first_line=WORKER_SECRET))
    with pytest.raises(RpcError) as caught:
        rpc_version(binary)
    assert "WORKER-SECRET" not in str(caught.value)
    assert str(caught.value).startswith(f"{binary} printed no RPC version banner")
    assert caught.value.tail == [WORKER_SECRET]


def test_a_worker_lends_at_most_max_loans_at_once(start_corral: CorralFactory) -> None:
    lending = start_corral({"worker": {"enabled": True, "token": TOKEN, "max_loans": 2}})
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def ask(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=lending.url, headers=headers, timeout=60) as c:
            return list(await asyncio.gather(*(
                c.post("/peer/rpc-servers", json={"model": f"m{i}"}) for i in range(n))))

    # Three at once, two allowed: those still starting count, so exactly one is refused.
    answers = asyncio.run(ask(3))
    assert sorted(r.status_code for r in answers) == [200, 200, 429], [r.text for r in answers]
    refused = next(r for r in answers if r.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_error" and refused["code"] == "too_many_loans"
    assert "at most 2 rpc-servers at once (worker.max_loans)" in refused["message"]
    info = httpx.get(lending.url + "/peer/info", headers=headers, timeout=10).json()
    assert info["max_loans"] == 2 and len(info["loans"]) == 2
    # A loan ended makes room for one more.
    first = next(r for r in answers if r.status_code == 200).json()["id"]
    assert httpx.delete(f"{lending.url}/peer/rpc-servers/{first}", headers=headers,
                        timeout=10).status_code == 200
    again = asyncio.run(ask(1))[0]
    assert again.status_code == 200, again.text
    assert asyncio.run(ask(1))[0].status_code == 429


def test_max_loans_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="max_loans"):
        WorkerConfig(enabled=True, token=TOKEN, max_loans=0)
    assert WorkerConfig().max_loans == 8
