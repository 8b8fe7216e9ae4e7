"""The harness itself: a daemon's teardown fails on what its log says went wrong and on an
unclean exit, names the log file and the lines, and lets through only what a test declares."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fake_upstream import requests
from raw_server import RawServer

import conftest
from conftest import Corral, CorralFactory, LogExpectations, log_problems, tiny_config, wait_until

_any_free_port = conftest.free_port


def _line(event: str, level: str = "info", **fields: object) -> str:
    return json.dumps({"event": event, "level": level, "timestamp": "t", **fields})


NEVER_RETRIEVED = """Task exception was never retrieved
future: <Task finished name='Task-7' coro=<Daemon._preload() done> exception=ValueError('x')>
Traceback (most recent call last):
  File "/x/daemon.py", line 1, in _preload
ValueError: x"""
UNCLOSED = """Unclosed client session
client_session: <aiohttp.client.ClientSession object at 0x7f>"""
LOG = "\n".join([
    _line("daemon.started"),
    _line("child.output", line="Traceback (most recent call last): a child's own line"),
    _line("daemon.reload_failed", "error", issues=["x"]),
    _line("instance.health_failed", "warning"),
    _line("pull.failed", "error", error="cannot resolve"),
    _line("reaper.not_started", "error"),
    _line("daemon.strategy_failed", "error", exception="Traceback ...\nZeroDivisionError: x"),
    NEVER_RETRIEVED,
    _line("daemon.stopped"),
    UNCLOSED,
    _line("corral.shutting_down"),
    "/x/app.py:3: ResourceWarning: unclosed <socket.socket fd=9>",
])


def test_a_probe_missed_below_the_watchdogs_limit_is_not_a_problem_but_the_rest_are() -> None:
    """A loaded CI box may make a child miss one /health probe: below the limit, a timeout
    is let through; a refused or wrong answer, or the limit reached, still fails the test."""
    missed = _line("instance.health_failed", "warning", problem="no answer within 3s",
                   failures=1, limit=3)
    refused = _line("instance.health_failed", "warning", problem="HTTP 503", failures=1,
                    limit=3)
    limit = _line("instance.health_failed", "warning", problem="no answer within 3s",
                  failures=3, limit=3)
    assert log_problems(missed, LogExpectations()) == []
    assert log_problems("\n".join([missed, refused, limit]), LogExpectations()) == [
        refused, limit]


def test_log_problems_finds_each_kind_and_lets_through_only_what_is_declared() -> None:
    found = log_problems(LOG, LogExpectations())
    assert [p.splitlines()[0][:40] for p in found] == [
        _line("daemon.reload_failed", "error", issues=["x"])[:40],
        _line("instance.health_failed", "warning")[:40],
        _line("pull.failed", "error", error="cannot resolve")[:40],
        _line("reaper.not_started", "error")[:40],
        _line("daemon.strategy_failed", "error")[:40],
        "Task exception was never retrieved",  # with its traceback: one block
        "Unclosed client session",
        "/x/app.py:3: ResourceWarning: unclosed <",
    ]
    assert found[5] == NEVER_RETRIEVED and found[6] == UNCLOSED

    expected = LogExpectations()
    expected.add("daemon.reload_failed", "instance.health_failed", "pull.failed",
                 "reaper.not_started", "daemon.strategy_failed")
    # A declared name lets its event through, not a traceback it carries.
    assert [p[:40] for p in log_problems(LOG, expected)][:1] == [
        _line("daemon.strategy_failed", "error")[:40]]
    expected.add(allow=[r'"daemon.strategy_failed".*ZeroDivisionError',
                        r"(?s)^Task exception was never retrieved\n.*ValueError: x$",
                        "^Unclosed client session", "ResourceWarning"])
    assert log_problems(LOG, expected) == []


FAKE_DAEMON = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(sys.argv[2])))
sys.stderr.write(open(sys.argv[1]).read() + "\\n" + '{"event": "fake.ready"}' + "\\n")
sys.stderr.flush()
while True:
    signal.pause()
"""


def _fake(factory: CorralFactory, tmp_path: Path, log: str, exit_code: int) -> Corral:
    """A stand-in daemon that writes `log` to its log file and exits with `exit_code` on
    SIGTERM; closed by the factory like a real one."""
    n = len(factory.started)
    (tmp_path / f"fake-{n}.txt").write_text(log)
    log_path = tmp_path / f"fake-{n}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", FAKE_DAEMON, str(tmp_path / f"fake-{n}.txt"),
                                 str(exit_code)], stdout=subprocess.DEVNULL, stderr=log_file)
    corral = Corral(proc, "http://127.0.0.1:9", log_path, tmp_path / "none.yaml")
    factory.started.append(corral)
    wait_until(lambda: "fake.ready" in log_path.read_text(), timeout=10)
    return corral


