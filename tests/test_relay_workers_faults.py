"""Relay workers (proxy/workers) where a request ends at the wrong moment, or comes in an odd
shape. Most are on the two ends of the lease link (hub.py, the daemon's; remote.py, the
worker's) joined by a socket pair in one process, over a daemon stand-in whose leases say in
what order they were pinned, unwound and given back. What corral guarantees: every lease the
daemon grants a worker's request goes back exactly once, and after whatever the request's pin
was still doing (the daemon's own requests unwind in that order: a cancelled restore marks
its slot unsure, then the release frees it). The last are on a real daemon with workers: a
request a worker forwards is answered as the daemon alone answers it."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from corral.proxy.workers import frames
from corral.proxy.workers.hub import Hub
from corral.proxy.workers.remote import LeaseGrant, Link, RemoteDaemon
from corral.supervisor.port import Broken, Lease

from conftest import Corral, CorralFactory, tiny_config, wait_until

URL = "http://127.0.0.1:1/v1/chat/completions"


class _Daemon:
    """What Hub reads of the daemon, with leases that log what happens to them."""

    def __init__(self) -> None:
        self.events = SimpleNamespace(listen=lambda callback: None)
        self.loaded = SimpleNamespace(config=None, aliases={}, groups={})
        self.closing = False
        self.story: list[str] = []
        self.pinning = asyncio.Event()
        self.released = asyncio.Event()
        self.granted = 0

    def model_names(self) -> list[str]:
        return []

    def spec(self, name: str) -> Any:
        raise KeyError(name)

    def ready_now(self, name: str) -> bool:
        return False

    async def acquire(self, name: str, *, ignore_backoff: bool = False) -> Lease:
        self.granted += 1
        return Lease(cast(Any, _Owner(self)), model=name, instance=name, pid=None,
                     base_url="http://127.0.0.1:1", headers={}, first_byte_timeout=None,
                     idle_timeout=None, ready_since=0.0, prompt_slots=cast(Any, _Slots(self)))


class _Owner:
    def __init__(self, daemon: _Daemon) -> None:
        self._daemon = daemon

    def _give_back(self, lease: Lease) -> None:
        self._daemon.story.append("given back")
        self._daemon.released.set()

    def _child_alive(self, lease: Lease) -> bool:
        return True

    async def _broken(self, lease: Lease, timed_out: bool) -> Broken:
        return Broken(unresponsive=False, detail=None)


class _Slots:
    """A prompt cache whose pin restores into a slot for as long as it is let (forever)."""

    def __init__(self, daemon: _Daemon) -> None:
        self._daemon = daemon

    async def pin(self, lease: Lease, url: str, body: Any, parsed: Any, caller: Any) -> Any:
        lease.slot = 0
        self._daemon.story.append("pinned")
        self._daemon.pinning.set()
        try:
            await asyncio.Event().wait()  # the restore into the slot
        except asyncio.CancelledError:
            self._daemon.story.append("pin unwound")  # Slots._ready: the slot marked unsure
            raise
        return body

    def unpin(self, lease: Lease) -> None:
        self._daemon.story.append("unpinned")


async def _joined() -> tuple[_Daemon, Hub, Link, RemoteDaemon, asyncio.Task[None]]:
    """A hub serving one worker's link, and that worker's end (its first snapshot applied)."""
    daemon = _Daemon()
    hub = Hub(cast(Any, daemon), cast(Any, None))
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    serving = asyncio.create_task(hub.serve(*await asyncio.open_unix_connection(sock=ours)))
    link = Link(*await asyncio.open_unix_connection(sock=theirs))
    link._task = asyncio.create_task(link._read())
    remote = RemoteDaemon(link, await asyncio.wait_for(link.snapshots.get(), 10))
    return daemon, hub, link, remote, serving


async def _request(remote: RemoteDaemon) -> None:
    """A worker's request as the relay makes it (proxy/upstream.leased): lease, pin, release."""
    lease = await remote.acquire("m")
    try:
        await lease.pin(URL, b"{}")
    finally:
        lease.release()


