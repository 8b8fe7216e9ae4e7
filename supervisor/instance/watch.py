"""Watching a ready child: its exit, its /health (the watchdog), and a probe at once when a
request to it timed out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import aiohttp

from corral.supervisor.port import State
from corral.supervisor.process import ChildProcess, port_open, probe_health

if TYPE_CHECKING:
    from corral.supervisor.instance.core import Instance


def _watch(self: Instance, session: aiohttp.ClientSession, process: ChildProcess) -> None:
    self._exit_task = asyncio.create_task(self._watch_exit(process),
                                          name=f"exit:{self.name}")
    self._watchdog_task = asyncio.create_task(self._watchdog(session, process),
                                              name=f"watchdog:{self.name}")

async def _watch_exit(self: Instance, process: ChildProcess) -> None:
    code = await process.exited()
    # At once, not after the log drains: helpers it forked (vLLM's engine core, a wrapper's
    # server) must not go on serving a stream for a process that is gone.
    process.sweep_group()
    await process.wait()  # its last lines, for the reason below (bounded)
    if self.process is not process:
        return
    tail = process.tail(5)
    why = process.exit_reason()
    detail = f": {why}" if why else f": {tail[-1]}" if tail else ""
    message = f"{self.name} exited unexpectedly with code {code}{detail}"
    if self.state is State.READY:
        self._swap(State.READY, State.FAILED, message)
    elif self.state is State.DRAINING or (self.state is State.FAILED and self._marked_dead):
        # Draining: the stop under way owns the ending (STOPPED, not FAILED: no restart
        # may begin under it). Marked dead: the exit code says more than "gone".
        self._noted(message)

def killed_as_unresponsive(self: Instance) -> bool:
    """Whether the current child was killed by the watchdog (it stopped answering)."""
    return self._unresponsive_pid is not None and self._unresponsive_pid == self.pid

def mark_if_dead(self: Instance) -> None:
    """A request saw the child break: if it is gone, fail the instance now, before the
    exit watcher runs, so no other request is handed its port."""
    if self.child_alive():
        return
    message = f"{self.name} (pid {self.pid}) died while serving"
    if self.state is State.READY:
        self._marked_dead = True
        self._swap(State.READY, State.FAILED, message)
    elif self.state is State.DRAINING:
        self._noted(message)  # the drain ends now; its stop goes on to STOPPED

async def settle_exit(self: Instance, within: float) -> None:
    task = self._exit_task
    if task is None or task.done():
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), within)

async def probe_now(self: Instance) -> bool:
    """A request to this child timed out: ask /health at once (one probe shared by every
    request that asks meanwhile) and kill the child when it does not answer, so the next
    request gets a fresh child instead of the same wait. True: it answered."""
    task = self._probe_task
    if task is None or task.done():
        process, session = self.process, self._session
        if process is None or session is None:
            return False
        task = asyncio.create_task(self._probe_once(session, process),
                                   name=f"probe:{self.name}")
        self._probe_task = task
    return await asyncio.shield(task)

async def _probe_once(self: Instance, session: aiohttp.ClientSession,
                      process: ChildProcess) -> bool:
    problem = await _health_problem(self, session)
    self.health.last_probe = time.time()
    if problem is None:
        self.health.last_ok = self.health.last_probe
        return True
    self.health.last_error = problem
    if self.process is process and self.state in (State.READY, State.DRAINING):
        await self._declare_unresponsive(process, f"a request timed out and its health "
                                                  f"probe failed ({problem})")
    return False

async def _health_problem(self: Instance, session: aiohttp.ClientSession) -> str | None:
    """What is wrong with the child's health (None: healthy): its backend's health path, or a
    command child's own `health` (None there: its port accepting connections)."""
    path = self.started_with.health_path if self.backend.kind == "command" \
        else self.backend.health_path
    if path is None:
        return None if await port_open(self.port or 0, self.spec.health_timeout) \
            else "its port refuses connections"
    return await probe_health(session, f"http://127.0.0.1:{self.port}{path}",
                              self.spec.health_timeout)

async def _declare_unresponsive(self: Instance, process: ChildProcess, why: str) -> None:
    self._unresponsive_pid = process.pid
    message = f"{self.name} stopped answering: {why}; killed pid {process.pid}"
    self._log.warning("instance.unresponsive", pid=process.pid, why=why)
    if self.state is State.READY:
        self._swap(State.READY, State.FAILED, message)
    else:
        self._noted(message)
    await process.stop(0)  # SIGKILL works on a stopped (SIGSTOP) process too

async def _watchdog(self: Instance, session: aiohttp.ClientSession, process: ChildProcess) -> None:
    """Probe /health of a ready child; kill it after `health_failures` misses in a row.
    /health never touches the slots, so probing it cannot hide a request's cancellation."""
    def serving() -> bool:
        return self.process is process and self.state in (State.READY, State.DRAINING)

    while serving():
        await asyncio.sleep(self.spec.health_interval)
        if not serving():
            return
        problem = await _health_problem(self, session)
        now = time.time()
        self.health.last_probe = now
        if problem is None:
            self.health.last_ok = now
            self.health.failures = 0
            continue
        self.health.failures += 1
        self.health.last_error = problem
        self._log.warning("instance.health_failed", pid=process.pid, problem=problem,
                          failures=self.health.failures, limit=self.spec.health_failures)
        if self.health.failures >= self.spec.health_failures and serving():
            await self._declare_unresponsive(process, (
                f"{self.health.failures} health probes failed in a row (last: {problem})"))
            return
