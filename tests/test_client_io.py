"""Writes to a client have a deadline (proxy/client_io.py): a client that stops reading is cut
off after client_write_timeout, and the model it held is free again (issue 23, defect 6)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web

from corral.proxy import client_io

from conftest import wait_until

# A receive buffer the kernel rounds up to a few KiB: the server's writes back up at once.
TINY_RCVBUF = 4096


def _raw_client(host: str, port: int) -> socket.socket:
    """A client socket that will read nothing (or little): tiny receive buffer, set before
    the connection so the advertised window stays small."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RCVBUF)
    sock.settimeout(10)
    sock.connect((host, port))
    return sock


# -- the defect, on a real corral with SmolLM2 -----------------------------------------------------

def test_a_client_that_never_reads_frees_the_model(start_corral, smol_model):
    corral = start_corral({
        "client_write_timeout": 2,
        "defaults": {"ttl": 300, "stop_grace": 5, "queue_timeout": 30},
        "models": {"smol": {"model": str(smol_model), "ctx": 4096, "parallel": 1,
                            "idle_timeout": 5}},
    })
    assert corral.chat("smol", max_tokens=1).status_code == 200  # loaded: time the stall only
    # Thousands of tokens, each with 20 alternatives: megabytes of SSE, far more than every
    # buffer between the child and this socket holds.
    body = json.dumps({
        "model": "smol", "stream": True, "max_tokens": 3000, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 20,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
    }).encode()
    address = urlsplit(corral.url)
    assert address.hostname and address.port
    sock = _raw_client(address.hostname, address.port)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n"
                     b"Content-Type: application/json\r\nX-Request-Id: stuck-reader\r\n"
                     b"Content-Length: %d\r\n\r\n%s"
                     % (address.netloc.encode(), len(body), body))
        wait_until(lambda: corral.model("smol")["in_flight"] == 1, timeout=30)
        # The buffers between the child and this socket fill (the kernel's send buffer grows
        # to megabytes: ~15 s of generation on a busy 2-core machine), then 2 s without
        # progress and the client is cut off. Before the deadline existed the slot stayed
        # taken for as long as the socket lived (90 s and counting, measured).
        wait_until(lambda: corral.model("smol")["in_flight"] == 0, timeout=120, interval=0.2)
        resp = corral.chat("smol", max_tokens=8, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] > 0
        stalled = corral.log_events("proxy.client_stalled")
        assert [(e["model"], e["request_id"]) for e in stalled] == [("smol", "stuck-reader")]
        metrics = corral.http.get("/metrics").text
        assert 'corral_client_write_timeouts_total{model="smol"} 1.0' in metrics, metrics
        # Accounted as a client that left, not as an answer delivered.
        accounted = [e["status"] for e in corral.log_events("proxy.request")
                     if e.get("request_id") == "stuck-reader"]
        assert accounted == [499], accounted
    finally:
        sock.close()


# -- client_io against a tiny aiohttp app ----------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _App:
    """A tiny aiohttp server whose one handler writes through client_io."""

    def __init__(self, handler: Handler, seconds: float) -> None:
        self.stalls: list[str | None] = []
        self.app = web.Application()
        self.app[client_io.DEADLINE] = client_io.WriteDeadline(
            seconds=lambda: seconds, stalled=self.stalls.append)
        self.app.router.add_get("/", handler)
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

    async def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TINY_RCVBUF)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", self.port))
        await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
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


def test_writes_below_the_high_water_mark_schedule_no_timer():
    """The relay's hot path: a chunk that fits in the transport's buffer goes out without a
    timer (no asyncio.timeout per chunk); only a write that has to wait gets one."""
    timers: list[int] = []

    async def small(request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        scheduled = [0]
        call_at = loop.call_at

        def counting(when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
            scheduled[0] += 1
            return call_at(when, callback, *args, **kwargs)

        response = web.StreamResponse()
        out = client_io.writer(request, response, "m")
        await out.prepare()
        loop.call_at = counting  # type: ignore[method-assign]
        try:
            for n in range(200):  # 20 KB in all: below the 64 KiB high-water mark
                await out.write(b"data: %d\n\n" % n + b"z" * 90)
                timers.append(scheduled[0])
        finally:
            del loop.call_at  # type: ignore[method-assign]
        await out.finish()
        return response

    async def scenario() -> None:
        async with _App(small, seconds=5.0) as server:
            sock = await server.connect()
            try:
                received = await _read_to_end(sock)
            finally:
                sock.close()
            assert received.endswith(b"\r\n0\r\n\r\n") and server.stalls == []

    asyncio.run(scenario())
    assert len(timers) == 200 and timers[-1] == 0, timers[-5:]


def test_a_whole_body_is_sent_with_the_deadline_too():
    """client_io.send: a built web.Response (a relayed JSON answer) goes out slice by slice
    under the same deadline; a client that never reads it is cut off."""
    body = b'{"x": "' + b"w" * (8 * 1024 * 1024) + b'"}'
    sent: dict[str, Any] = {}
    cut_off = asyncio.Event()

    async def whole(request: web.Request) -> web.StreamResponse:
        answer = web.Response(body=body, status=201, headers={"Content-Type": "application/json",
                                                              "X-Extra": "kept"})
        try:
            sent["response"] = await client_io.send(request, answer, "m")
        except client_io.ClientStalled:
            cut_off.set()
            raise
        return sent["response"]

    async def reading() -> None:
        async with _App(whole, seconds=2.0) as server, httpx.AsyncClient() as http:
            resp = await http.get(f"http://127.0.0.1:{server.port}/")
            assert resp.status_code == 201 and resp.content == body
            assert resp.headers["x-extra"] == "kept"
            assert resp.headers["content-type"] == "application/json"
            assert resp.headers["content-length"] == str(len(body))
            assert server.stalls == []

    async def stuck() -> None:
        async with _App(whole, seconds=0.3) as server:
            sock = await server.connect()
            try:
                async with asyncio.timeout(20):
                    await cut_off.wait()
                assert server.stalls == ["m"] and "response" not in sent
            finally:
                sock.close()

    asyncio.run(reading())
    sent.clear()
    asyncio.run(stuck())


@pytest.mark.parametrize("seconds", [0, -1])
def test_client_write_timeout_must_be_positive(seconds):
    from pydantic import ValidationError

    from corral.supervisor.config import Config

    assert Config().client_write_timeout == 30
    with pytest.raises(ValidationError):
        Config(client_write_timeout=seconds)
