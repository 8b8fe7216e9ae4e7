"""Writes to a client have a deadline (proxy/client_io.py): a client that stops reading is cut
off after client_write_timeout, and the model it held is free again (issue 23, defect 6)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from corral.proxy import client_io

from conftest import TINY_RCVBUF, flooding_stream, post_reading_little, wait_until

# -- the defect, on a real corral with SmolLM2 -----------------------------------------------------

def test_a_client_that_never_reads_frees_the_model(start_corral, smol_model):
    corral = start_corral({
        "client_write_timeout": 2,
        "defaults": {"ttl": 300, "stop_grace": 5, "queue_timeout": 30},
        "models": {"smol": {"model": str(smol_model), "ctx": 4096, "parallel": 1,
                            "idle_timeout": 5}},
    })
    assert corral.chat("smol", max_tokens=1).status_code == 200  # loaded: time the stall only
    body = flooding_stream("smol")
    sock = post_reading_little(corral.url, "/v1/chat/completions", body, "stuck-reader")
    try:
        wait_until(lambda: corral.model("smol")["in_flight"] == 1, timeout=30)
        # The buffers between the child and this socket fill (the kernel's send buffer grows
        # to megabytes: ~15 s of generation on a busy 2-core machine), then 2 s without
        # progress and the client is cut off. Before the deadline existed the slot stayed
        # taken for as long as the socket lived (90 s and counting, measured).
        wait_until(lambda: corral.model("smol")["in_flight"] == 0, timeout=120, interval=0.2)
        # At llama-server's sampling, SmolLM2 may end at any token: ignore_eos makes the
        # answer's length the one asked, so the freed slot is seen to answer whole.
        resp = corral.chat("smol", max_tokens=8, ignore_eos=True, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
        stalled = corral.log_events("proxy.client_stalled")
        assert [(e["model"], e["request_id"]) for e in stalled] == [("smol", "stuck-reader")]
        metrics = corral.http.get("/metrics").text
        assert 'corral_client_write_timeouts_total{model="smol"} 1.0' in metrics, metrics
        # Accounted as a client that left, not as an answer delivered.
        accounted = [e for e in corral.log_events("proxy.request")
                     if e.get("request_id") == "stuck-reader"]
        assert [e["status"] for e in accounted] == [499], accounted
        # Cut off mid-generation: the relay stopped reading the child while the client was
        # behind (and waited for it), so the stream's last event, with its usage, never came.
        # A relay that kept reading would have taken the whole stream and stalled only at its
        # end, with 3000 tokens counted.
        assert "tokens_out" not in accounted[0], accounted
    finally:
        sock.close()


# -- client_io against a tiny aiohttp app ----------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _App:
    """A tiny aiohttp server whose one handler writes through client_io."""

    def __init__(self, handler: Handler, seconds: float,
                 more: dict[str, Handler] | None = None) -> None:
        self.stalls: list[str | None] = []
        self.app = web.Application()
        self.app[client_io.DEADLINE] = client_io.WriteDeadline(
            seconds=lambda: seconds, stalled=self.stalls.append)
        self.app.router.add_get("/", handler)
        for path, other in (more or {}).items():
            self.app.router.add_get(path, other)
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        self.port = 0

    async def __aenter__(self) -> _App:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    async def connect(self, path: str = "/", requests: int = 1) -> socket.socket:
        """A tiny-window client that has sent `requests` GETs of `path` (pipelined)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RCVBUF)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", self.port))
        await loop.sock_sendall(sock, b"GET %s HTTP/1.1\r\nHost: test\r\n\r\n"
                                % path.encode() * requests)
        return sock


