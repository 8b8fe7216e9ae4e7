"""The group keeper: a small process beside the daemon that kills its children's process groups
the moment the daemon dies, however it dies.

Each child gets SIGKILL from the kernel when the daemon dies (parent-death signal), but that
signal reaches only the child itself. vLLM's API server forks an engine core and a worker, and
those would live on, holding their memory, after a `kill -9` of the daemon. The daemon tells the
keeper (over a pipe) which groups are alive; when the pipe reaches EOF, the daemon is gone, and
the keeper SIGKILLs every group still listed, then exits. A clean shutdown stops the children
first and forgets their groups, so the keeper then finds nothing to do.

Run as `python -m corral.supervisor.reaper`; `GroupKeeper` is the daemon's end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import structlog

log = structlog.get_logger("corral.reaper")

__all__ = ["GroupKeeper", "main"]


class GroupKeeper:
    """The daemon's handle on its keeper process (one per daemon)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # Its own session: a Ctrl-C meant for the daemon's terminal must not take it first.
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "corral.supervisor.reaper"], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                close_fds=True)
        except OSError as exc:  # corral still serves; the parent-death signal remains
            log.error("reaper.not_started", error=str(exc),
                      note="children's helper processes may outlive a killed daemon")
            return
        log.info("reaper.started", pid=self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            # A few bytes into a pipe nobody else writes: never blocks in practice.
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            log.warning("reaper.gone", pid=self._proc.pid,
                        note="children's helper processes may outlive a killed daemon")
            self._proc = None

    def close(self) -> None:
        """Close the pipe (the keeper kills what is still listed, then exits) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    # The daemon's stop signals are for the daemon; this process ends when its pipe does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: set[int] = set()
    for raw in sys.stdin.buffer:
        line = raw.strip()
        with contextlib.suppress(ValueError):
            if line.startswith(b"+"):
                groups.add(int(line[1:]))
            elif line.startswith(b"-"):
                groups.discard(int(line[1:]))
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


if __name__ == "__main__":
    main()
