"""Hostile clients at the HTTP level, on a real corral over raw sockets (what no SDK sends):
nothing a client puts in its request head reaches a child beyond its body and its Accept, a
malformed head is refused with the connection closed (and no traceback per request in the
log), and one client that holds connections cannot starve the daemon of descriptors (its
children's health probes, the other clients)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_upstream import exchanges
from lifecycle_harness import FAKE
from raw_server import RawServer

from conftest import RELAY_WORKERS, Corral, CorralFactory, wait_until

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "model": "far", "choices": [
    {"index": 0, "finish_reason": "stop",
     "message": {"role": "assistant", "content": "ok"}}]}).encode()
BODY = json.dumps({"model": "far", "messages": [{"role": "user", "content": "hi"}]}).encode()


class Recorder(RawServer):
    """A remote endpoint that records each request's head and body, and answers a chat."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        for exchange in exchanges(conn):
            self.seen.append(exchange)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)


@pytest.fixture(scope="module")
def remote() -> Iterator[Recorder]:
    recorder = Recorder()
    yield recorder
    recorder.close()


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, remote: Recorder) -> Corral:
    config = {"models": {"far": {"backend": "remote", "url": f"http://127.0.0.1:{remote.port}",
                                 "api_key": "the-remotes-key"}},
              "api_keys": ["user-key"], "admin_api_keys": ["admin-key"],
              # A client's silence, its answer's or its body's, is cut short here.
              "client_write_timeout": 1, "max_body_mb": 1}
    return start_corral_module(config, api_key="admin-key")


def _exchange(corral: Corral, data: bytes, to_the_end: bool = False) -> tuple[bytes, bool]:
    """Send `data` on a new connection; what came back, and whether corral closed the
    connection. `to_the_end`: read until corral closes it (False after 10 s), else only the
    answer (by its Content-Length)."""
    host, port = corral.url.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        got = b""
        while True:
            if got.startswith(b"HTTP/1.1 100 "):  # an interim answer (Expect: 100-continue)
                interim, sep, got = got.partition(b"\r\n\r\n")
                if not sep:
                    got = interim
            head, sep, rest = got.partition(b"\r\n\r\n")
            if sep and not to_the_end:
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(rest) >= length:
                    return got, False
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return got, True
            except TimeoutError:
                return got, False
            if not chunk:
                return got, True
            got += chunk


def _post(head: bytes = b"", body: bytes = BODY, length: bool = True,
          target: bytes = b"/v1/chat/completions") -> bytes:
    lines = (b"POST " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
             b"Authorization: Bearer user-key\r\nContent-Type: application/json\r\n" + head)
    if length:
        lines += b"Content-Length: %d\r\n" % len(body)
    return lines + b"\r\n" + body


