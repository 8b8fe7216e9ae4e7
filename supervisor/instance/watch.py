"""Watching one ready child: its exit, its /health (the watchdog), and a probe at once when a
request to it timed out. One ChildWatch per child; what it finds it reports to its instance,
which owns the state."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp
import structlog

from corral.supervisor.config import ModelSpec
from corral.supervisor.instance.state import Health
from corral.supervisor.process import ChildProcess, port_open, probe_health

# What the watch tells its instance: the child exited (code, the reason in words), or it was
# found unresponsive and is being killed (the reason).
OnExit = Callable[[ChildProcess, int, str], None]
OnUnresponsive = Callable[[ChildProcess, str], None]


class ChildWatch:
    def __init__(self, name: str, process: ChildProcess, session: aiohttp.ClientSession, *,
                 port: int, health_path: str | None, settings: Callable[[], ModelSpec],
                 health: Health, serving: Callable[[], bool], on_exit: OnExit,
                 on_unresponsive: OnUnresponsive, log: structlog.typing.FilteringBoundLogger):
        self._name = name
        self.process = process
        self._session = session
        self._port = port
        self._health_path = health_path  # None: the port accepting connections is health
        self._settings = settings  # the model's spec now: health knobs apply at once on reload
        self._health = health
        self._serving = serving
        self._on_exit = on_exit
        self._on_unresponsive = on_unresponsive
        self._log = log
        self.unresponsive = False  # killed for not answering
        self._exit_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[bool] | None = None

    def start(self) -> None:
        self._exit_task = asyncio.create_task(self._watch_exit(), name=f"exit:{self._name}")
        self._watchdog_task = asyncio.create_task(self._watchdog(),
                                                  name=f"watchdog:{self._name}")

    def close(self) -> None:
        """The child's stop has begun or ended: nothing of this watch runs on (the task
        that calls this, when it is one of the watch's, ends by itself)."""
        current = asyncio.current_task()
        for task in (self._exit_task, self._watchdog_task, self._probe_task):
            if task is not None and task is not current:
                task.cancel()

    def stop_watchdog(self) -> None:
        task = self._watchdog_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def settle(self, within: float) -> None:
        """Give the exit watcher up to `within` seconds to take in an exit."""
        task = self._exit_task
        if task is None or task.done():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), within)

    async def _watch_exit(self) -> None:
        process = self.process
        code = await process.exited()
        # At once, not after the log drains: helpers it forked (vLLM's engine core, a
        # wrapper's server) must not go on serving a stream for a process that is gone.
        process.sweep_group()
        await process.wait()  # its last lines, for the reason below (bounded)
        tail = process.tail(5)
        why = process.exit_reason()
        detail = f": {why}" if why else f": {tail[-1]}" if tail else ""
        self._on_exit(process, code,
                      f"{self._name} exited unexpectedly with code {code}{detail}")

    async def probe_now(self) -> bool:
        """A request to this child timed out: ask /health at once (one probe shared by every
        request that asks meanwhile) and kill the child when it does not answer, so the next
        request gets a fresh child instead of the same wait. True: it answered."""
        task = self._probe_task
        if task is None or task.done():
            task = asyncio.create_task(self._probe_once(), name=f"probe:{self._name}")
            self._probe_task = task
        return await asyncio.shield(task)

    async def _probe_once(self) -> bool:
        problem = await self._health_problem()
        self._health.last_probe = time.time()
        if problem is None:
            self._health.last_ok = self._health.last_probe
            return True
        self._health.last_error = problem
        if self._serving():
            await self._declare_unresponsive(f"a request timed out and its health probe "
                                             f"failed ({problem})")
        return False

    async def _health_problem(self) -> str | None:
        """What is wrong with the child's health (None: healthy): its backend's health path,
        or a command child's own `health` (None there: its port accepting connections)."""
        timeout = self._settings().health_timeout
        if self._health_path is None:
            return None if await port_open(self._port, timeout) \
                else "its port refuses connections"
        return await probe_health(
            self._session, f"http://127.0.0.1:{self._port}{self._health_path}", timeout)

    async def _declare_unresponsive(self, why: str) -> None:
        process = self.process
        self.unresponsive = True
        self._log.warning("instance.unresponsive", pid=process.pid, why=why)
        self._on_unresponsive(process, f"{self._name} stopped answering: {why}; killed pid "
                                       f"{process.pid}")
        await process.stop(0)  # SIGKILL works on a stopped (SIGSTOP) process too

    async def _watchdog(self) -> None:
        """Probe /health of a ready child; kill it after `health_failures` misses in a row.
        /health never touches the slots, so probing it cannot hide a request's
        cancellation."""
        health = self._health
        while self._serving():
            await asyncio.sleep(self._settings().health_interval)
            if not self._serving():
                return
            problem = await self._health_problem()
            now = time.time()
            health.last_probe = now
            if problem is None:
                health.last_ok = now
                health.failures = 0
                continue
            health.failures += 1
            health.last_error = problem
            limit = self._settings().health_failures
            self._log.warning("instance.health_failed", pid=self.process.pid, problem=problem,
                              failures=health.failures, limit=limit)
            if health.failures >= limit and self._serving():
                await self._declare_unresponsive(
                    f"{health.failures} health probes failed in a row (last: {problem})")
                return
