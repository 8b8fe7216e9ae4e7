"""Who listens on a child's port (supervisor/listener.py), with real processes: the child,
a descendant of it, and a stranger younger or older than it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from corral.supervisor.listener import held_by_stranger, process_listens, says_it_listens

from conftest import wait_until

# Binds port 0 on 127.0.0.1 (never a port picked earlier: another test worker could take
# it), prints the port, then waits to be killed.
LISTEN = ("import socket, sys, time\n"
          "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
          "print(s.getsockname()[1], flush=True)\n"
          "time.sleep(120)\n")
# Forks a process that listens (the child's descendant holds the port, as vLLM's API
# servers do) and waits.
FORK_LISTEN = ("import subprocess, sys, time\n"
               f"subprocess.Popen([sys.executable, '-c', {LISTEN!r}])\n"
               "time.sleep(120)\n")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def _listener(processes: list[subprocess.Popen[str]]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    processes.append(proc)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, port


def _idle(processes: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], text=True)
    processes.append(proc)
    return proc


def test_the_childs_own_listener_is_never_a_strangers(processes) -> None:
    child, port = _listener(processes)
    assert process_listens(child.pid, port)
    assert not held_by_stranger(child.pid, port, binds_itself=True)
    assert not held_by_stranger(child.pid, port, binds_itself=False)


def test_a_listener_of_the_childs_descendant_is_the_childs(processes) -> None:
    child = subprocess.Popen([sys.executable, "-c", FORK_LISTEN], text=True,
                             start_new_session=True)
    processes.append(child)
    def grandchild_port() -> int | None:
        for proc in psutil.Process(child.pid).children():
            for c in proc.net_connections(kind="tcp4"):
                if c.status == psutil.CONN_LISTEN:
                    return int(c.laddr.port)
        return None

    wait_until(lambda: grandchild_port() is not None, timeout=30)
    port = grandchild_port()
    assert port is not None
    try:
        assert not process_listens(child.pid, port)  # not the child itself...
        assert not held_by_stranger(child.pid, port, binds_itself=True)  # ...but its own
    finally:
        for proc in psutil.Process(child.pid).children():
            proc.kill()


def test_an_older_stranger_is_one_for_every_kind_of_child(processes) -> None:
    _, port = _listener(processes)
    child = _idle(processes)  # started after the stranger took the port
    assert held_by_stranger(child.pid, port, binds_itself=True)
    assert held_by_stranger(child.pid, port, binds_itself=False)


def test_a_younger_stranger_is_one_only_for_a_server_that_binds_itself(processes) -> None:
    """A command child may be `docker run`, whose port a proxy outside its tree, started
    after it, holds: that listener is given the benefit of the doubt. llama-server and vLLM
    bind their own port, so any listener outside their tree is someone else's."""
    child = _idle(processes)
    _, port = _listener(processes)  # started after the child
    assert held_by_stranger(child.pid, port, binds_itself=True)
    assert not held_by_stranger(child.pid, port, binds_itself=False)


def test_a_child_that_is_gone_holds_nothing(processes) -> None:
    _, port = _listener(processes)
    child = _idle(processes)
    child.kill()
    child.wait()
    assert held_by_stranger(child.pid, port, binds_itself=False)


def test_a_childs_own_line_that_it_listens_on_the_port_is_proof_enough() -> None:
    """llama-server's and uvicorn's lines, printed once bound, for exactly that port; a bind
    failure or another port's line is no proof (the tables are asked then)."""
    assert says_it_listens(["I srv  llama_server: listening on http://127.0.0.1:18555"], 18555)
    assert says_it_listens(["INFO:     Uvicorn running on http://127.0.0.1:8000 (Press "
                            "CTRL+C to quit)"], 8000)
    assert not says_it_listens(["listening on http://127.0.0.1:185551"], 18555)
    assert not says_it_listens(["listening on http://127.0.0.1:8000"], 8001)
    assert not says_it_listens(["couldn't bind HTTP server socket, hostname: 127.0.0.1, "
                                "port: 8000"], 8000)
