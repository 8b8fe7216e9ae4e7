"""A start is ready when its child is, not a poll later (issue 37: the old schedule, 10 ms
growing ×1.5 to 250 ms, made a cold start up to 250 ms late). The child here is a tiny
`backend: command` server that opens its port after a given delay, writes the moment it did
(its own clock) to a file, and prints a line or nothing; corral's READY moment (the instance's
`since` in /admin/models) must follow within a bound the old schedule could not meet."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import uvloop

from corral.supervisor import process as process_mod
from corral.supervisor.process import ChildExited, ChildProcess

from conftest import Corral, CorralFactory, wait_until

# Sleeps as many seconds as the file argv[2] says, then listens on argv[1] (GET /health: 200),
# writes time.time() of that moment to argv[3], and prints a line unless argv[4] is "silent".
# Nothing else on its output: a silent child says nothing at all.
CHILD = r"""
import http.server, os, sys, time
port, delay, stamp, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

time.sleep(float(open(delay).read()))
# Taken before the port opens: a probe may connect the moment it listens, before this child
# runs its next line, so a stamp after could come later than corral's READY.
ready = time.time()
server = http.server.HTTPServer(("127.0.0.1", port), Health)  # bound and listening now
with open(stamp + ".tmp", "w") as f:
    f.write(repr(ready))
os.replace(stamp + ".tmp", stamp)
if mode != "silent":
    print(f"listening on http://127.0.0.1:{port}", flush=True)
server.serve_forever()
"""

# The child opens its port 1.5 s after it starts and later, where the old schedule's gap had
# grown to 250 ms (10 ms ×1.5 per probe reaches it after about 0.75 s). The rounds' delays are
# 250 / 7 ms apart: under that schedule their lateness falls in seven phases of the 250 ms
# gap, so the median round is about 100 ms late whatever the phase of the first (measured:
# 90-145 ms). Now: within POLL_S (20 ms) for a silent child, a few ms for one that prints its
# line; BOUND_S leaves the rest to a loaded 2-core box (a full run with another test run
# beside it, load 7: a silent child's median 65 ms), below the old schedule's lowest median.
DELAYS_S = tuple(1.5 + i * 0.25 / 7 for i in range(7))
BOUND_S = 0.08


@pytest.fixture(scope="module")
def children(start_corral_module: CorralFactory, tmp_path_factory: pytest.TempPathFactory,
             ) -> tuple[Corral, Path]:
    folder = tmp_path_factory.mktemp("readiness")
    script = folder / "child.py"
    script.write_text(CHILD)

    def model(name: str, mode: str, health: str) -> dict[str, Any]:
        return {"backend": "command", "memory_mb": 16, "ttl": 0, "health": health,
                "start_timeout": 30,
                "command": [sys.executable, str(script), "${PORT}", str(folder / "delay"),
                            str(folder / f"{name}.stamp"), mode]}

    config = {"models": {"talks": model("talks", "line", "/health"),
                         "silent": model("silent", "silent", "/health"),
                         "silent-port": model("silent-port", "silent", "none")}}
    return start_corral_module(config), folder


def _lateness(corral: Corral, name: str, folder: Path, delay: float) -> float:
    """Load `name` (its child ready `delay` s after it starts), and how long after the child's
    own ready moment corral called it ready."""
    stamp = folder / f"{name}.stamp"
    stamp.unlink(missing_ok=True)
    (folder / "delay").write_text(repr(delay))
    answer = corral.http.post(f"/admin/models/{name}/load", timeout=60)
    assert answer.status_code == 200, answer.text
    state = corral.model(name)
    assert state["state"] == "ready", state
    # With `health: none` corral may see the port open before the child writes its stamp.
    wait_until(stamp.exists, timeout=10, interval=0.01)
    late = float(state["since"]) - float(stamp.read_text())
    assert corral.http.post(f"/admin/models/{name}/unload").status_code == 200
    return late


@pytest.mark.parametrize("name", ["talks", "silent", "silent-port"])
def test_ready_follows_the_child_within_the_bound(children: tuple[Corral, Path],
                                                  name: str) -> None:
    corral, folder = children
    late = sorted(_lateness(corral, name, folder, delay) for delay in DELAYS_S)
    assert late[0] > 0, late  # corral cannot see it ready before it is
    assert late[len(late) // 2] <= BOUND_S, f"median round too late: {late}"


# -- the probe loop itself (ChildProcess.wait_healthy), in-process -----------------------------

# Prints `before` lines, sleeps, prints the ready line, then lives on (until stopped).
TALKER = r"""
import sys, time
for i in range(int(sys.argv[1])):
    print(f"loading {i}", flush=True)