def test_a_client_gone_during_a_pin_frees_the_slot_after_the_pin_unwound() -> None:
    """The worker's client hangs up while the daemon restores a saved prompt into the
    request's slot: the worker's cancel and release reach the daemon in one frame. The pin
    must unwind before the lease goes back; released first, the unwinding pin took the slot
    again (Choice.take) after its release, and it stayed leased for good."""
    async def scenario() -> list[str]:
        daemon, _hub, link, remote, serving = await _joined()
        request = asyncio.create_task(_request(remote))
        await asyncio.wait_for(daemon.pinning.wait(), 10)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        await asyncio.wait_for(daemon.released.wait(), 10)
        await link.close()
        await asyncio.wait_for(serving, 10)
        return daemon.story

    assert asyncio.run(scenario()) == ["pinned", "pin unwound", "unpinned", "given back"]


def test_a_worker_gone_during_a_pin_frees_the_slot_after_the_pin_unwound() -> None:
    """The same when the worker itself goes away mid-pin (killed): the hub cancels its calls
    and gives back its leases, the pin's unwinding first."""
    async def scenario() -> list[str]:
        daemon, _hub, link, remote, serving = await _joined()
        request = asyncio.create_task(_request(remote))
        await asyncio.wait_for(daemon.pinning.wait(), 10)
        await link.close()  # what the daemon sees of a worker killed
        await asyncio.wait_for(serving, 10)
        await asyncio.wait_for(daemon.released.wait(), 10)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        return daemon.story

    assert asyncio.run(scenario()) == ["pinned", "pin unwound", "unpinned", "given back"]


def test_a_grant_that_arrives_as_its_request_is_cancelled_goes_back() -> None:
    """The daemon's grant and the client's hang-up in the same turn of the worker's loop: the
    waiter holds the grant, the request's task is cancelled all the same (asyncio throws the
    cancellation in, the result is dropped). The grant must go back to the daemon, else its
    lease is held until the worker dies (in_flight stuck, the model never idle)."""
    async def scenario() -> list[Any]:
        sent: list[Any] = []
        writer = SimpleNamespace(is_closing=lambda: False, close=lambda: None,
                                 write=lambda data: sent.extend(_decoded(data)))
        link = Link(asyncio.StreamReader(), cast(Any, writer))
        call = asyncio.create_task(link.call("acquire", "m", False, None, None))
        await asyncio.sleep(0)  # one turn: the call is waiting for its answer
        grant = LeaseGrant(lease_id=7, model="m", instance="m", pid=None, base_url="",
                           headers={}, first_byte_timeout=None, idle_timeout=None,
                           ready_since=0.0, served_name=None, pins=False)
        link._answered(1, grant, None)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.sleep(0)  # the outbox sends once a turn
        return sent

    assert ("release", 7) in asyncio.run(scenario())


def _decoded(data: bytes) -> list[Any]:
    import pickle

    assert len(data) == frames._LENGTH.unpack(data[:4])[0] + 4
    batch: list[Any] = pickle.loads(data[4:])
    return batch


def test_an_acquire_cancelled_in_the_frame_after_it_leaves_nothing() -> None:
    """A client gone right after its request asked for a lease: the cancel comes in the next
    frame, which the hub reads in the same turn (its bytes are buffered already), before the
    acquire's task began. Nothing is granted, and no coroutine is left never awaited (a
    RuntimeWarning in the daemon's log)."""
    import gc
    import warnings

    async def scenario() -> _Daemon:
        daemon = _Daemon()
        hub = Hub(cast(Any, daemon), cast(Any, None))
        ours, theirs = socket.socketpair(socket.AF_UNIX)
        serving = asyncio.create_task(hub.serve(*await asyncio.open_unix_connection(sock=ours)))
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        await frames.read(reader)  # the first snapshot
        frames.write(writer, [("acquire", 1, "m", False, None, None)])
        frames.write(writer, [("cancel", 1)])
        await writer.drain()
        writer.close()
        await asyncio.wait_for(serving, 10)
        return daemon

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        daemon = asyncio.run(scenario())
        gc.collect()
    assert daemon.granted == 0
    assert not [w for w in caught if "never awaited" in str(w.message)]