async def _read_to_end(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(30):
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
            if received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked answer
                break
    return bytes(received)


def test_a_stalled_client_is_cut_off_and_reported():
    outcome: dict[str, Any] = {}
    cut_off = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        out = client_io.writer(request, response, "m")
        await out.prepare()
        written = 0
        try:
            while True:
                await out.write(b"x" * 16384)
                written += 16384
        except client_io.ClientStalled:
            outcome["written"] = written
            cut_off.set()
            raise

    async def scenario() -> None:
        async with _App(endless, seconds=0.3) as server:
            sock = await server.connect()
            try:
                # The handler gives up on its own; the timeout only bounds the test.
                async with asyncio.timeout(20):
                    await cut_off.wait()
                assert server.stalls == ["m"]
                # It wrote more than any buffer holds before it waited, then was cut off:
                # the connection ends (the rest of what was buffered, then EOF or a reset).
                assert outcome["written"] >= 65536
                tail = await _read_to_end(sock)
                assert not tail.endswith(b"\r\n0\r\n\r\n")
            finally:
                sock.close()

    asyncio.run(scenario())


def test_a_slow_reader_that_keeps_reading_gets_everything():
    total = 4 * 1024 * 1024

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        out = client_io.writer(request, response, "m")
        await out.prepare()
        for _ in range(total // 8192):
            await out.write(b"@" * 8192)
        await out.finish()
        return response

    async def scenario() -> None:
        async with _App(big, seconds=2.0) as server:
            sock = await server.connect()
            try:
                # A few KiB at a time through a tiny window: the server's buffer is full (its
                # writes wait) most of the time, and every wait ends well within the deadline.
                received = await _read_to_end(sock)
            finally:
                sock.close()
            assert server.stalls == []
            assert received.endswith(b"\r\n0\r\n\r\n")
            assert received.count(b"@") == total

    asyncio.run(scenario())


class _Timers:
    """Counts the timers the loop schedules inside `with timers:` (asyncio.timeout schedules
    one with loop.call_at). Exact when the block does not suspend, as writes to a client that
    keeps up do not: nothing else runs meanwhile."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> _Timers:
        loop = asyncio.get_running_loop()
        call_at = loop.call_at

        def counting(when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del asyncio.get_running_loop().call_at  # type: ignore[method-assign]


def test_writes_that_need_no_wait_schedule_no_timer():
    """The relay's hot path: a chunk that fits in the transport's buffer goes out without a
    timer (no asyncio.timeout per chunk), and so does the end of the stream and a small whole
    body; only a write that has to wait for the client gets one."""
    counted: dict[str, list[int]] = {"writes": [], "finish": [], "send": []}

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        out = client_io.writer(request, response, "m")
        await out.prepare()
        for n in range(200):  # 20 KB in all: below the 64 KiB high-water mark
            with _Timers() as timers:
                await out.write(b"data: %d\n\n" % n + b"z" * 90)
            counted["writes"].append(timers.count)
        with _Timers() as timers:
            await out.finish()
        counted["finish"].append(timers.count)
        return response

    async def whole(request: web.Request) -> web.StreamResponse:
        with _Timers() as timers:
            response = await client_io.send(request, web.json_response({"x": "v" * 30000}), "m")
        counted["send"].append(timers.count)
        return response

    async def scenario() -> None:
        async with _App(stream, 5.0, {"/whole": whole}) as server, httpx.AsyncClient() as http:
            streamed = await http.get(f"http://127.0.0.1:{server.port}/")
            assert streamed.content.endswith(b"z" * 90) and len(streamed.content) > 20000
            answered = await http.get(f"http://127.0.0.1:{server.port}/whole")
            assert answered.json() == {"x": "v" * 30000}
            assert server.stalls == []

    asyncio.run(scenario())
    # Every aiohttp corral allows has the writer internals the fast path reads (the probe
    # says so: tests/test_relay_fallback.py); on one without them a timer per write is by
    # design, but not here.
    assert client_io._Internals.missing is None
    assert counted == {"writes": [0] * 200, "finish": [0], "send": [0]}, counted


def test_a_whole_body_is_sent_with_the_deadline_too():
    """client_io.send: a built web.Response (a relayed JSON answer) goes out under the same
    deadline, a large one slice by slice; a client that never reads is cut off, whether one
    large answer or many small ones (pipelined requests) fill its buffers."""
    large = b'{"x": "' + b"w" * (8 * 1024 * 1024) + b'"}'
    small = b'{"x": "' + b"s" * 40000 + b'"}'
    sent: list[str] = []
    cut_off = asyncio.Event()

    def answering(body: bytes) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            answer = web.Response(body=body, status=201, headers={
                "Content-Type": "application/json", "X-Extra": "kept"})
            try:
                response = await client_io.send(request, answer, "m")
            except client_io.ClientStalled:
                cut_off.set()
                raise
            sent.append(request.path)
            return response
        return handler

    routes = {"/small": answering(small)}

    async def reading() -> None:
        async with _App(answering(large), 2.0, routes) as server, \
                httpx.AsyncClient() as http:
            for path, body in (("/", large), ("/small", small)):
                resp = await http.get(f"http://127.0.0.1:{server.port}{path}")
                assert resp.status_code == 201 and resp.content == body
                assert resp.headers["x-extra"] == "kept"
                assert resp.headers["content-type"] == "application/json"
                assert resp.headers["content-length"] == str(len(body))
            assert server.stalls == []

    async def stuck(path: str, requests: int) -> None:
        nonlocal cut_off
        cut_off = asyncio.Event()  # one per loop
        async with _App(answering(large), 0.3, routes) as server:
            sock = await server.connect(path, requests)
            try:
                async with asyncio.timeout(20):  # only a bound on the test
                    await cut_off.wait()
                assert server.stalls == ["m"]
            finally:
                sock.close()

    asyncio.run(reading())
    sent.clear()
    asyncio.run(stuck("/", 1))
    assert sent == []
    # 400 answers of 40 KB, 16 MB: more than the socket buffers hold.
    asyncio.run(stuck("/small", 400))
    assert 0 < len(sent) < 400


@pytest.mark.parametrize("seconds", [0, -1])
def test_client_write_timeout_must_be_positive(seconds):
    from pydantic import ValidationError

    from corral.supervisor.config import Config

    assert Config().client_write_timeout == 30
    with pytest.raises(ValidationError):
        Config(client_write_timeout=seconds)
