"""The group keeper (supervisor/reaper.py) on real processes: when the daemon's end of the pipe
closes without the group being forgotten (the daemon died), the whole group is killed, helpers
included; a forgotten group is left alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from corral.supervisor.reaper import GroupKeeper

from conftest import wait_until

# A leader that forks a helper which outlives it, both in a new session (as corral's children).
FORKS = ("import os, time\n"
         "if os.fork() == 0:\n"
         "    time.sleep(300)\n"
         "time.sleep(300)\n")


def spawn_group() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", FORKS], start_new_session=True)


def members(pgid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(name))
    return found


def test_daemon_gone_kills_every_watched_group_and_spares_forgotten_ones() -> None:
    keeper = GroupKeeper()
    keeper.start()
    watched, forgotten = spawn_group(), spawn_group()
    try:
        wait_until(lambda: len(members(watched.pid)) == 2 and len(members(forgotten.pid)) == 2)
        keeper.watch(watched.pid)
        keeper.watch(forgotten.pid)
        keeper.forget(forgotten.pid)
        keeper.close()  # what the kernel does to the pipe when the daemon dies
        wait_until(lambda: not members(watched.pid), timeout=10)
        assert len(members(forgotten.pid)) == 2
    finally:
        for proc in (watched, forgotten):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
