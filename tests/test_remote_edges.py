"""A remote endpoint's edges, against a stdlib stand-in that answers by the `model` asked of
it: a provider's rate limit (429/503 with Retry-After), a redirect to another host, an error
that quotes corral's own key back, and a URL with a path prefix. Plus the relay's client
against an endpoint that never completes a TCP handshake (connect timeout, once). Also what
was sound already: timeouts (a 504, `answering: false`) and a bounded, kept-alive pool."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from fake_upstream import exchanges
from raw_server import RawServer

from corral.proxy.child_http import ChildPool
from corral.proxy.errors import UpstreamFailed
from corral.proxy.forward import open_child

from conftest import RELAY_WORKERS, Corral, CorralFactory

KEY = "sk-remote-7c41d2e9b0"


def _answer(status: str, body: dict[str, Any], *extra: str) -> bytes:
    raw = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status}", "Content-Type: application/json",
            f"Content-Length: {len(raw)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + raw


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": None}}


class Remote(RawServer):
    """Each request's path, headers and body are kept, and the answer is chosen by the
    `model` the request names (its served_name)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        for _method, path, headers, raw in exchanges(conn):
            body = json.loads(raw or b"{}")
            self.seen.append((path, headers, body))
            conn.sendall(self._reply(body.get("model")))

    @staticmethod
    def _reply(model: Any) -> bytes:
        if model == "slow":  # past its first_byte_timeout: corral has hung up by then
            time.sleep(1)
        if model == "stalls":  # a stream's head and first event, then silence
            time.sleep(0.05)
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                    + _chunk(b'data: {"object": "chat.completion.chunk", "model": "stalls", '
                             b'"choices": [{"index": 0, "delta": {"content": "o"}}]}\n\n'))
        if model == "busy":
            return _answer("429 Too Many Requests", _error("Rate limit reached"),
                           "Retry-After: 7")
        if model == "overloaded":
            return _answer("503 Service Unavailable", _error("overloaded"), "Retry-After: 3")
        if model == "moved":
            return _answer("307 Temporary Redirect", _error("moved"),
                           "Location: https://elsewhere.example/v1/chat/completions")
        if model == "echo":
            return _answer("401 Unauthorized", _error(f"Incorrect API key provided: {KEY}"))
        if model == "echo-400":
            return _answer("400 Bad Request", _error(f"bad request for key Bearer {KEY}"))
        return _answer("200 OK", {
            "id": "r", "object": "chat.completion", "model": model, "choices": [{
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "ok"}}]})



@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    server = Remote()
    yield server
    server.close()


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, remote: Remote) -> Corral:
    base = f"http://127.0.0.1:{remote.port}"
    models = {name: {"backend": "remote", "url": f"{base}/openai/v1/", "api_key": KEY,
                     "served_name": name}
              for name in ("busy", "overloaded", "moved", "echo", "echo-400", "fine")}
    models["fine"]["parallel"] = 4
    for name in ("slow", "stalls"):
        models[name] = {"backend": "remote", "url": base, "api_key": KEY,
                        "first_byte_timeout": 0.3, "idle_timeout": 0.3}
    pair = {"type": "parallel", "models": ["echo", "fine"], "fallback": "partial",
            "required_responses": 1}
    corral = start_corral_module({"models": models, "groups": {"pair": pair}})
    corral.expect("proxy.request_failed", "proxy.upstream_failed")
    return corral


def test_a_remotes_retry_after_reaches_the_client(corral: Corral) -> None:
    answer = corral.chat("busy")
    assert answer.status_code == 429, answer.text
    assert answer.headers.get("Retry-After") == "7", answer.headers
    assert answer.json()["error"]["message"] == "Rate limit reached", answer.json()
    answer = corral.chat("overloaded")
    assert answer.status_code == 503, answer.text
    assert answer.headers.get("Retry-After") == "3", answer.headers


def test_a_remotes_redirect_is_a_502_never_passed_on_nor_followed(
        corral: Corral, remote: Remote) -> None:
    before = len(remote.seen)
    for stream in (False, True):
        answer = corral.chat("moved", stream=stream)
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "upstream_redirect", answer.json()
        assert "Location" not in answer.headers, answer.headers
    assert len(remote.seen) == before + 2  # asked once each, nothing followed


def test_a_remote_that_quotes_corrals_key_never_shows_it(corral: Corral) -> None:
    for model, status in (("echo", 502), ("echo-400", 400)):
        answer = corral.chat(model)
        assert answer.status_code == status, answer.text
        assert KEY not in answer.text, answer.text
    # A group's member: its error is in the group's answer.
    answer = corral.http.post("/v1/batch/execute", json={
        "group": "pair", "messages": [{"role": "user", "content": "hi"}]})
    assert "Incorrect API key provided: [redacted]" in answer.text, answer.text
    assert KEY not in answer.text, answer.text
    assert KEY not in corral.log_path.read_text()


def test_the_key_and_the_path_prefix_go_to_the_remote(corral: Corral, remote: Remote) -> None:
    answer = corral.chat("fine")
    assert answer.status_code == 200 and answer.json()["model"] == "fine", answer.text
    path, headers, body = remote.seen[-1]
    assert path == "/openai/v1/chat/completions", path
    assert headers["authorization"] == f"Bearer {KEY}", headers
    assert headers["host"] == f"127.0.0.1:{remote.port}", headers
    assert body["model"] == "fine"


def test_a_silent_remote_is_a_504_within_its_timeouts_and_not_answering(
        corral: Corral) -> None:
    began = time.monotonic()
    answer = corral.chat("slow")
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "upstream_timeout", answer.json()
    with corral.http.stream("POST", "/v1/chat/completions", json={
            "model": "stalls", "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as stream:
        text = "".join(stream.iter_text())
    assert stream.status_code == 200 and "upstream_timeout" in text, text
    assert time.monotonic() - began < 2.5  # two waits of 0.3 s, and the requests
    listed = {m["id"]: m for m in corral.http.get("/v1/models").json()["data"]}
    assert listed["slow"]["answering"] is False and listed["stalls"]["answering"] is False


def test_many_requests_at_once_share_a_few_kept_alive_connections(
        corral: Corral, remote: Remote) -> None:
    before = remote.connections
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: corral.chat("fine"), range(48)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    # `parallel` at once, each kept for the next; each relay worker keeps its own.
    assert remote.connections - before <= 4 * max(1, RELAY_WORKERS)


def test_a_connect_that_hangs_costs_one_connect_timeout_not_three() -> None:
    """An endpoint that never completes the handshake (a firewall that drops SYNs, here a
    listener whose accept queue is full) is given up after one connect timeout: a connect
    is not sent again at once, as a stale kept-alive connection would be."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # the accept queue full: later SYNs are dropped, the connect hangs
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    lease = SimpleNamespace(base_url=f"http://127.0.0.1:{port}", served_name=None, headers={},
                            first_byte_timeout=5.0, idle_timeout=5.0, pid=None,
                            child_alive=lambda: True, refused=lambda: None)

    async def pin(_url: str, body: bytes, _parsed: Any = None) -> bytes:
        return body
    lease.pin = pin

    async def attempt() -> float:
        pool = ChildPool(connect_timeout=0.5)
        began = time.monotonic()
        with pytest.raises(UpstreamFailed, match=r"within 0\.5s"):
            await open_child(pool, "/v1/chat/completions", "far", lease,  # type: ignore[arg-type]
                             b"{}", "application/json")
        return time.monotonic() - began

    try:
        assert asyncio.run(attempt()) < 1.2
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
