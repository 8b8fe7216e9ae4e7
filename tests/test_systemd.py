"""systemd integration: the notify protocol against a real datagram socket, the watchdog, and
the unit file checked by `systemd-analyze`.

- End to end: one `corral serve` (shared by the module) started with NOTIFY_SOCKET pointing at
  a socket this test binds, as systemd would for Type=notify, and WATCHDOG_USEC=400000.
- In process: the notifier's own behaviour (abstract socket, no socket, a full socket, a
  stuck loop, the coalesced status).
- The unit: `systemd-analyze verify` and `security --offline` over a stand-in root laid out as
  the install steps of docs/operations.md leave a machine."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from corral.supervisor.events import Event
from corral.supervisor.sdnotify import ServiceNotifier, summarize

from conftest import REPO, Corral, CorralFactory, tiny_config

UNIT = REPO / "systemd" / "corral.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


# -- a stand-in for systemd's notify socket ------------------------------------------------------

@dataclass(frozen=True)
class Message:
    at: float  # time.monotonic() on arrival
    fields: dict[str, str]

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    @property
    def status(self) -> str:
        return self.fields.get("STATUS", "")

    @property
    def only_status(self) -> bool:
        return set(self.fields) == {"STATUS"}


SYNC = "TEST_RECEIVER_SYNC"  # a field of the test's own markers (Receiver.sync), not systemd's


class Receiver:
    """A bound AF_UNIX datagram socket, read by a thread of its own: each message is stamped
    when it arrives, whatever the test is doing (or the loop under test is blocked on)."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.05)
        self.messages: list[Message] = []
        self._synced: set[str] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            at = time.monotonic()
            fields = dict(line.partition("=")[::2] for line in data.decode().split("\n"))
            with self._cond:
                if SYNC in fields:
                    self._synced.add(fields[SYNC])
                else:
                    self.messages.append(Message(at, fields))
                self._cond.notify_all()

    def mark(self) -> int:
        with self._cond:
            return len(self.messages)

    def since(self, start: int) -> list[Message]:
        with self._cond:
            return self.messages[start:]

    def wait_for(self, predicate: Callable[[Message], bool], start: int = 0,
                 timeout: float = 10.0, alive: Callable[[], None] | None = None) -> int:
        """Index of the first message from `start` on that matches."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i in range(start, len(self.messages)):
                    if predicate(self.messages[i]):
                        return i
                start = len(self.messages)
                if alive is not None:
                    alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no such message within {timeout}s; got "
                                         f"{[m.fields for m in self.messages[-10:]]}")
                self._cond.wait(min(left, 0.1))

    def sync(self, timeout: float = 10.0) -> None:
        """Until every message sent before this call has been read: a marker of its own goes
        through the same socket, whose queue keeps the order; it is waited for, and is no
        message."""
        token = uuid.uuid4().hex
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(f"{SYNC}={token}".encode(), self.sock.getsockname())
        with self._cond:
            if not self._cond.wait_for(lambda: token in self._synced, timeout):
                raise AssertionError(f"the receiver read nothing more within {timeout}s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


# -- end to end: corral under a stand-in systemd -------------------------------------------------

WATCHDOG_USEC = 400_000  # pings every 0.2 s


@dataclass
class Service:
    corral: Corral
    notify: Receiver
    ready: int  # index of the first READY=1
    accepted_at_ready: bool  # the port took a connection the moment READY=1 arrived

    def alive(self) -> None:
        assert self.corral.proc.poll() is None, \
            f"corral exited:\n{self.corral.log_path.read_text()[-3000:]}"


def _accepts(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def service(start_corral_module: CorralFactory, tiny_models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    notify = Receiver(str(tmp_path_factory.mktemp("notify") / "sd.sock"))
    with pytest.MonkeyPatch.context() as env:  # what systemd puts in the environment
        env.setenv("NOTIFY_SOCKET", notify.sock.getsockname())
        env.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        env.delenv("WATCHDOG_PID", raising=False)
        corral = start_corral_module(tiny_config(tiny_models, ["tiny-a", "tiny-b"]),
                                     wait=False)
    service = Service(corral, notify, -1, False)
    service.ready = notify.wait_for(lambda m: "READY" in m, timeout=20, alive=service.alive)
    service.accepted_at_ready = _accepts(corral.url)
    yield service
    # Its STOPPING=1 goes to this socket: the daemon ends before the socket does (the
    # module's last test stops it; a run of some of its tests leaves it running until here,
    # and its send to a closed socket failed the teardown: sdnotify.send_failed).
    if corral.proc.poll() is None:
        corral.proc.send_signal(signal.SIGTERM)
        corral.proc.wait(30)
    notify.close()


def test_ready_once_the_port_accepts(service: Service) -> None:
    assert service.accepted_at_ready, "READY=1 came before the port accepted connections"
    ready = service.notify.messages[service.ready]
    assert ready.fields["READY"] == "1"
    assert ready.status == "0 loaded, 0 starting, 0 in flight, 0 queued"
    before = service.notify.messages[:service.ready]
    assert all(set(m.fields) == {"WATCHDOG"} for m in before), [m.fields for m in before]
    assert service.corral.http.get("/health").status_code == 200


def test_watchdog_pings_at_half_the_interval(service: Service) -> None:
    start = service.notify.mark()
    time.sleep(1.5)
    pings = [m.at for m in service.notify.since(start) if "WATCHDOG" in m]
    assert 5 <= len(pings) <= 10, f"{len(pings)} pings in 1.5 s at a 0.2 s interval"
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert 0.15 <= statistics.median(gaps) <= 0.3, gaps


def test_sighup_reload_is_announced(service: Service) -> None:
    notify = service.notify
    start = notify.mark()
    before = time.monotonic_ns() // 1000
    service.corral.proc.send_signal(signal.SIGHUP)
    reloading = notify.wait_for(lambda m: "RELOADING" in m, start, alive=service.alive)
    after = time.monotonic_ns() // 1000
    fields = notify.messages[reloading].fields
    assert fields["RELOADING"] == "1"
    # The same clock (CLOCK_MONOTONIC) on both sides of the socket.
    assert before <= int(fields["MONOTONIC_USEC"]) <= after
    ready = notify.wait_for(lambda m: "READY" in m, reloading, alive=service.alive)
    assert notify.messages[ready].status == "0 loaded, 0 starting, 0 in flight, 0 queued"


@pytest.mark.expect_log("daemon.reload_failed")
def test_a_failed_reload_ends_ready_with_the_old_config(service: Service) -> None:
    notify, config = service.notify, service.corral.config_path
    good = config.read_text()
    start = notify.mark()
    config.write_text("models: [\n")  # corral watches the file: the edit reloads
    try:
        reloading = notify.wait_for(lambda m: "RELOADING" in m, start, alive=service.alive)
        failed = notify.wait_for(lambda m: "READY" in m, reloading, alive=service.alive)
        assert "last reload failed" in notify.messages[failed].status
    finally:
        config.write_text(good)
    # The running config served throughout; the fixed file reloads and clears the note.
    notify.wait_for(lambda m: "READY" in m and "failed" not in m.status, failed,
                    alive=service.alive)
    assert service.corral.models().keys() == {"tiny-a", "tiny-b"}


def test_status_follows_loads_coalesced(service: Service) -> None:
    notify, corral = service.notify, service.corral
    start = notify.mark()
    for name in ("tiny-a", "tiny-b"):
        assert corral.http.post(f"/admin/models/{name}/load").status_code == 200
    final = "2 loaded (tiny-a, tiny-b), 0 starting, 0 in flight, 0 queued"
    notify.wait_for(lambda m: m.status == final, start, timeout=5, alive=service.alive)
    time.sleep(1.2)  # room for an update that would wrongly follow the final one
    statuses = [m for m in notify.since(start) if m.only_status]
    # Two starts are a burst of events: at most one line a second, and the last is the truth.
    assert statuses[-1].status == final
    gaps = [b.at - a.at for a, b in itertools.pairwise(statuses)]
    assert all(gap >= 0.9 for gap in gaps), gaps
    # The socket is corral's own: the model children do not inherit it.
    pids = corral.spawned_pids()
    assert len(pids) == 2
    for pid in pids:
        assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC"} & psutil.Process(pid).environ().keys()


def test_sigterm_sends_stopping_and_exits_0(service: Service) -> None:
    notify, proc = service.notify, service.corral.proc
    start = notify.mark()
    proc.send_signal(signal.SIGTERM)
    stopping = notify.wait_for(lambda m: "STOPPING" in m, start, timeout=15)
    assert notify.messages[stopping].status.startswith("stopping: ")
    assert proc.wait(30) == 0
    everything = notify.since(0)
    assert not [m for m in everything[stopping:] if "READY" in m or "RELOADING" in m]
    # Every RELOADING=1 was followed by a READY=1, and READY=1 came once more, at the start.
    kinds = [k for m in everything for k in ("READY", "RELOADING") if k in m]
    assert kinds[0] == "READY" and kinds[1:] == ["RELOADING", "READY"] * (len(kinds) // 2)


# -- in process ------------------------------------------------------------------------------------

MODELS = [
    {"name": "smol", "state": "ready", "in_flight": 2, "queue": 0},
    {"name": "qwen", "state": "ready", "in_flight": 1, "queue": 0},
    {"name": "llama", "state": "starting", "in_flight": 0, "queue": 0},
    {"name": "mistral", "state": "stopped", "in_flight": 0, "queue": 0},
]


def _event(kind: str, **data: Any) -> Event:
    return Event(0, time.time(), kind, data)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(str(tmp_path / "sd.sock"))
    yield r
    r.close()


def _notifier(address: str, **env: str) -> ServiceNotifier:
    return ServiceNotifier(lambda: MODELS, {"NOTIFY_SOCKET": address, **env})


def test_summary_line() -> None:
    assert summarize(MODELS) == "2 loaded (smol, qwen), 1 starting, 3 in flight, 0 queued"
    many = [{"name": f"m{i}", "state": "ready", "in_flight": 0, "queue": 1} for i in range(9)]
    many.append({"name": "bad", "state": "failed"})
    assert summarize(many) == ("9 loaded (m0, m1, m2, m3, m4, m5, +3), 0 starting, 1 failed, "
                               "0 in flight, 9 queued")


def test_abstract_namespace_socket() -> None:
    name = f"corral-test-{uuid.uuid4().hex}"
    r = Receiver(b"\0" + name.encode())
    try:
        env = {"NOTIFY_SOCKET": f"@{name}", "WATCHDOG_USEC": "3000000",
               "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
        notifier = ServiceNotifier(lambda: MODELS, env)
        # The children inherit the environment; the socket and watchdog are corral's own.
        assert env == {"PATH": "/bin"}
        assert notifier.watchdog_interval == 1.5
        notifier.ready()
        notifier.status("two\nlines")
        notifier.reloading()
        notifier.stopping()
        r.wait_for(lambda m: "STOPPING" in m)
        got = [m.fields for m in r.since(0)]
        assert got[0] == {"READY": "1", "STATUS": summarize(MODELS)}
        assert got[1] == {"STATUS": "two lines"}
        assert got[2].keys() == {"RELOADING", "MONOTONIC_USEC"}
        assert abs(int(got[2]["MONOTONIC_USEC"]) - time.monotonic_ns() // 1000) < 5_000_000
        assert got[3] == {"STOPPING": "1", "STATUS": "stopping: " + summarize(MODELS)}
        notifier.close()
    finally:
        r.close()


def test_without_notify_socket_nothing_happens() -> None:
    notifier = ServiceNotifier(lambda: MODELS, {"WATCHDOG_USEC": "1000"})
    assert not notifier.enabled and notifier.watchdog_interval is None
    notifier.ready()
    notifier.on_event(_event("stopping"))
    asyncio.run(asyncio.wait_for(notifier.run(), 1))  # returns at once: nothing to ping


@pytest.mark.parametrize("env", [{"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"},
                                 {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "soon"}, {}])
def test_watchdog_off(receiver: Receiver, env: dict[str, str]) -> None:
    address = receiver.sock.getsockname()
    assert _notifier(address, **env).watchdog_interval is None


def test_sending_never_raises(tmp_path: Path) -> None:
    gone = _notifier(str(tmp_path / "nobody-listens"))
    gone.ready()  # ENOENT: logged once, not raised
    gone.status("still fine")
    # A receiver that never reads: its queue fills, and the sender neither blocks nor raises.
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "full.sock"))
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        full = _notifier(str(tmp_path / "full.sock"))
        started = time.monotonic()
        for _ in range(2000):
            full.status("x" * 1000)
        assert time.monotonic() - started < 2
    finally:
        sink.close()


def test_a_stuck_loop_stops_the_pings(receiver: Receiver) -> None:
    notifier = _notifier(receiver.sock.getsockname(), WATCHDOG_USEC="100000")  # every 50 ms
    blocked: list[float] = []

    def stuck() -> None:  # a blocking call on the loop
        blocked.append(time.monotonic())
        time.sleep(0.5)
        blocked.append(time.monotonic())

    async def scenario() -> None:
        pings = asyncio.create_task(notifier.run())
        await asyncio.sleep(0.3)
        asyncio.get_running_loop().call_soon(stuck)
        await asyncio.sleep(0.6)  # 0.5 s of it blocked
        await asyncio.sleep(0.3)  # running again
        pings.cancel()
        await asyncio.wait([pings])

    asyncio.run(scenario())
    notifier.close()
    receiver.sync()
    pings = [m.at for m in receiver.since(0) if "WATCHDOG" in m]
    frm, to = blocked
    assert len([t for t in pings if t < frm]) >= 4
    assert not [t for t in pings if frm + 0.05 < t < to], "pinged while the loop was stuck"
    assert len([t for t in pings if t >= to]) >= 3, "the pings did not come back"


def test_status_is_coalesced_and_ends_on_the_last_state(receiver: Receiver) -> None:
    models = [{"name": "a", "state": "stopped", "in_flight": 0, "queue": 0}]
    notifier = ServiceNotifier(lambda: models, {"NOTIFY_SOCKET": receiver.sock.getsockname()},
                               status_interval=0.2)

    async def scenario() -> None:
        notifier.ready()
        for i in range(50):  # a burst over ~0.5 s
            models[0] = {**models[0], "state": ("starting", "ready")[i % 2], "in_flight": i}
            notifier.on_event(_event("state"))
            await asyncio.sleep(0.01)
        models[0] = {**models[0], "state": "ready", "in_flight": 0}
        notifier.on_event(_event("loaded"))
        await asyncio.sleep(0.5)

    asyncio.run(scenario())
    notifier.close()
    receiver.sync()
    statuses = [m for m in receiver.since(0) if m.only_status]
    assert 2 <= len(statuses) <= 5, [m.status for m in statuses]
    gaps = [b.at - a.at for a, b in itertools.pairwise(statuses)]
    # Sent at least status_interval (0.2 s) apart; received here by a thread a busy box may
    # wake late, so a gap can look shorter (0.173 s seen): half the interval still tells
    # coalescing (uncoalesced, the burst's statuses would come 0.01 s apart).
    assert all(gap >= 0.1 for gap in gaps), gaps
    assert statuses[-1].status == "1 loaded (a), 0 starting, 0 in flight, 0 queued"


def test_status_refresh_sees_changes_without_events(receiver: Receiver) -> None:
    models = [{"name": "a", "state": "ready", "in_flight": 0, "queue": 0}]
    notifier = ServiceNotifier(lambda: models, {"NOTIFY_SOCKET": receiver.sock.getsockname()},
                               status_interval=0.1, status_refresh=0.1)

    async def scenario() -> None:
        task = asyncio.create_task(notifier.run())
        notifier.ready()
        models[0] = {**models[0], "in_flight": 4, "queue": 2}  # requests publish no event
        await asyncio.sleep(0.35)
        task.cancel()
        await asyncio.wait([task])

    asyncio.run(scenario())
    notifier.close()
    receiver.sync()
    assert [m.status for m in receiver.since(0) if m.only_status] == [
        "1 loaded (a), 0 starting, 4 in flight, 2 queued"]


def test_reload_events(receiver: Receiver) -> None:
    notifier = _notifier(receiver.sock.getsockname())

    async def scenario() -> None:
        # Before READY=1 a reload's READY=1 would claim a service not yet listening.
        notifier.on_event(_event("reloading", trigger="sighup"))
        notifier.on_event(_event("reload", trigger="sighup", ok=True))
        notifier.ready()
        notifier.on_event(_event("reloading", trigger="file"))
        notifier.on_event(_event("reload", trigger="file", ok=False))
        notifier.on_event(_event("reloading", trigger="admin"))
        notifier.on_event(_event("reload", trigger="admin", ok=True))
        notifier.on_event(_event("stopping"))
        notifier.on_event(_event("reloading", trigger="sighup"))  # past caring
        notifier.on_event(_event("reload", trigger="sighup", ok=False))

    asyncio.run(scenario())
    notifier.close()
    receiver.sync()
    got = [(sorted(set(m.fields) - {"MONOTONIC_USEC", "STATUS"}), m.status)
           for m in receiver.since(0)]
    line = summarize(MODELS)
    assert got == [(["READY"], line), (["RELOADING"], ""),
                   (["READY"], f"{line}; last reload failed, config kept"),
                   (["RELOADING"], ""), (["READY"], line), (["STOPPING"], f"stopping: {line}")]


# -- the unit --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in root as the install steps of docs/operations.md leave a machine: corral's
    venv in /opt/corral (a stub: verify checks that ExecStart's binary is executable, never
    runs it), /bin/kill for ExecReload, and the distribution's units (network-online.target,
    sysinit.target, ...) the unit's dependencies name. The unit file itself goes in unchanged."""
    root = tmp_path_factory.mktemp("root")
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    shutil.copy2("/usr/bin/kill", root / "usr" / "bin" / "kill")
    (root / "usr" / "lib" / "systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr" / "lib" / "systemd" / "system",
                    symlinks=True)
    corral = root / "opt" / "corral" / ".venv" / "bin" / "corral"
    corral.parent.mkdir(parents=True)
    corral.write_text("#!/bin/sh\nexit 1\n")
    corral.chmod(0o755)
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    return root


def _analyze(root: Path, text: str, *args: str) -> tuple[int, str]:
    (root / "etc" / "systemd" / "system" / "corral.service").write_text(text)
    done = subprocess.run([SYSTEMD_ANALYZE, *args, f"--root={root}", "corral.service"],
                          capture_output=True, text=True, timeout=30)
    return done.returncode, (done.stdout + done.stderr).strip()


def verify(root: Path, text: str) -> str:
    """`systemd-analyze verify`'s complaints ("" if none). It exits 0 on an unknown key or a
    value it cannot parse (a warning: systemd ignores the line and starts the unit without
    it), so any output counts as a failure too."""
    rc, out = _analyze(root, text, "verify")
    return out or ("" if rc == 0 else f"exit status {rc}")


def test_unit_verifies(root: Path) -> None:
    assert verify(root, UNIT.read_text()) == ""


@pytest.mark.parametrize(("change", "complaint"), [
    (("[Service]\n", "[Service]\nWatchdogSecs=30\n"), "Unknown key"),
    (("WatchdogSec=30", "WatchdogSec=half a minute"), "Failed to parse sec value"),
    (("Type=notify", "Type=notfiy"), "Failed to parse service type"),
    (("DeviceAllow=char-nvidia-uvm rw", "DeviceAllow=nvidia-uvm rw"), "Invalid device node path"),
    (("ExecReload=/bin/kill", "ExecReload=/bin/kil"), "/bin/kil"),
])
def test_verify_catches_a_broken_unit(root: Path, change: tuple[str, str],
                                      complaint: str) -> None:
    """The check above proves something only if verify fails these."""
    text = UNIT.read_text()
    assert change[0] in text
    assert complaint in verify(root, text.replace(change[0], change[1], 1))


def test_verify_looks_inside_the_root(root: Path) -> None:
    corral = root / "opt" / "corral" / ".venv" / "bin" / "corral"
    corral.chmod(0o644)
    try:
        assert "/opt/corral/.venv/bin/corral" in verify(root, UNIT.read_text())
    finally:
        corral.chmod(0o755)


def test_unit_hardening_exposure(root: Path) -> None:
    """systemd's own score of the sandbox (0 best, 10 worst): 3.1 when this was written; a
    dropped protection pushes it over 4. The unit without its hardening block proves it."""
    text = UNIT.read_text()
    rc, out = _analyze(root, text, "security", "--offline=true", "--threshold=40")
    assert rc == 0, out[-600:]
    bare = text[:text.index("# -- Hardening")] + text[text.index("[Install]"):]
    rc, _ = _analyze(root, bare, "security", "--offline=true", "--threshold=40")
    assert rc != 0


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_unit_directives() -> None:
    d = _directives(UNIT.read_text())
    one = {k: v[-1] for k, v in d.items()}
    assert one["Service.Type"] == "notify" and one["Service.NotifyAccess"] == "main"
    assert one["Service.WatchdogSec"] == "30"
    assert one["Service.ExecReload"] == "/bin/kill -HUP $MAINPID"
    # The stop's SIGTERM reaches corral only (mixed): with control-group every child got it
    # too, at once, and the drain and the prompt-cache saves had nothing left to do them on.
    assert one["Service.KillMode"] == "mixed" and one["Service.KillSignal"] == "SIGTERM"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectKernelTunables",
                "ProtectControlGroups", "RestrictSUIDSGID", "LockPersonality"):
        assert one[f"Service.{key}"] == "true", key
    assert one["Service.ProtectSystem"] == "strict" and one["Service.ProtectHome"] == "true"
    assert "/var/lib/corral" in one["Service.ReadWritePaths"].split()
    # CUDA JIT needs writable+executable memory; PrivateDevices would hide /dev/nvidia*.
    assert "Service.MemoryDenyWriteExecute" not in d and "Service.PrivateDevices" not in d
    assert one["Service.DevicePolicy"] == "closed"
    assert {"char-nvidia rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"} <= set(
        d["Service.DeviceAllow"])
    assert set(one["Service.SupplementaryGroups"].split()) == {"video", "render"}


def test_readme_install_matches_the_unit() -> None:
    """The docs' install steps (docs/operations.md) put corral where the unit runs it from."""
    page = (REPO / "docs" / "operations.md").read_text()
    section = page[page.index("## Running as a service"):]
    section = section[:section.index("\n## ", 5)] if "\n## " in section[5:] else section
    assert "/opt/corral" in section and "/etc/corral/corral.yaml" in section
    assert "/var/lib/corral/models" in section
