"""Children that misbehave at the OS level (tests/unruly_child.py, a stand-in that starts in
milliseconds): a grandchild that leaves the child's process group, a log of endless long lines,
a child that closes its output early, one that ignores SIGTERM. One daemon for the module."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from corral.supervisor import log_pipe

from conftest import Corral, CorralFactory, gone, wait_until

UNRULY = Path(__file__).resolve().parent / "unruly_child.py"
MODES = ("setsid", "long-lines", "close-output", "ignore-term")

pytestmark = pytest.mark.timeout(120)


def _config() -> dict[str, Any]:
    return {"defaults": {"ttl": 600, "stop_grace": 1, "start_timeout": 30},
            "models": {mode: {"backend": "command", "health": "/health",
                              "command": [sys.executable, "-S", str(UNRULY),
                                          "--port", "${PORT}", "--mode", mode]}
                       for mode in MODES}}


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory) -> Corral:
    return start_corral_module(_config())


def _load(corral: Corral, name: str) -> dict[str, Any]:
    r = corral.http.post(f"/admin/models/{name}/load")
    assert r.status_code == 200, r.text
    model = corral.model(name)
    assert model["state"] == "ready", model
    return model


def _unload(corral: Corral, name: str) -> None:
    assert corral.http.post(f"/admin/models/{name}/unload").status_code == 200
    wait_until(lambda: corral.model(name)["state"] == "stopped", timeout=15)


def _log(corral: Corral, name: str, lines: int = 100) -> list[str]:
    r = corral.http.get(f"/admin/models/{name}/logs", params={"lines": lines})
    assert r.status_code == 200
    return list(r.json()["lines"])


def test_a_grandchild_that_left_the_childs_group_is_stopped_with_it(corral: Corral) -> None:
    child = _load(corral, "setsid")["pid"]

    def grandchild() -> int | None:
        found = [m for line in _log(corral, "setsid") if (m := re.search(r"grandchild (\d+)",
                                                                           line))]
        return int(found[0].group(1)) if found else None

    pid = wait_until(grandchild)
    assert not gone(pid) and os.getpgid(pid) != child  # setsid(): a group of its own
    _unload(corral, "setsid")
    # Only the child's group was signalled: the grandchild ran on, reparented to init.
    wait_until(lambda: gone(pid), timeout=5)
    assert corral.log_events("child.left_its_group")[0]["pids"] == [pid]


def test_a_child_writing_long_lines_costs_the_daemon_little(corral: Corral) -> None:
    _load(corral, "long-lines")
    wait_until(lambda: len(_log(corral, "long-lines", 400)) >= 101)
    r = corral.http.get("/admin/models/long-lines/logs", params={"lines": 400})
    longest = log_pipe.LINE_LIMIT + len(log_pipe.CUT_MARK)
    assert all(len(line) <= longest for line in r.json()["lines"])
    # 100 lines of 8 KiB of U+FFFD, as JSON escapes: 5 MB (at 256 KiB a line: 160 MB).
    assert len(r.content) < 10_000_000
    assert psutil.Process(corral.proc.pid).memory_info().rss < 400 * 2**20
    _unload(corral, "long-lines")


def test_a_child_that_closed_its_output_serves_and_stops(corral: Corral) -> None:
    child = _load(corral, "close-output")["pid"]
    assert corral.chat("close-output").status_code == 200
    _unload(corral, "close-output")
    assert gone(child)


def test_a_child_that_ignores_sigterm_is_killed_after_its_grace(corral: Corral) -> None:
    child = _load(corral, "ignore-term")["pid"]
    _unload(corral, "ignore-term")
    assert gone(child)
    assert any(e.get("pid") == child for e in corral.log_events("child.kill"))


def test_nothing_of_the_module_runs_on(corral: Corral) -> None:
    assert all(corral.model(mode)["state"] == "stopped" for mode in MODES)
    try:
        left = psutil.Process(corral.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        left = []
    # The keeper (corral.supervisor.reaper) is the one process the daemon keeps.
    assert all("corral.supervisor.reaper" in " ".join(p.cmdline()) for p in left), left
    assert isinstance(httpx.get(corral.url + "/health"), httpx.Response)