def test_teardown_fails_on_a_dirty_log_or_exit_and_names_the_file_and_lines(tmp_path) -> None:
    factory = CorralFactory(tmp_path)
    dirty = _fake(factory, tmp_path, LOG, exit_code=3)
    clean = _fake(factory, tmp_path, _line("daemon.started"), exit_code=0)
    with pytest.raises(AssertionError) as failed:
        factory.close()
    message = str(failed.value)
    assert f"(log {dirty.log_path})" in message and str(clean.log_path) not in message
    assert "exited with 3, not [0]" in message
    assert "  - Task exception was never retrieved\nfuture:" in message
    assert "  - Unclosed client session" in message
    assert '"event": "instance.health_failed"' in message
    assert "a child's own line" not in message  # a child's output is the child's business

    # Declared (on the Corral, or for the factory from the test's marks): nothing to say.
    factory = CorralFactory(tmp_path, LogExpectations(events={"pull.failed"}))
    declared = _fake(factory, tmp_path, LOG, exit_code=3)
    declared.expect("daemon.reload_failed", "instance.health_failed", "reaper.not_started",
                    allow=[r"ZeroDivisionError", "never retrieved", "Unclosed", "Warning"],
                    exit_code=3)
    factory.close()


@pytest.mark.expect_log("instance.health_failed", allow="ResourceWarning", exit_code=-9)
def test_marks_reach_the_factory(start_corral: CorralFactory) -> None:
    assert start_corral.expected.events == {"instance.health_failed"}
    assert start_corral.expected.allowed("x: ResourceWarning: y")
    assert start_corral.expected.exit_codes == {0, -9}


def test_a_real_daemon_whose_plugin_raises_fails_its_teardown(tmp_path, tiny_models) -> None:
    """End to end: a strategy plugin that raises is logged with its traceback (the daemon
    carries on); the teardown reports that line, and only an `allow` for it would pass."""
    plugin = tmp_path / "raising.py"
    plugin.write_text("from corral.supervisor.policy import BaseStrategy\n\n\n"
                      "class Raising(BaseStrategy):\n"
                      "    def kv_cache(self, snap, model):\n"
                      "        return 1 // 0\n")
    factory = CorralFactory(tmp_path)
    corral = factory(tiny_config(tiny_models, policy={"strategy": f"plugin:{plugin}:Raising"}))
    assert corral.chat("tiny-a", max_tokens=1).status_code == 200
    corral.proc.send_signal(signal.SIGTERM)
    assert corral.proc.wait(30) == 0
    with pytest.raises(AssertionError) as failed:
        factory.close()
    assert f"(log {corral.log_path})" in str(failed.value)
    assert '"event": "daemon.strategy_failed"' in str(failed.value)
    assert "ZeroDivisionError" in str(failed.value)
    text = corral.log_path.read_text()
    assert log_problems(text, LogExpectations(events={"daemon.strategy_failed"}))
    allowed = LogExpectations()
    allowed.add(allow=r'"daemon.strategy_failed".*ZeroDivisionError')
    assert log_problems(text, allowed) == []


class _Squatter(RawServer):
    """Another worker's server on the port the harness picked: it answers /health 200."""

    def serve(self, conn: socket.socket) -> None:
        for _ in requests(conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")


def test_a_daemon_whose_port_is_taken_before_it_binds_comes_up_on_another(
        start_corral: CorralFactory, tiny_models, monkeypatch) -> None:
    """The harness picks a free port and the daemon binds it a second later; CI once ran two
    workers where one's server can take it in between. The harness must neither take that
    server's /health for the daemon's nor fail the test: it starts the daemon on another port."""
    squatter = _Squatter()
    picks = iter([squatter.port])
    monkeypatch.setattr(conftest, "free_port", lambda: next(picks, None) or _any_free_port())
    try:
        corral = start_corral(tiny_config(tiny_models))
        assert corral.url != f"http://127.0.0.1:{squatter.port}"
        assert list(corral.models()) == ["tiny-a"]
        lost = start_corral.started[0]
        assert lost is not corral and lost.proc.returncode == 1
    finally:
        squatter.close()
