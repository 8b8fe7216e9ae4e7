"""proxy/child_http: the relay's own client to children, against small asyncio servers that
misbehave on purpose (the whole relay over it is tested with real children in test_serving,
test_faults, test_reliability and test_client_io)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from corral.proxy.child_http import _HIGH, Broken, ChildPool, NotBegun, Silent

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await reader.readexactly(length)


def _answer(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def test_a_kept_alive_connection_serves_the_next_request() -> None:
    async def main() -> None:
        connections = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            while True:
                try:
                    request = await _read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                assert request.startswith(b"POST /v1/x HTTP/1.1\r\n")
                writer.write(_answer(b'{"n": %d}' % request.count(b"secret")))

        server, url = await _serve(handler)
        pool = ChildPool()
        for _ in range(3):
            answer = await pool.post(url, "/v1/x", {"Authorization": "secret"}, b"{}")
            assert answer.status == 200 and answer.content_type == "application/json"
            assert await answer.read() == b'{"n": 1}'
            answer.release()
        assert connections == 1
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_connection_closed_under_the_request_is_not_begun() -> None:
    """The child closed a kept-alive connection as the request went out (cpp-httplib after 5 s
    idle or 100 requests): NotBegun, which the relay sends again."""
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(_answer(b"{}"))
            await _read_request(reader)  # the second request: closed, unanswered
            writer.close()

        server, url = await _serve(handler)
        pool = ChildPool()
        first = await pool.post(url, "/v1/x", {}, b"{}")
        await first.read()
        first.release()
        with pytest.raises(NotBegun):
            await pool.post(url, "/v1/x", {}, b"{}")
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_body_without_length_ends_with_the_connection() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                         b"data: 1\n\n")
            await writer.drain()
            writer.write(b"data: [DONE]\n\n")
            writer.close()

        server, url = await _serve(handler)
        pool = ChildPool()
        answer = await pool.post(url, "/v1/x", {}, b"{}")
        assert answer.content_type == "text/event-stream"
        assert await answer.read() == b"data: 1\n\ndata: [DONE]\n\n"
        answer.release()
        pool.close()
        server.close()

    asyncio.run(main())


def test_silences_past_the_limits_are_silent() -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request = await _read_request(reader)
            if b"no-head" in request:
                await asyncio.sleep(5)
                return
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(5)

        server, url = await _serve(handler)
        pool = ChildPool()
        with pytest.raises(Silent):
            await pool.post(url, "/v1/x", {}, b"no-head", first_byte_timeout=0.2)
        answer = await pool.post(url, "/v1/x", {}, b"{}", first_byte_timeout=5,
                                 idle_timeout=0.3)
        assert await answer.chunk() == b"hello"
        with pytest.raises(Silent):
            await answer.chunk()
        answer.close()
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_reader_that_is_behind_stops_the_reading_of_the_child() -> None:
    """Back-pressure: what the child sends while nobody takes it is buffered up to _HIGH, then
    its socket is not read (the child waits in its send); all of it arrives once read."""
    total = 64 * _HIGH

    async def main() -> None:
        sent = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sent
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
            piece = b"x" * 65536
            while sent < total:
                writer.write(piece)
                await writer.drain()
                sent += len(piece)

        server, url = await _serve(handler)
        pool = ChildPool()
        answer = await pool.post(url, "/v1/x", {}, b"{}")
        async with asyncio.timeout(30):
            while not answer._conn._paused:  # nobody reads: the child is held back
                await asyncio.sleep(0.01)
        assert answer._buffered <= 2 * _HIGH  # _HIGH and one read of the socket at most
        assert sent < total
        got = 0
        while data := await answer.chunk():
            got += len(data)
        assert got == total
        answer.release()
        pool.close()
        server.close()

    asyncio.run(main())


def test_an_idle_connection_the_child_closes_is_forgotten() -> None:
    """A child that closes its idle connections (or stops) leaves nothing in the pool."""
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(_answer(b"{}"))
            await writer.drain()
            writer.close()  # after the answer: the client's kept connection is now dead

        server, url = await _serve(handler)
        pool = ChildPool()
        answer = await pool.post(url, "/v1/x", {}, b"{}")
        await answer.read()
        answer.release()
        async with asyncio.timeout(30):
            while pool._idle:
                await asyncio.sleep(0.01)
        pool.close()
        server.close()

    asyncio.run(main())


def _events_handler(count: int, sent: list[int], hung_up: asyncio.Event | None = None,
                    writers: list[asyncio.StreamWriter] | None = None) -> Handler:
    """A child that streams `count` chunked SSE events of 1 KiB, one write (and drain) each,
    counting in `sent` what its socket took; `hung_up` is set when its writes fail."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if writers is not None:
            writers.append(writer)
            # A small send buffer: the child waits in its send after a little, as a model
            # does behind a full socket (loopback's buffers grow to megabytes otherwise).
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                       64 * 1024)
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        event = b"data: " + b"x" * 1016 + b"\n\n"
        try:
            for _ in range(count):
                writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                await writer.drain()
                sent[0] += 1
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            if hung_up is not None:
                hung_up.set()

    return handler