def _chunked(body: bytes, extension: bytes = b"", trailer: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n0\r\n%s\r\n" % (len(body), extension, body, trailer)


# What a client may try to slip past corral to the child: a second framing of the body (a
# request smuggled in it), or a header of its own inside another's value.
MALFORMED = {
    "content-length and chunked": _post(b"Transfer-Encoding: chunked\r\n"),
    "two content-lengths": _post(b"Content-Length: 5\r\n"),
    "chunked, identity": _post(b"Transfer-Encoding: chunked, identity\r\n",
                               _chunked(BODY), length=False),
    "obs-fold": _post(b"Accept: text/html\r\n Authorization: Bearer forged\r\n"),
    "CR in a value": _post(b"Accept: a\rAuthorization: Bearer forged\r\n"),
    "LF in a value": _post(b"Accept: a\nAuthorization: Bearer forged\r\n"),
    "NUL in a value": _post(b"Accept: a\x00b\r\n"),
    "a header past 8 KiB": _post(b"X-Big: " + b"a" * 10_000 + b"\r\n"),
    "200 headers": _post(b"".join(b"X-H%d: v\r\n" % i for i in range(200))),
    "a request line past 8 KiB": _post(target=b"/v1/" + b"a" * 10_000),
    "not HTTP": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_head_is_refused_closed_and_never_relayed(corral: Corral, remote: Recorder,
                                                              name: str) -> None:
    before = len(remote.seen)
    got, closed = _exchange(corral, MALFORMED[name], to_the_end=True)
    assert got.startswith(b"HTTP/1.") and got.split(b" ", 2)[1] == b"400", got[:300]
    assert closed, "the connection stays open after a request whose framing is in doubt"
    # In the OpenAI error shape, as every other refusal: an SDK reads its message.
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "bad_http_request" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("malformed HTTP request: "), error
    assert len(remote.seen) == before
    # The daemon log (checked at the module's end) has no traceback for it: anyone can send
    # these, as fast as the line allows.


def test_only_corrals_own_headers_reach_the_child(corral: Corral, remote: Recorder) -> None:
    """Headers a client may send to steer the request to the child: none passes. corral's
    key replaces the client's, and the child sees corral's Host, framing and connection."""
    forged = (b"X-Api-Key: user-key\r\nHost2: evil\r\nX-Forwarded-For: 10.0.0.1\r\n"
              b"X-Forwarded-Host: evil\r\nConnection: keep-alive, X-Secret\r\nX-Secret: 1\r\n"
              b"Upgrade: h2c\r\nTE: trailers\r\nCookie: a=b\r\nX-HTTP-Method-Override: GET\r\n"
              b"Proxy-Authorization: Basic eDp5\r\nAccept: text/plain\r\n")
    cases = {
        "content-length": _post(forged),
        "chunked, extensions and a trailer": _post(
            forged + b"Transfer-Encoding: chunked\r\n",
            _chunked(BODY, b";ext=1", b"Authorization: Bearer forged\r\n"), length=False),
        "absolute-form": _post(forged, target=b"http://evil.example/v1/chat/completions"),
        "expect 100-continue": _post(forged + b"Expect: 100-continue\r\n"),
    }
    for name, data in cases.items():
        before = len(remote.seen)
        got, _ = _exchange(corral, data)
        assert b" 200 " in got.split(b"\r\n", 1)[0], (name, got[:300])
        assert len(remote.seen) == before + 1, name
        method, path, headers, body = remote.seen[-1]
        assert (method, path, body) == ("POST", "/v1/chat/completions", BODY), name
        assert headers == {"host": f"127.0.0.1:{remote.port}",
                           "content-length": str(len(BODY)),
                           "content-type": "application/json", "accept": "text/plain",
                           "accept-encoding": "identity",
                           "authorization": "Bearer the-remotes-key"}, name


def test_pipelined_requests_are_answered_in_order(corral: Corral, remote: Recorder) -> None:
    before = len(remote.seen)
    host, port = corral.url.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(_post() + _post(b"Connection: close\r\n"))
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert got.count(b"HTTP/1.1 200 OK") == 2, got[:500]
    assert len(remote.seen) == before + 2


def _answer_then_close(corral: Corral, data: bytes,
                       wait_close: bool = True) -> tuple[int, dict[str, str], bool]:
    """Send `data` (and no more): the status and error of the answer, and (`wait_close`)
    whether corral then closed the connection (within 30 s: aiohttp reads what may still
    come for 10 s)."""
    host, port = corral.url.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        try:
            closed = wait_close and sock.recv(65536) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"], closed


def test_a_body_that_stops_coming_is_a_408_and_the_connection_closes(
        corral: Corral, remote: Recorder) -> None:
    before = len(remote.seen)
    head = _post(body=b"x" * 1000)[:-1000]  # the head announces 1000 bytes
    status, error, closed = _answer_then_close(corral, head + BODY[:10])
    assert (status, error["code"], closed) == (408, "request_timeout", True), error
    # No byte of it; a chunk begun and never finished, and no last chunk.
    for data in (head, _post(b"Transfer-Encoding: chunked\r\n",
                             b"%x\r\n" % len(BODY) + BODY[:10], length=False)):
        status, error, _ = _answer_then_close(corral, data, wait_close=False)
        assert (status, error["code"]) == (408, "request_timeout"), error
    assert len(remote.seen) == before


def test_a_body_announced_past_the_limit_is_refused_before_it_comes(corral: Corral) -> None:
    head = _post(body=b"x" * (2 << 20))[:-(2 << 20)]  # 2 MiB announced, max_body_mb 1
    status, error, _ = _answer_then_close(corral, head, wait_close=False)
    assert (status, error["code"]) == (413, "request_too_large"), error
    # One byte over the limit, sent: 413; at the limit: read (and refused as JSON, 400).
    limit = 1 << 20
    for size, code in ((limit + 1, "request_too_large"), (limit, "invalid_json")):
        resp = corral.http.post("/v1/chat/completions", content=b" " * size,
                                headers={"Content-Type": "application/json"})
        assert resp.json()["error"]["code"] == code, (size, resp.text)


def test_idle_connections_at_the_descriptor_limit_starve_neither_children_nor_clients(
        start_corral: CorralFactory, tiny_models: dict[str, Path]) -> None:
    """One client opens more connections than the daemon has descriptors and sends nothing.
    The watchdog's probes of the child go on (it is not killed as unresponsive), and another
    client's request is served once the idle connections made room."""
    config = {"binary": str(FAKE),
              "defaults": {"health_interval": 0.1, "health_timeout": 2, "health_failures": 1,
                           "ctx": 512, "ttl": 300},
              "models": {"m": {"model": str(tiny_models["tiny-a"])}},
              "client_write_timeout": 2}
    if RELAY_WORKERS:
        config["relay_workers"] = 1  # one listening process, as the daemon alone is
    corral = start_corral(config)
    assert corral.chat("m").status_code == 200
    child = corral.child_pids()
    listening = corral.relay_worker_pids()[-1] if RELAY_WORKERS else corral.proc.pid
    # Room for the daemon's own descriptors (~40 here) and 72 clients (listener.py's reserve).
    resource.prlimit(listening, resource.RLIMIT_NOFILE, (200, 200))
    host, port = corral.url.rsplit("/", 1)[1].rsplit(":", 1)
    held: list[socket.socket] = []
    try:
        for _ in range(300):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((host, int(port)))  # EINPROGRESS: the kernel completes it
            held.append(sock)

        def closed_by_corral(sock: socket.socket) -> bool:
            try:
                return sock.recv(1) == b""
            except BlockingIOError:
                return False
            except ConnectionError:
                return True

        # Past the cap (72 here), each new connection closed an idle one to make room.
        wait_until(lambda: sum(map(closed_by_corral, held)) >= 200, timeout=30)
        assert len(os.listdir(f"/proc/{listening}/fd")) < 200
        # Probes (every 0.1 s) ran while the connections were held: the child lives on.
        probes = len(corral.log_events("instance.health_failed"))

        def served() -> bool:
            try:
                return corral.chat("m", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(served, timeout=30)
        assert probes == 0 and not corral.log_events("instance.health_failed")
        assert corral.model("m")["state"] == "ready"
        assert corral.child_pids() == child

        # Connections that are not idle (each has announced a body and sent none) are not
        # closed for a new one: past the cap it is cut, until the bodies' deadline
        # (client_write_timeout) frees them.
        for sock in held:
            sock.close()
        held.clear()
        head = _post(body=b"x" * 1000)[:-1000]
        for _ in range(100):
            sock = socket.socket()
            sock.settimeout(5)
            held.append(sock)
            with contextlib.suppress(OSError):  # cut at the cap
                sock.connect((host, int(port)))
                sock.sendall(head)
        wait_until(lambda: corral.log_events("proxy.connections_full"), timeout=30)
        wait_until(served, timeout=60)
        assert corral.child_pids() == child
    finally:
        for sock in held:
            sock.close()


def test_the_depth_bound_is_exact_for_arrays_and_objects() -> None:
    from corral.proxy.validate import MAX_DEPTH, parse_json_object, too_deep

    def nested(depth: int) -> bytes:  # `depth` containers in all, the top object included
        inner = b"[" * (depth - 2) + b"]" * (depth - 2)
        return b'{"model": "m", "a": {"b": ' + inner + b"}}"

    assert parse_json_object(nested(MAX_DEPTH))["model"] == "m"
    with pytest.raises(Exception, match="nested more than"):
        parse_json_object(nested(MAX_DEPTH + 1))
    wide = [[] for _ in range(100_000)]  # breadth is not depth
    assert not too_deep({"x": wide}) and not too_deep("[[[[") and not too_deep([])


def test_a_body_of_too_many_arrays_is_refused_before_it_is_parsed() -> None:
    """Parsing millions of small arrays held the event loop for seconds (every client, every
    health probe): past MAX_CONTAINERS the body is refused, while brackets inside strings (a
    prompt of code) do not count."""
    from corral.proxy.errors import ApiError
    from corral.proxy.validate import MAX_CONTAINERS, parse_json_object

    def arrays(count: int) -> bytes:  # the top object and its list included
        return b'{"model": "m", "x": [' + b",".join([b"[]"] * (count - 2)) + b"]}"

    assert len(parse_json_object(arrays(MAX_CONTAINERS))["x"]) == MAX_CONTAINERS - 2
    with pytest.raises(ApiError, match="arrays and objects") as refused:
        parse_json_object(arrays(MAX_CONTAINERS + 1))
    assert refused.value.status == 400
    code = 'if (a[i]) { b[j] = {"k": [1]}; }\n' * (MAX_CONTAINERS // 2)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": code}]})
    assert parse_json_object(body.encode())["messages"][0]["content"] == code