class _Unpicklable(RuntimeError):
    """An error the daemon may raise that pickle cannot carry (a lock, a socket, a lambda in
    its attributes)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.hook = lambda: None


def test_an_answer_pickle_cannot_carry_still_answers_its_call_and_spares_the_others() -> None:
    """An acquire fails with an error pickle cannot carry, in the frame that grants another
    request its lease. Pickled as one batch, the whole frame was lost (an exception in a loop
    callback): both requests waited for ever, and the grant's lease stayed held. The failed
    call gets an error it can carry; the other its grant."""
    async def scenario() -> tuple[BaseException, LeaseGrant]:
        daemon, _hub, link, _remote, serving = await _joined()
        acquire = daemon.acquire

        async def acquire_or_fail(name: str, *, ignore_backoff: bool = False) -> Lease:
            if name == "bad":
                raise _Unpicklable("no slot for you")
            return await acquire(name, ignore_backoff=ignore_backoff)

        daemon.acquire = acquire_or_fail  # type: ignore[method-assign]
        bad = asyncio.create_task(link.call("acquire", "bad", False, None, None))
        good = asyncio.create_task(link.call("acquire", "m", False, None, None))
        failed, granted = await asyncio.wait_for(
            asyncio.gather(bad, good, return_exceptions=True), 10)
        await link.close()
        await asyncio.wait_for(serving, 10)
        assert isinstance(failed, BaseException) and isinstance(granted, LeaseGrant)
        return failed, granted

    failed, _ = asyncio.run(scenario())
    assert "no slot for you" in str(failed)


# -- on a real daemon with workers (no child started) -----------------------------------------

@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    corral = start_corral_module(tiny_config(tiny_models, ["tiny-a"], relay_workers=2))
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 2, timeout=30)
    return corral


def _exchange(corral: Corral, head: bytes) -> bytes:
    """`head` sent on a connection of its own (the kernel picks a worker), the answer read
    to its end."""
    port = int(corral.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"Host: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_request_in_absolute_form_is_forwarded_to_its_path(corral: Corral) -> None:
    """A request line may name the whole URL (RFC 9112 3.2.2: a server must take it; HTTP
    clients told corral is their proxy send it). The daemon alone routes it on its path; a
    worker forwarded the whole target as a path (`//127.0.0.1:port/admin/models`: a 404)."""
    port = int(corral.url.rsplit(":", 1)[1])
    for _ in range(6):  # both workers, most likely
        answer = _exchange(corral, b"GET http://127.0.0.1:%d/admin/models?x=1 HTTP/1.1\r\n"
                           % port)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        assert b'"tiny-a"' in answer


def test_a_request_without_host_is_forwarded_without_one(corral: Corral) -> None:
    """HTTP/1.0 lets a request name no Host (HAProxy's `option httpchk` sends such a probe,
    and so do other load balancers' and monitors'); the daemon alone answers it. A worker
    forwarded it with aiohttp's own Host (`corral`, the socket's stand-in name), which the
    daemon's edge refused: 403 host_not_allowed for /health and every forwarded path."""
    port = int(corral.url.rsplit(":", 1)[1])
    for _ in range(6):  # both workers, most likely
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.0 200 "), answer[:300]
        assert b'"status": "ok"' in answer