time.sleep(float(sys.argv[2]))
print(sys.argv[3], flush=True)
time.sleep(60)
"""


def _probe_run(ready_line: str, ready_lines: tuple[str, ...] | None, *,
               poll_s: float, before: int = 20, opens_after: float = 0.0) -> tuple[float, int]:
    """Runs TALKER, with a probe that says yes `opens_after` seconds after the ready line is
    in the child's log: (seconds from that line's arrival to wait_healthy's return, probes
    made)."""
    async def run() -> tuple[float, int]:
        child = ChildProcess("talker", [sys.executable, "-c", TALKER, str(before), "0.4",
                                        ready_line], {})
        await child.spawn()
        probes = 0
        seen_at: list[float] = []
        loop = asyncio.get_running_loop()

        async def ready(_: float) -> bool:
            nonlocal probes
            probes += 1
            return bool(seen_at) and loop.time() >= seen_at[0] + opens_after

        def keep(lines: list[bytes], base: Any = child._keep) -> None:
            base(lines)
            if not seen_at and any(ready_line.encode() in line for line in lines):
                seen_at.append(loop.time())

        assert child._output is not None
        child._output._keep = keep  # note the moment the ready line arrives
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(process_mod, "POLL_S", poll_s)
                await child.wait_healthy(ready, 10, ready_lines)
            return loop.time() - seen_at[0], probes
        finally:
            await child.stop(1)

    return uvloop.run(run())


def test_a_ready_line_wakes_the_probe_at_once() -> None:
    # The fallback poll set to 5 s: only the line can explain a prompt answer.
    late, probes = _probe_run("model loaded", ("model loaded",), poll_s=5)
    assert late < 0.05, late
    # The 20 "loading" lines woke no probe: the first one, then the one for the line.
    assert probes == 2, probes


def test_any_output_wakes_the_probe_when_no_ready_line_is_known() -> None:
    late, probes = _probe_run("up", None, poll_s=5, before=2000)
    assert late < 0.05, late
    # Coalesced: 2000 lines in a burst bring probes WAKE_GAP_S apart for HOT_S (a line may
    # come just before the port opens), not one a line; then none until the next line.
    most = process_mod.HOT_S / process_mod.WAKE_GAP_S + 10
    assert probes <= most, probes


def test_a_ready_line_just_before_the_port_opens_is_followed_closely() -> None:
    # uvicorn (vLLM) logs "Application startup complete", then opens its socket: after the
    # line the probes keep WAKE_GAP_S apart for HOT_S, not POLL_S (5 s here).
    late, _ = _probe_run("Application startup complete", ("Application startup complete",),
                         poll_s=5, opens_after=0.03)
    # The lower bound with a float's slack: `now >= seen + 0.03` held, yet `now - seen` can
    # round to 0.029999999998 (seen once).
    assert 0.03 - 1e-6 <= late < 0.03 + 0.05, late


def test_a_line_it_does_not_know_leaves_the_fallback_poll() -> None:
    # The unknown line wakes nothing; the fallback poll finds it within POLL_S.
    late, probes = _probe_run("something else", ("model loaded",), poll_s=0.02)
    assert late < 0.1, late
    # Polled all along over the 0.4 s (20 ms apart: ~20 on a quiet box, 8 seen on a loaded
    # one); the unknown line alone would have woken one.
    assert probes >= 5, probes


def test_a_child_that_dies_during_a_hanging_probe_is_noticed_at_once() -> None:
    async def run() -> float:
        child = ChildProcess("dies", [sys.executable, "-c",
                                      "import time; print('x', flush=True); time.sleep(0.3)"],
                             {})
        await child.spawn()
        cancelled = asyncio.Event()

        async def hangs(_: float) -> bool:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return False

        started = time.monotonic()
        with pytest.raises(ChildExited):
            await child.wait_healthy(hangs, 30, None)
        await asyncio.wait_for(cancelled.wait(), 1)  # the probe was not left running
        return time.monotonic() - started

    assert uvloop.run(run()) < 5


def test_a_cancelled_wait_leaves_no_probe_running() -> None:
    async def run() -> None:
        child = ChildProcess("slow", [sys.executable, "-c", "import time; time.sleep(30)"], {})
        await child.spawn()
        running = 0

        async def hangs(_: float) -> bool:
            nonlocal running
            running += 1
            try:
                await asyncio.sleep(60)
            finally:
                running -= 1
            return False

        waiting = asyncio.create_task(child.wait_healthy(hangs, 30, None))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)
        assert running == 0
        await child.stop(1)

    uvloop.run(run())


def test_a_childs_access_line_of_the_probe_itself_wakes_no_probe() -> None:
    # A command child logging each request (http.server, uvicorn) writes a line per probe:
    # were it a wake-up, the probes would feed themselves (~175 a second, measured).
    from corral.supervisor.process import _says_ready

    access = ['127.0.0.1 - - [27/Nov/2026 08:00:00] "GET /health HTTP/1.1" 503 -']
    assert not _says_ready(access, None, "/health")
    assert _says_ready([*access, "Uvicorn running on http://127.0.0.1:8000"], None, "/health")
    assert _says_ready(access, None, None)  # no path given: any output still wakes
    assert not _says_ready(access, ("model loaded",), "/health")