@pytest.mark.parametrize("behind_after", [1, 5])
def test_pump_stops_reading_the_child_when_the_sink_is_behind(behind_after: int) -> None:
    """pump(): the body goes to the sink from the connection's callback; a sink that says its
    client is behind stops the reading of the child at once (the child waits in its send, no
    bytes pile up here), and the next pump() reads it again; all of it arrives. Behind at the
    first bytes (those that came with the head, handed over by pump() itself) or later (in
    the connection's callback)."""
    count = 32000  # 32 MiB: more than the sockets between here and the child hold

    async def main() -> None:
        sent = [0]
        writers: list[asyncio.StreamWriter] = []
        server, url = await _serve(_events_handler(count, sent, writers=writers))
        pool = ChildPool()
        answer = await pool.post(url, "/v1/x", {}, b"{}")
        got: list[bytes] = []
        hold = True

        def sink(data: bytes) -> bool:
            got.append(data)
            return hold and len(got) >= behind_after

        async with asyncio.timeout(30):
            assert await answer.pump(sink)  # "behind": the child is paused
            assert answer._conn._paused
            calls = len(got)
            # The child keeps sending until the sockets are full, then waits in its send
            # (its buffer past asyncio's high-water mark, 64 KiB).
            while (writers[0].transport.get_write_buffer_size() < 64 * 1024
                   and sent[0] < count):
                await asyncio.sleep(0.01)
            assert len(got) == calls and answer._buffered == 0  # nothing read meanwhile
            assert sent[0] < count
            hold = False
            assert not await answer.pump(sink)  # to the end
        body = b"".join(got)
        assert body.count(b"data: ") == count and len(body) == count * 1024
        answer.release()
        pool.close()
        server.close()

    asyncio.run(main())


def test_pump_raises_what_the_sink_raised_for_a_client_gone() -> None:
    """A client gone (the sink raises ConnectionResetError) ends pump() with it, so that the
    relay closes the child's connection: the child sees the hang-up."""
    async def main() -> None:
        sent = [0]
        hung_up = asyncio.Event()
        server, url = await _serve(_events_handler(100000, sent, hung_up))
        pool = ChildPool()
        answer = await pool.post(url, "/v1/x", {}, b"{}")
        taken = 0

        def sink(data: bytes) -> bool:
            nonlocal taken
            taken += 1
            if taken == 3:
                raise ConnectionResetError("the client closed the connection")
            return False

        async with asyncio.timeout(30):
            with pytest.raises(ConnectionResetError):
                await answer.pump(sink)
            assert taken == 3
            answer.close()
            await hung_up.wait()  # the child's writes fail: it saw the hang-up
        assert answer._conn.closed and sent[0] < 100000
        pool.close()
        server.close()

    asyncio.run(main())


def test_an_interim_answer_is_never_taken_for_the_answer() -> None:
    """A child that sends 103 Early Hints (or 100 Continue) before its 200: the request gets its
    200 and body, and the next request on the same kept-alive connection gets its own answer
    (before: the 103 was the answer, and the next request got the first one's)."""
    async def main() -> None:
        connections = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            while True:
                try:
                    request = await _read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                name = b"A" if b'"A"' in request else b"B"
                writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x.css>; rel=preload\r\n\r\n")
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # the final answer in a later packet, as it comes
                writer.write(_answer(b'{"for": "%s"}' % name))

        server, url = await _serve(handler)
        pool = ChildPool()
        for name in ("A", "B", "A"):
            answer = await pool.post(url, "/v1/x", {}, b'{"who": "%s"}' % name.encode())
            assert answer.status == 200, answer.status
            assert dict(answer.headers).get(b"Link") is None  # the interim's headers are gone
            assert await answer.read() == b'{"for": "%s"}' % name.encode()
            answer.release()
        assert connections == 1  # all three on one kept-alive connection
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_new_connection_closed_after_the_request_is_broken_not_begun() -> None:
    """The child (a remote) read the request, perhaps did the work, and closed without a byte:
    Broken, which nothing sends again (NotBegun is only for a kept-alive connection)."""
    async def main() -> None:
        seen = 0

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal seen
            await _read_request(reader)
            seen += 1
            writer.close()

        server, url = await _serve(handler)
        pool = ChildPool()
        with pytest.raises(Broken) as broke:
            await pool.post(url, "/v1/x", {}, b"{}")
        assert not isinstance(broke.value, NotBegun) and seen == 1
        pool.close()
        server.close()

    asyncio.run(main())