def test_workers_that_never_come_up_fail_the_start_cleanly(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Every worker dies at its start (here: a sitecustomize that ends any relay worker): the
    daemon spawns them again, each after a growing wait, and once START_WAIT_S passed with
    none serving it says why and exits 1, its relay sockets removed, nothing left running."""
    import json
    import signal
    import tempfile

    from corral.proxy.workers.processes import START_WAIT_S

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'corral.proxy.workers.main' in sys.orig_argv:\n"
        "    os._exit(3)\n")
    path = tmp_path / "workers.yaml"
    path.write_text(json.dumps(tiny_config(tiny_models, ["tiny-a"], relay_workers=2)))
    corral = start_corral.serve(path, wait=False, env={"PYTHONPATH": str(site)})
    corral.expect("relay_worker.exited", "corral.relay_workers_failed", exit_code=1)
    try:
        code = corral.proc.wait(START_WAIT_S + 30)
    finally:
        if corral.proc.poll() is None:
            corral.proc.send_signal(signal.SIGTERM)
    assert code == 1
    failed = corral.log_events("corral.relay_workers_failed")
    assert len(failed) == 1 and failed[0]["count"] == 2
    exits = corral.log_events("relay_worker.exited")
    assert exits and all(e["returncode"] == 3 for e in exits)
    # A growing wait between the spawns of each worker: a few each, not hundreds.
    assert 2 * 2 <= len(corral.log_events("relay_worker.spawned")) <= 2 * 8
    assert not corral.log_events("corral.listening")
    assert not corral.still_running()
    assert not list(Path(tempfile.gettempdir()).glob(f"corral-relay-{corral.proc.pid}.*"))


def test_a_burst_past_a_frames_size_goes_in_several(monkeypatch: pytest.MonkeyPatch) -> None:
    """The messages of one turn past MAX_FRAME together (a burst of pins, each carrying a
    request's body of up to max_body_mb): the peer refused the frame and closed the link,
    cutting every request of the worker. They go in frames the peer takes, each once."""
    monkeypatch.setattr(frames, "MAX_FRAME", 4096)

    async def scenario() -> list[Any]:
        reader = asyncio.StreamReader()
        writer = SimpleNamespace(is_closing=lambda: False, write=reader.feed_data)
        outbox = frames.Outbox(cast(Any, writer))
        for n in range(5):
            outbox.put(("pin", n, bytes([n]) * 1500))  # distinct: pickle shares no copy
        await asyncio.sleep(0)  # the outbox sends once a turn
        reader.feed_eof()
        got: list[Any] = []
        while True:
            try:
                got += await frames.read(reader)
            except frames.LinkClosed:
                return got

    assert [message[1] for message in asyncio.run(scenario())] == [0, 1, 2, 3, 4]


def test_a_frame_that_cannot_be_read_ends_the_link_and_fails_its_calls() -> None:
    """A frame the reading end cannot unpickle (a class it cannot import: a plugin's error
    the other end could) ended the link's reader with the unpickling error itself: the link
    closed by its `finally`, but as a traceback (an unretrieved task exception in the
    worker, an unhandled callback error in the daemon), never saying why. Now it ends as a
    link the other end left: each waiting call fails at once, and one error line names the
    frame (the daemon spawns the worker again)."""
    from structlog.testing import capture_logs

    async def scenario() -> tuple[BaseException | None, bool]:
        reader = asyncio.StreamReader()
        writer = SimpleNamespace(is_closing=lambda: False, write=lambda data: None,
                                 close=lambda: None)
        link = Link(reader, cast(Any, writer))
        task = asyncio.create_task(link._read())
        waiting = asyncio.create_task(link.call("acquire", "m", False, None, None))
        await asyncio.sleep(0)
        spoilt = b"cno_such_module_here\nThing\n(tR."  # a pickle of a class nowhere here
        reader.feed_data(frames._LENGTH.pack(len(spoilt)) + spoilt)
        error: BaseException | None = None
        try:
            await asyncio.wait_for(waiting, 10)
        except Exception as exc:
            error = exc
        await asyncio.wait_for(task, 10)
        return error, link.closed

    with capture_logs() as logs:
        error, closed = asyncio.run(scenario())
    assert closed and error is not None and "shutting down" in str(error), error
    assert [e["event"] for e in logs if e["log_level"] == "error"] == \
        ["relay_link.frame_unreadable"], logs


def test_a_call_too_big_for_a_frame_fails_rather_than_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pin whose body alone is past MAX_FRAME (max_body_mb above it) cannot be sent: the
    worker's call fails at once instead of waiting for an answer that never comes."""
    monkeypatch.setattr(frames, "MAX_FRAME", 4096)

    async def scenario() -> BaseException | None:
        writer = SimpleNamespace(is_closing=lambda: False, write=lambda data: None)
        link = Link(asyncio.StreamReader(), cast(Any, writer))
        try:
            await asyncio.wait_for(link.call("pin", 1, URL, b"x" * 8192, None, None), 10)
        except RuntimeError as exc:
            return exc
        return None

    assert "not sent to the daemon" in str(asyncio.run(scenario()))


def test_requests_forwarded_at_once_leave_the_daemon_its_descriptors(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The daemon alone takes connection_limit() clients (its descriptor limit less a
    reserve for its children, files and pipes). Through workers, each with a cap of its own,
    every forwarded request (an event stream, a cold model's request) held a descriptor of
    the daemon's: a few hundred took them all (the memory watch failed, a start failed,
    forwards failed with tracebacks). Now the workers forward that many at most together, and
    answer the rest with a 503 of their own."""
    import json
    import os
    import resource

    from corral.proxy.listener import connection_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    path = tmp_path / "workers.yaml"
    path.write_text(json.dumps(tiny_config(tiny_models, ["tiny-a"], relay_workers=2)))
    # The daemon and its workers inherit the limit at their spawn; this process has it back
    # at once.
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        corral = start_corral.serve(path, wait=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    wait_until(lambda: len(corral.log_events("relay_worker.ready")) == 2, timeout=30)
    port = int(corral.url.rsplit(":", 1)[1])
    streams = []
    try:
        # More than the workers may forward together (64 each: the daemon's 128 at 256),
        # and well below what either takes (128 at 256) however the kernel spreads them:
        # SO_REUSEPORT hashes each connection, and 240 once put past 128 on one worker,
        # which then cut them as any listener at its cap does.
        for _ in range(180):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(b"GET /admin/events HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
            streams.append(sock)
        heads = [_head(sock) for sock in streams]
        opened = [h for h in heads if h.startswith(b"HTTP/1.1 200 ")]
        refused = [h for h in heads if h.startswith(b"HTTP/1.1 503 ")]
        assert len(opened) + len(refused) == len(streams), [h[:60] for h in heads]
        assert len(opened) <= connection_limit(256)
        assert refused and all(b"too_many_connections" in h and b"Retry-After: 1" in h
                               and b"X-Request-Id" in h for h in refused)
        assert len(os.listdir(f"/proc/{corral.proc.pid}/fd")) < 256 - 64
    finally:
        for sock in streams:
            sock.close()
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200


def _head(sock: socket.socket) -> bytes:
    """An answer's head, with the start of its body (an error's JSON)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    if data.startswith(b"HTTP/1.1 503"):
        while b"}}" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data


def test_relay_sockets_that_cannot_be_made_fail_the_start_cleanly(
        start_corral: CorralFactory, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A temp dir whose path leaves no room for a socket's (108 bytes at most): the daemon
    cannot make its workers' sockets. It said so with a traceback and an unclosed client
    session, past its own close; now it says why in one line and exits 1 as when no worker
    comes up."""
    import json

    long = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long.mkdir()
    path = tmp_path / "workers.yaml"
    path.write_text(json.dumps(tiny_config(tiny_models, ["tiny-a"], relay_workers=2)))
    corral = start_corral.serve(path, wait=False, env={"TMPDIR": str(long)})
    corral.expect("corral.relay_workers_failed", exit_code=1)
    assert corral.proc.wait(60) == 1
    failed = corral.log_events("corral.relay_workers_failed")
    assert len(failed) == 1 and "socket paths" in failed[0]["error"]
    assert not corral.log_events("relay_worker.spawned")


def test_a_reloads_answer_waits_for_the_workers_to_apply_it() -> None:
    """Hub.synced (awaited by POST /admin/reload before it answers) returns once every
    serving worker applied the snapshot it pushed: not before, so a key the reload removed
    opens nothing on a worker once the reload answered; and not for ever, for a worker that
    does not apply it (the watch kills such a one)."""
    async def scenario() -> tuple[bool, bool, float]:
        _, hub, link, remote, serving = await _joined()
        link.note("ready", 0, 4242)  # serving: the hub waits for this worker's ack
        wait_ready = asyncio.get_running_loop().time() + 10
        while not hub.serving():
            assert asyncio.get_running_loop().time() < wait_ready
            await asyncio.sleep(0.01)
        # Nothing applies the snapshots yet (no follow task): synced must wait.
        waiting = asyncio.create_task(hub.synced(within=30))
        await asyncio.sleep(0.2)
        early = waiting.done()
        following = asyncio.create_task(remote.follow())  # now the worker applies (and acks)
        await asyncio.wait_for(waiting, 10)
        applied = [w.applied for w in hub.serving()] == [hub.version]
        # A worker that never applies: synced gives up after `within`.
        following.cancel()
        began = asyncio.get_running_loop().time()
        await hub.synced(within=0.3)
        waited = asyncio.get_running_loop().time() - began
        await link.close()
        await asyncio.wait_for(serving, 10)
        return early, applied, waited

    early, applied, waited = asyncio.run(scenario())
    assert not early and applied
    assert 0.3 <= waited < 5


def test_a_message_whose_handling_fails_ends_neither_the_link_nor_its_requests() -> None:
    """A bug in the daemon's handling of one message (here a record it cannot book) is
    logged; the link goes on, and the worker's other requests with it."""
    async def scenario() -> tuple[bool, bool]:
        daemon, _, link, remote, serving = await _joined()
        link.note("records", [("not a record", False)])
        lease = await asyncio.wait_for(remote.acquire("m"), 10)  # answered: the link lives
        lease.release()
        await asyncio.wait_for(daemon.released.wait(), 10)
        alive = not serving.done() and not link.closed
        await link.close()
        await asyncio.wait_for(serving, 10)
        return alive, daemon.story[-1:] == ["given back"]

    alive, story = asyncio.run(scenario())
    assert alive and story


def test_a_daemon_gone_under_a_forward_is_a_503_before_the_head_and_a_cut_after(
        tmp_path: Path) -> None:
    """What a worker forwards when the daemon's socket is gone (its shutdown, a crash) is a
    503 in the OpenAI shape, not a 500 and a traceback; one whose answer the daemon began and
    then dropped reaches the client cut (an incomplete chunked body), never as whole."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from corral.proxy import client_io
    from corral.proxy.workers.forward import ToDaemon

    half = tmp_path / "half.sock"

    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n6\r\nbegun\n\r\n")
        await writer.drain()
        writer.close()  # gone before the last chunk

    async def scenario() -> tuple[int, Any, bool]:
        server = await asyncio.start_unix_server(half_answer, str(half))
        gone, cut = ToDaemon(str(tmp_path / "no-daemon.sock"), 8), ToDaemon(str(half), 8)

        async def forwarded(request: web.Request) -> web.StreamResponse:
            to = gone if request.path == "/gone" else cut
            return await to.forward(request, None, None)

        app = web.Application()
        app[client_io.DEADLINE] = client_io.WriteDeadline(seconds=lambda: 5,
                                                          stalled=lambda model: None)
        app.router.add_get("/{tail:.*}", forwarded)
        async with TestClient(TestServer(app)) as client:
            refused = await client.get("/gone")
            shape = await refused.json()
            answer = await client.get("/cut")
            try:
                await answer.read()
                whole = True
            except Exception:  # aiohttp.ClientPayloadError: the body ended short
                whole = False
        await gone.close()
        await cut.close()
        server.close()
        return refused.status, shape, whole

    status, shape, whole = asyncio.run(scenario())
    assert status == 503 and shape["error"]["code"] == "daemon_unavailable", shape
    assert not whole
