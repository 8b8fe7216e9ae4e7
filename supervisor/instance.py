"""A model's running state: one state machine, its child, its leases and its queue."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
import structlog

from corral.supervisor.backends.base import Backend, BinaryNotFound
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import StartFailed, StartTimedOut
from corral.supervisor.process import ChildExited, ChildProcess, ChildStartTimeout, free_port


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.READY, State.FAILED, State.STOPPING}),
    State.READY: frozenset({State.DRAINING, State.STOPPING, State.FAILED}),
    State.DRAINING: frozenset({State.STOPPING, State.FAILED}),
    State.STOPPING: frozenset({State.STOPPED, State.FAILED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPING, State.STOPPED}),
}

# States in which a child holds (or is about to hold, or still holds) memory.
LOADED_STATES = frozenset({State.STARTING, State.READY, State.DRAINING, State.STOPPING})


class IllegalTransition(RuntimeError):
    pass


class Changed:
    """A broadcast 'something changed' that any number of tasks can await with a timeout."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()  # re-armed for the next change

    async def wait(self, timeout: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


@dataclass
class Lease:
    """The right to send one request to a ready instance; release exactly once."""

    instance: Instance
    base_url: str
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.instance._release_slot()

    async def upstream_broke(self, within: float = 0.5) -> None:
        """The request to the child broke. If the child is dying, wait (briefly) until its
        state says so, so that a retry starts a new child instead of leasing a dead port."""
        await self.instance.settle_exit(within)


class Instance:
    def __init__(self, spec: ModelSpec, backend: Backend, on_change: Callable[[], None]):
        self.spec = spec
        self.backend = backend
        self.state = State.STOPPED
        self.since = time.time()
        self.port: int | None = None
        self.process: ChildProcess | None = None
        self.in_flight = 0
        self.queued = 0  # requests inside acquire(): waiting for start, room or a slot
        self.held = 0  # groups running with this model as a member (Daemon.reserve)
        self.last_used = time.monotonic()
        self.restarts = 0
        self.starts = 0
        self.last_error: str | None = None
        self.pinned = False
        self._slots = asyncio.Semaphore(spec.parallel)
        self._start_task: asyncio.Task[None] | None = None
        self._exit_task: asyncio.Task[None] | None = None
        self._state_changed = Changed()
        self._on_change = on_change
        self._log = structlog.get_logger("corral.instance").bind(model=spec.name)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.queued > 0 or self.held > 0

    @property
    def slots_full(self) -> bool:
        return self._slots.locked()

    def idle_seconds(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.last_used

    # -- state machine -------------------------------------------------------------------------

    def _transition(self, new: State, error: str | None = None) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state} → {new}")
        old, self.state, self.since = self.state, new, time.time()
        if error is not None:
            self.last_error = error
        self._log.info("instance.state", old=str(old), new=str(new), pid=self.pid,
                       **({"error": error} if error else {}))
        self._state_changed.fire()
        self._on_change()

    async def wait_change(self, timeout: float) -> None:
        await self._state_changed.wait(timeout)

    # -- start ---------------------------------------------------------------------------------

    def begin_start(self, session: aiohttp.ClientSession,
                    on_spawn: Callable[[Instance], None]) -> None:
        """STOPPED|FAILED → STARTING and launch the one start task every waiter shares."""
        if self.state is State.FAILED:
            self.restarts += 1
        self._transition(State.STARTING)
        self.starts += 1
        self._start_task = asyncio.create_task(self._start(session, on_spawn),
                                               name=f"start:{self.name}")

    async def wait_ready(self) -> None:
        """Wait for the shared start to finish; raises its StartFailed for every waiter."""
        task = self._start_task
        if task is None:
            return
        # Shield: one impatient client hanging up must not cancel the start for the others.
        await asyncio.shield(task)

    async def _start(self, session: aiohttp.ClientSession,
                     on_spawn: Callable[[Instance], None]) -> None:
        process = await self._spawn_and_wait(session, on_spawn, last_try=False)
        if process is None:  # someone took its port before the child bound it: once more
            process = await self._spawn_and_wait(session, on_spawn, last_try=True)
        assert process is not None  # the last try returns a child or raises
        self.last_error = None
        self._transition(State.READY)
        self._exit_task = asyncio.create_task(self._watch_exit(process), name=f"exit:{self.name}")

    async def _spawn_and_wait(self, session: aiohttp.ClientSession,
                              on_spawn: Callable[[Instance], None],
                              last_try: bool) -> ChildProcess | None:
        """One start attempt: the healthy child, or None when it lost its port (retry)."""
        self.port = free_port()
        try:
            argv = self.backend.argv(self.spec, self.port)
        except BinaryNotFound as exc:
            self._transition(State.FAILED, str(exc))
            raise StartFailed(str(exc)) from exc
        process = ChildProcess(self.name, argv, self.backend.env(self.spec))
        self.process = process
        try:
            await process.spawn()
        except OSError as exc:
            message = f"cannot execute {argv[0]}: {exc.strerror or exc}"
            self._transition(State.FAILED, message)
            raise StartFailed(message) from exc
        on_spawn(self)
        url = f"http://127.0.0.1:{self.port}{self.backend.health_path}"
        try:
            await process.wait_healthy(session, url, self.spec.start_timeout)
        except ChildExited as exc:
            await process.stop(0)
            if not last_try and self.backend.lost_port_race(exc.tail):
                self._log.warning("instance.port_taken", port=self.port, pid=process.pid)
                return None
            self._transition(State.FAILED, str(exc))
            raise StartFailed(str(exc), exc.tail) from exc
        except ChildStartTimeout as exc:
            message = f"{exc}; stopped it"
            self._transition(State.FAILED, message)
            await process.stop(0)
            raise StartTimedOut(message, exc.tail) from exc
        except asyncio.CancelledError:
            # The daemon is shutting down mid-start.
            await process.stop(0)
            raise
        return process

    async def _watch_exit(self, process: ChildProcess) -> None:
        code = await process.wait()
        process.sweep_group()  # helpers it forked die with it, while the group id is ours
        if self.process is process and self.state in (State.READY, State.DRAINING):
            tail = process.tail(5)
            detail = f": {tail[-1]}" if tail else ""
            self._transition(State.FAILED, f"{self.name} exited unexpectedly with code {code}"
                                           f"{detail}")

    async def settle_exit(self, within: float) -> None:
        task = self._exit_task
        if task is None or task.done():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), within)

    # -- leases --------------------------------------------------------------------------------

    async def take_slot(self, timeout: float) -> Lease:
        """Wait for one of the `parallel` slots; the caller has checked the state is READY."""
        if self._slots.locked():
            await asyncio.wait_for(self._slots.acquire(), timeout)
        else:
            await self._slots.acquire()  # free slot: no timer task on the hot path
        self.in_flight += 1
        self.last_used = time.monotonic()
        return Lease(self, f"http://127.0.0.1:{self.port}")

    def _release_slot(self) -> None:
        self.in_flight -= 1
        self.last_used = time.monotonic()
        self._slots.release()
        self._on_change()

    # -- stop ----------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """READY → DRAINING: take no new leases, wait (bounded) for in-flight ones to end."""
        if self.state is State.READY:
            self._transition(State.DRAINING)
        deadline = asyncio.get_running_loop().time() + timeout
        while self.in_flight > 0 and self.state is State.DRAINING:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            await self.wait_change(min(remaining, 0.1))

    async def stop(self, reason: str) -> None:
        if self.state in (State.STOPPED, State.STOPPING):
            return
        if self.state is State.STARTING and self._start_task:
            self._start_task.cancel()
        self._transition(State.STOPPING)
        self._log.info("instance.stop", reason=reason, pid=self.pid)
        process = self.process
        if process:
            await process.stop(self.spec.stop_grace)
        if self._exit_task:
            self._exit_task.cancel()
            self._exit_task = None
        self._transition(State.STOPPED)

    def describe(self, now_mono: float | None = None) -> dict[str, Any]:
        now = now_mono or time.monotonic()
        idle = self.idle_seconds(now)
        ttl_left = None
        if self.state is State.READY and self.spec.ttl > 0 and not self.pinned:
            # In use, the clock has not started: it runs from the last release.
            ttl_left = self.spec.ttl if self.busy else max(0.0, self.spec.ttl - idle)
        return {
            "name": self.name,
            "backend": self.spec.backend,
            "model_path": str(self.spec.model_path),
            "aliases": list(self.spec.aliases),
            "state": str(self.state),
            "pid": self.pid if self.state in LOADED_STATES else None,
            "port": self.port if self.state in LOADED_STATES else None,
            "since": self.since,
            "last_used": time.time() - idle if self.starts else None,
            "in_flight": self.in_flight,
            "queue": self.queued,
            "held": self.held,
            "parallel": self.spec.parallel,
            "ttl": self.spec.ttl,
            "ttl_left": ttl_left,
            "pinned": self.pinned,
            "starts": self.starts,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }
