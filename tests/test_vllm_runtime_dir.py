"""The private socket directory a vLLM child gets (supervisor/socket_dir.py), without vLLM: its
name and mode, the sweep of leftovers (a live owner's kept, a dead one's removed, nothing else
touched) and a daemon's start running it, and its removal by ChildProcess after each kind of
end, with a small Python child standing in for vLLM. tests/test_vllm.py checks the same with
real vLLM children."""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.supervisor import socket_dir
from corral.supervisor.process import ChildProcess
from corral.supervisor.socket_dir import SocketDir

from conftest import CorralFactory

SOCKETS = SocketDir(env="CORRAL_TEST_SOCKETS", kind="test")
# A child that binds a Unix socket in its directory, as vLLM's processes do, then waits.
BIND_AND_WAIT = [sys.executable, "-c", (
    "import os, socket, sys, time\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "s.bind(os.path.join(os.environ['CORRAL_TEST_SOCKETS'], 'a' * 36))\n"
    "print('bound', flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n")]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_new_dir_is_private_short_and_names_this_process() -> None:
    path = socket_dir.make("vllm")
    try:
        assert Path(path).parent == Path(tempfile.gettempdir())
        assert Path(path).name.startswith(f"corral-vllm-{socket_dir.owner_tag()}-")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        # A socket in it, with vLLM's name length (a uuid4), fits a socket's path.
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(os.path.join(path, "0" * 36))
    finally:
        socket_dir.remove(path)
    assert not os.path.exists(path)


def test_a_temp_dir_too_long_for_socket_paths_is_refused(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(OSError, match="would pass 107 bytes"):
        socket_dir.make("vllm")
    assert list(deep.iterdir()) == []  # nothing left of the try


def test_the_sweep_removes_only_dead_daemons_dirs(tmp_path: Path,
                                                  sleeper: subprocess.Popen[bytes]) -> None:
    mine = tmp_path / f"corral-vllm-{socket_dir.owner_tag()}-aaaa1111"
    alive = tmp_path / f"corral-vllm-{socket_dir.owner_tag(sleeper.pid)}-bbbb2222"
    gone = subprocess.Popen(["true"])
    gone_tag = socket_dir.owner_tag(gone.pid)
    gone.wait()
    dead = tmp_path / f"corral-vllm-{gone_tag}-cccc3333"
    # Our own pid with another start time: a daemon whose pid this process took over.
    pid, start = socket_dir.owner_tag().split(".")
    reused = tmp_path / f"corral-vllm-{pid}.{int(start) + 1}-dddd4444"
    for folder in (mine, alive, dead, reused):
        folder.mkdir()
        (folder / "0123").write_text("a socket's name")
    # Not ours: another name, a file with our name, a link with our name (never followed).
    other = tmp_path / "corral-vllm-somebody-else"
    other.mkdir()
    plain = tmp_path / f"corral-vllm-{gone_tag}-eeee5555"
    plain.write_text("")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("")
    link = tmp_path / f"corral-vllm-{gone_tag}-ffff6666"
    link.symlink_to(target)

    removed = socket_dir.sweep_leftovers(str(tmp_path))

    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert (mine / "0123").exists() and (alive / "0123").exists()
    assert other.is_dir() and plain.is_file() and link.is_symlink()
    assert (target / "keep").exists()


def test_an_owner_is_alive_only_with_its_start_time_or_when_unknown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    start = socket_dir.process_start(1)
    assert start is not None
    assert socket_dir.owner_alive(1, start)
    assert not socket_dir.owner_alive(1, start + 1)  # pid 1 is another process than it was
    assert socket_dir.process_start(2 ** 22 + 1) is None  # above pid_max: never a process

    def hidden(pid: int) -> int | None:
        raise PermissionError(13, "hidepid")

    # /proc we may not read: its owner may run, so its directory stays.
    monkeypatch.setattr(socket_dir, "process_start", hidden)
    assert socket_dir.owner_alive(1, start + 1)


def test_a_daemon_start_removes_a_killed_daemons_dir(start_corral: CorralFactory,
                                                     tiny_models: dict[str, Path]) -> None:
    gone = subprocess.Popen(["true"])
    tag = socket_dir.owner_tag(gone.pid)
    gone.wait()
    base = Path(tempfile.gettempdir())
    dead = Path(tempfile.mkdtemp(prefix=f"corral-vllm-{tag}-", dir=base))
    (dead / ("0" * 36)).write_text("")
    live = Path(tempfile.mkdtemp(prefix=f"corral-vllm-{socket_dir.owner_tag()}-", dir=base))
    try:
        served = start_corral({"models": {"tiny-a": {"model": str(tiny_models["tiny-a"])}}})
        # Removed before the daemon serves. (Under xdist another test's daemon may start
        # first and remove it: gone is what counts.)
        assert not dead.exists()
        assert live.is_dir()  # this test's process still runs
        assert served.http.get("/health").status_code == 200
    finally:
        socket_dir.remove(str(live))
        socket_dir.remove(str(dead))


def child(seconds: float, env: dict[str, str] | None = None) -> ChildProcess:
    return ChildProcess("tinyv", [*BIND_AND_WAIT, str(seconds)], env or {}, sockets=SOCKETS)


async def bound(process: ChildProcess) -> str:
    """The child's socket dir, once its socket is in it."""
    async with asyncio.timeout(30):
        while "bound" not in process.tail(1):
            assert process.returncode is None, process.tail()
            await process.logs.wait(1)
    path = process.socket_dir
    assert path is not None and os.listdir(path) == ["a" * 36]
    return path


def test_the_dir_goes_after_a_stop_past_its_grace_and_after_a_crash() -> None:
    asyncio.run(stop_past_grace_and_crash())


async def stop_past_grace_and_crash() -> None:
    # SIGTERM ignored: the grace runs out and SIGKILL ends it; the socket file stays behind
    # (the child never unlinks it), the directory goes whole.
    stubborn = ChildProcess("tinyv", ["sh", "-c", 'trap "" TERM; ' + shlex.join(
        [*BIND_AND_WAIT, "60"])], {}, sockets=SOCKETS)
    await stubborn.spawn()
    path = await bound(stubborn)
    assert await stubborn.stop(0.2) == -9
    assert not os.path.exists(path) and stubborn.socket_dir is None

    crash = child(0.5)
    await crash.spawn()
    path = await bound(crash)
    assert await crash.exited() == 0
    assert os.path.exists(path)  # the child exited; its group may not be gone yet
    crash.sweep_group()  # what the exit watch does as the child exits
    assert not os.path.exists(path) and crash.socket_dir is None


def test_a_dir_the_operator_names_is_used_and_left_alone() -> None:
    # A short dir of its own: pytest's tmp_path under xdist (.../popen-gw2/test_...0/) is
    # past a socket path's 107 bytes once the 36-character name is added.
    with tempfile.TemporaryDirectory(prefix="op-") as named:
        asyncio.run(operator_named(Path(named)))


async def operator_named(named: Path) -> None:
    process = child(60, {SOCKETS.env: str(named)})
    await process.spawn()
    async with asyncio.timeout(30):
        while "bound" not in process.tail(1):
            assert process.returncode is None, process.tail()
            await process.logs.wait(1)
    assert process.socket_dir is None
    assert await process.stop(5) is not None
    assert os.listdir(named) == ["a" * 36]  # its own, not corral's to clean


def test_a_child_that_cannot_be_executed_leaves_no_dir() -> None:
    before = set(os.listdir(tempfile.gettempdir()))
    process = ChildProcess("tinyv", ["/nonexistent/vllm"], {}, sockets=SOCKETS)
    with pytest.raises(OSError):
        asyncio.run(process.spawn())
    assert process.socket_dir is None
    mine = f"corral-test-{socket_dir.owner_tag()}-"
    assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before
                if n.startswith(mine)]
