"""A model's running state: one state machine, its child, its leases and its queue."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
import structlog

from corral.supervisor.backends.base import Backend, BinaryNotFound
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import StartFailed, StartTimedOut, WorkersUnavailable
from corral.supervisor.events import EventBus
from corral.supervisor.process import (
    ChildExited,
    ChildProcess,
    ChildStartTimeout,
    free_port,
    probe_health,
    probe_lists_model,
)
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.deploy import Deployment, ProcessSet, RpcDeployer
from corral.supervisor.rpc.workers import RpcError


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
    # A stop, once begun, always ends in STOPPED (its task owns the ending, see _stop).
    State.STOPPING: frozenset({State.STOPPED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPING}),
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
    headers: dict[str, str]
    _released: bool = False
    # The slots it was taken from: a reload that changes `parallel` gives the next child a new
    # set, and a lease still out returns to the set it came from.
    _slots: asyncio.Semaphore | None = None

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.instance._release_slot(self._slots)

    def child_alive(self) -> bool:
        """Whether the child behind this lease still runs (cheap, synchronous)."""
        return self.instance.child_alive()

    async def upstream_broke(self, within: float = 0.5) -> None:
        """The request to the child broke. A dead child is marked failed at once, so the next
        request starts a new one instead of leasing a dead port; a dying one gets `within`
        seconds for its exit to be seen."""
        self.instance.mark_if_dead()
        await self.instance.settle_exit(within)


@dataclass
class Health:
    """What the watchdog saw of a ready child's /health."""

    last_probe: float | None = None  # wall clock
    last_ok: float | None = None
    failures: int = 0  # consecutive
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"last_probe": self.last_probe, "last_ok": self.last_ok,
                "failures": self.failures, "last_error": self.last_error}


class Instance:
    def __init__(self, spec: ModelSpec, backend: Backend, on_change: Callable[[], None],
                 replica: int = 1, keeper: GroupKeeper | None = None,
                 deployer: RpcDeployer | None = None, events: EventBus | None = None):
        self.spec = spec
        self._events = events or EventBus()
        self._keeper = keeper
        self._deployer = deployer  # for models split over RPC workers
        # A model with `replicas` runs several instances: replica 1 is named like the model,
        # the others "<model>#<n>". Each is a state machine of its own: replicas start, fail
        # and scale one by one.
        self.replica = replica
        self.name = spec.name if replica == 1 else f"{spec.name}#{replica}"

        self.started_with = spec  # the spec of the current (or last) child: spec + KV choice
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
        self.served = 0  # requests the current child has answered
        self.last_error: str | None = None
        self.pinned = False
        self.health = Health()
        self.start_failures = 0  # consecutive failed starts: the back-off exponent
        self._retry_at: float | None = None  # monotonic; no new start before it
        self._headers: dict[str, str] = {}
        self._slots = asyncio.Semaphore(spec.parallel)
        self._slots_size = spec.parallel
        self._start_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._exit_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._drain_until = 0.0
        self._marked_dead = False  # failed by mark_if_dead, before the exit watcher ran
        self._unresponsive_pid: int | None = None  # the child the watchdog killed
        self._state_changed = Changed()
        self._size: tuple[ModelSpec | None, int] = (None, 0)
        self._on_change = on_change
        self._log = structlog.get_logger("corral.instance").bind(
            model=spec.name, **({"replica": replica} if replica > 1 else {}))

    @property
    def model(self) -> str:
        """The configured model this instance serves (its replicas share it)."""
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

    @property
    def free_slots(self) -> int:
        return max(0, self.spec.parallel - self.in_flight)

    @property
    def size_bytes(self) -> int:
        """The model's files on disk (a first guess at its memory), read once per spec."""
        if self._size[0] is not self.spec:
            total = 0
            for path in (self.spec.model_path, self.spec.mmproj):
                with contextlib.suppress(OSError, TypeError):
                    total += os.stat(path).st_size if path else 0
            self._size = (self.spec, total)
        return self._size[1]

    def idle_seconds(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.last_used

    def child_alive(self) -> bool:
        return self.process is not None and self.process.alive()

    # -- state machine -------------------------------------------------------------------------

    def _transition(self, new: State, error: str | None = None) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state} → {new}")
        old, self.state, self.since = self.state, new, time.time()
        if error is not None:
            self.last_error = error
        self._log.info("instance.state", old=str(old), new=str(new), pid=self.pid,
                       **({"error": error} if error else {}))
        self._events.publish("state", model=self.model, instance=self.name, old=str(old),
                             new=str(new), pid=self.pid, error=error)
        self._state_changed.fire()
        self._on_change()

    async def wait_change(self, timeout: float) -> None:
        await self._state_changed.wait(timeout)

    # -- start ---------------------------------------------------------------------------------

    def backoff_left(self, now: float | None = None) -> float:
        """Seconds before a failed model may be started again (0: now)."""
        if self.state is not State.FAILED or self._retry_at is None:
            return 0.0
        return max(0.0, self._retry_at - (now or time.monotonic()))

    def begin_start(self, session: aiohttp.ClientSession,
                    on_spawn: Callable[[Instance], None],
                    kv_cache: tuple[str | None, str | None] | None = None,
                    tune: Callable[[ModelSpec], ModelSpec] | None = None,
                    reason: str = "demand") -> None:
        """STOPPED|FAILED → STARTING and launch the one start task every waiter shares.
        `kv_cache`: KV cache types the strategy chose for this start (None: as configured);
        `tune`: the backend's settings for this start from those (a vLLM GPU share);
        `reason`: why it starts (a request's demand, a reload), for the events."""
        if kv_cache is not None:
            self.started_with = dataclasses.replace(
                self.spec, cache_type_k=kv_cache[0] or self.spec.cache_type_k,
                cache_type_v=kv_cache[1] or self.spec.cache_type_v)
        else:
            self.started_with = self.spec
        if tune is not None:
            self.started_with = tune(self.started_with)
        restart = self.state is State.FAILED
        if restart:
            self.restarts += 1
        self._transition(State.STARTING)
        self._fit_slots()
        self.starts += 1
        self.served = 0
        self._events.publish("load", model=self.model, instance=self.name, reason=reason,
                             restart=restart)
        self._start_task = _owned_task(self._start(session, on_spawn), f"start:{self.name}")

    async def wait_ready(self) -> None:
        """Wait for the shared start to finish; raises its StartFailed for every waiter."""
        task = self._start_task
        if task is None:
            return
        # Shield: one impatient client hanging up must not cancel the start for the others.
        await asyncio.shield(task)

    async def _start(self, session: aiohttp.ClientSession,
                     on_spawn: Callable[[Instance], None]) -> None:
        began = time.monotonic()
        progress = asyncio.create_task(self._report_progress(began), name=f"load:{self.name}")
        try:
            process = await self._spawn_and_wait(session, on_spawn, last_try=False)
            if process is None:  # someone took its port before the child bound it: once more
                process = await self._spawn_and_wait(session, on_spawn, last_try=True)
        except StartFailed as exc:
            if self.state is State.FAILED:  # not when a stop took over mid-start
                self._note_start_failure()
                self._events.publish("load_failed", model=self.model, instance=self.name,
                                     seconds=round(time.monotonic() - began, 3),
                                     error=str(exc))
            raise
        finally:
            progress.cancel()
        assert process is not None  # the last try returns a child or raises
        self._events.publish("loaded", model=self.model, instance=self.name, pid=process.pid,
                             port=self.port, seconds=round(time.monotonic() - began, 3))
        self.last_error = None
        self.start_failures = 0
        self._retry_at = None
        self.health = Health()
        self._transition(State.READY)
        self._exit_task = asyncio.create_task(self._watch_exit(process), name=f"exit:{self.name}")
        self._watchdog_task = asyncio.create_task(self._watchdog(session, process),
                                                  name=f"watchdog:{self.name}")

    async def _report_progress(self, began: float, every: float = 1.0) -> None:
        """While the child loads: what corral can honestly know of its progress, each
        second: the time it has taken so far and the last line of the child's log."""
        while self.state is State.STARTING:
            await asyncio.sleep(every)
            if self.state is not State.STARTING:
                return
            tail = self.process.tail(1) if self.process is not None else []
            self._events.publish("load_progress", model=self.model, instance=self.name,
                                 pid=self.pid, elapsed=round(time.monotonic() - began, 1),
                                 log=tail[-1][-300:] if tail else None)

    def _note_start_failure(self) -> None:
        self.start_failures += 1
        base = self.spec.start_backoff
        if base <= 0:
            self._retry_at = None
            return
        delay = min(base * 2 ** (self.start_failures - 1), self.spec.start_backoff_max)
        self._retry_at = time.monotonic() + delay
        self._log.warning("instance.start_backoff", failures=self.start_failures,
                          retry_in=round(delay, 3))

    async def _spawn_and_wait(self, session: aiohttp.ClientSession,
                              on_spawn: Callable[[Instance], None],
                              last_try: bool) -> ChildProcess | None:
        """One start attempt: the healthy child, or None when it lost its port (retry)."""
        self.port = free_port()
        api_key = secrets.token_urlsafe(24)
        deployment = await self._deploy() if self.spec.rpc_workers else None
        try:
            argv = self.backend.argv(self.started_with, self.port)
        except BinaryNotFound as exc:
            if deployment is not None:
                await asyncio.shield(deployment.release())
            self._fail_start(str(exc))
            raise StartFailed(str(exc)) from exc
        env = {**self.backend.env(self.started_with), **self.backend.auth_env(api_key)}
        process = ChildProcess(self.name, argv, env, keeper=self._keeper) \
            if deployment is None else \
            ProcessSet(self.name, argv, env, deployment, keeper=self._keeper)
        self.process = process
        self._headers = {"Authorization": f"Bearer {api_key}"}
        # Shielded: a stop arriving mid-spawn must find a child it can stop, not an exec
        # that finished after its caller gave up on it.
        spawning = asyncio.ensure_future(process.spawn())
        try:
            await asyncio.shield(spawning)
        except OSError as exc:
            if deployment is not None:  # its workers must not outlive a head that never ran
                await asyncio.shield(deployment.release())
            message = f"cannot execute {argv[0]}: {exc.strerror or exc}"
            self._fail_start(message)
            raise StartFailed(message) from exc
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait([spawning])
            await _stop_uncancellable(process)
            raise
        try:
            on_spawn(self)
            await process.wait_healthy(self._readiness(session), self.spec.start_timeout)
        except ChildExited as exc:
            await process.stop(0)
            if not last_try and self.backend.lost_port_race(exc.tail):
                self._log.warning("instance.port_taken", port=self.port, pid=process.pid)
                return None
            self._fail_start(str(exc))
            raise StartFailed(str(exc), exc.tail) from exc
        except ChildStartTimeout as exc:
            message = f"{exc}; stopped it"
            self._fail_start(message)
            await process.stop(0)
            raise StartTimedOut(message, exc.tail) from exc
        except asyncio.CancelledError:
            # Stopped (unload, eviction, shutdown) mid-start: the child must not outlive it.
            await _stop_uncancellable(process)
            raise
        except Exception as exc:
            # Bookkeeping around the child failed (e.g. the state file): a child nobody
            # tracks must not keep running.
            self._log.exception("instance.start_bookkeeping_failed", pid=process.pid)
            await process.stop(0)
            message = f"{self.name}: start aborted: {type(exc).__name__}: {exc}"
            self._fail_start(message)
            raise StartFailed(message) from exc
        return process

    async def _deploy(self) -> Deployment:
        """Start the model's RPC workers and plan its split; the head's argv takes both.
        On any failure (cancellation included) no worker is left running."""
        if self._deployer is None:
            message = f"{self.name}: no RPC deployer (models split over workers need the daemon)"
            self._fail_start(message)
            raise StartFailed(message)
        try:
            deployment = await self._deployer.deploy(self.started_with, self.spec.start_timeout,
                                                     avoid_ports={self.port or 0})
        except (RpcError, BinaryNotFound) as exc:
            self._fail_start(str(exc))
            raise WorkersUnavailable(str(exc)) from exc
        self.started_with = dataclasses.replace(
            self.started_with, rpc_servers=deployment.endpoints,
            tensor_split=deployment.plan.layers)
        return deployment

    def _readiness(self, session: aiohttp.ClientSession) -> Callable[[float], Awaitable[bool]]:
        """The start's readiness probe: /health answers 200 and, for a backend that answers
        it early (vLLM), /v1/models lists the model's name."""
        base = f"http://127.0.0.1:{self.port}"
        health, headers, lists_models = base + self.backend.health_path, self._headers, \
            self.backend.lists_models

        async def ready(timeout: float) -> bool:
            if await probe_health(session, health, timeout) is not None:
                return False
            return not lists_models or await probe_lists_model(
                session, base + "/v1/models", self.spec.name, headers, timeout)

        return ready

    def _fail_start(self, message: str) -> None:
        if self.state is State.STARTING:  # a stop may have taken over meanwhile
            self._transition(State.FAILED, message)

    async def _watch_exit(self, process: ChildProcess) -> None:
        code = await process.wait()
        process.sweep_group()  # helpers it forked die with it, while the group id is ours
        if self.process is not process:
            return
        tail = process.tail(5)
        why = process.exit_reason()
        detail = f": {why}" if why else f": {tail[-1]}" if tail else ""
        message = f"{self.name} exited unexpectedly with code {code}{detail}"
        if self.state in (State.READY, State.DRAINING):
            self._transition(State.FAILED, message)
        elif self.state is State.FAILED and self._marked_dead:
            self.last_error = message  # the exit code and log line say more than "gone"
            self._on_change()

    def killed_as_unresponsive(self) -> bool:
        """Whether the current child was killed by the watchdog (it stopped answering)."""
        return self._unresponsive_pid is not None and self._unresponsive_pid == self.pid

    def mark_if_dead(self) -> None:
        """A request saw the child break: if it is gone, fail the instance now, before the
        exit watcher runs, so no other request is handed its port."""
        if self.state in (State.READY, State.DRAINING) and not self.child_alive():
            self._marked_dead = True
            self._transition(State.FAILED, f"{self.name} (pid {self.pid}) died while serving")

    async def settle_exit(self, within: float) -> None:
        task = self._exit_task
        if task is None or task.done():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), within)

    # -- health watchdog -----------------------------------------------------------------------

    async def _watchdog(self, session: aiohttp.ClientSession, process: ChildProcess) -> None:
        """Probe /health of a ready child; kill it after `health_failures` misses in a row.
        /health never touches the slots, so probing it cannot hide a request's cancellation."""
        url = f"http://127.0.0.1:{self.port}{self.backend.health_path}"

        def serving() -> bool:
            return self.process is process and self.state in (State.READY, State.DRAINING)

        while serving():
            await asyncio.sleep(self.spec.health_interval)
            if not serving():
                return
            problem = await probe_health(session, url, self.spec.health_timeout)
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
                self._unresponsive_pid = process.pid
                self._transition(State.FAILED, (
                    f"{self.name} stopped answering: {self.health.failures} health probes "
                    f"failed in a row (last: {problem}); killed pid {process.pid}"))
                await process.stop(0)  # SIGKILL works on a stopped (SIGSTOP) process too
                return

    # -- leases --------------------------------------------------------------------------------

    async def take_slot(self, timeout: float) -> Lease:
        """Wait for one of the `parallel` slots; the caller has checked the state is READY."""
        slots = self._slots
        if slots.locked():
            await asyncio.wait_for(slots.acquire(), timeout)
        else:
            await slots.acquire()  # free slot: no timer task on the hot path
        self.in_flight += 1
        self.last_used = time.monotonic()
        return Lease(self, f"http://127.0.0.1:{self.port}", self._headers, _slots=slots)

    def _release_slot(self, slots: asyncio.Semaphore | None = None) -> None:
        self.in_flight -= 1
        self.served += 1
        self.last_used = time.monotonic()
        (slots or self._slots).release()
        self._on_change()

    # -- reload --------------------------------------------------------------------------------

    def reconfigure(self, spec: ModelSpec, backend: Backend | None = None,
                    fresh_start: bool = False) -> None:
        """Take a reloaded spec (same name). Settings the child was not started with (ttl,
        queue limits, timeouts, health knobs, aliases) apply at once; argv and environment
        apply at the next start, which the daemon arranges (drain, stop, start) when they
        changed. `fresh_start`: the settings a failed start used are gone, so is its back-off."""
        if spec.name != self.model:
            raise ValueError(f"{self.name}: cannot take the spec of {spec.name}")
        self.spec = spec
        if backend is not None:
            self.backend = backend
        if fresh_start and self.state is State.FAILED:
            self.start_failures = 0
            self._retry_at = None
        self._log.info("instance.reconfigured", state=str(self.state), pid=self.pid)
        self._on_change()

    def wake_waiters(self) -> None:
        """This instance will serve no more (a new child took its name): requests blocked on
        its slots wake, find it not READY, give the slot back and go to the new one."""
        for _ in range(self.queued):
            self._slots.release()

    def _fit_slots(self) -> None:
        """At a start: a reload changed `parallel`, so the new child gets a new set of slots.
        Leases still out return to the old set (Lease keeps it); requests blocked on the old
        set are woken, find the model STARTING, give their slot back and wait for this start
        like everyone else."""
        if self._slots_size == self.spec.parallel:
            return
        old = self._slots
        self._slots = asyncio.Semaphore(self.spec.parallel)
        self._slots_size = self.spec.parallel
        for _ in range(self.queued):
            old.release()

    # -- stop ----------------------------------------------------------------------------------

    def begin_stop(self, reason: str, drain: float = 0.0,
                   cause: str = "other") -> asyncio.Task[None] | None:
        """Begin stopping; returns the stop task (None when already stopped).

        The state leaves READY before this returns, so no lease is handed out after the
        decision to stop, with no await in between (TTL, eviction and unload rely on that).
        The task belongs to the instance, not to the caller: a caller that is cancelled
        (client gone) stops waiting, the stop itself runs to STOPPED regardless.
        With `drain`, in-flight requests get that many seconds to finish first. `cause`: one
        of events.STOP_CAUSES (a metric's label); `reason` says it in words."""
        loop = asyncio.get_running_loop()
        if self._stop_task is not None and not self._stop_task.done():
            if drain <= 0 and self._drain_until > loop.time():
                self._drain_until = loop.time()  # a forced stop cuts a drain short
                self._state_changed.fire()
            return self._stop_task
        if self.state is State.STOPPED:
            return None
        if self.state is State.READY and drain > 0:
            self._drain_until = loop.time() + drain
            self._transition(State.DRAINING)
        else:
            self._drain_until = loop.time()
            self._transition(State.STOPPING)
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()  # delivered before the start task runs again
        self._log.info("instance.stop", reason=reason, pid=self.pid, drain=drain)
        self._events.publish("stop", model=self.model, instance=self.name, pid=self.pid,
                             reason=reason, cause=cause, drain=drain)
        self._stop_task = _owned_task(self._stop(), f"stop:{self.name}")
        return self._stop_task

    async def stop(self, reason: str, drain: float = 0.0, cause: str = "other") -> None:
        """Stop and wait until STOPPED (or until the caller is cancelled)."""
        task = self.begin_stop(reason, drain, cause)
        if task is not None:
            await asyncio.shield(task)

    async def _stop(self) -> None:
        loop = asyncio.get_running_loop()
        process = self.process
        try:
            while self.state is State.DRAINING and self.in_flight > 0:
                remaining = self._drain_until - loop.time()
                if remaining <= 0:
                    break
                await self.wait_change(min(remaining, 0.1))
            if self.state in (State.DRAINING, State.FAILED):
                self._transition(State.STOPPING)
            start = self._start_task
            if start is not None and not start.done():
                await asyncio.wait([start])  # it stops its own child on the way out
            self._cancel_watchdog()
            process = self.process
            if process is not None:
                await process.stop(self.spec.stop_grace)
        finally:
            # Whatever happened above, the stop ends here: group gone, state STOPPED.
            if process is not None:
                process.sweep_group()
            self._cancel_watchdog()
            if self._exit_task is not None:
                self._exit_task.cancel()
                self._exit_task = None
            self._marked_dead = False
            self._transition(State.STOPPED)

    def _cancel_watchdog(self) -> None:
        task = self._watchdog_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            self._watchdog_task = None

    @property
    def deployment(self) -> Deployment | None:
        """The RPC workers of the current child (None: not split over workers)."""
        process = self.process
        return process.deployment if isinstance(process, ProcessSet) else None

    def _rpc_state(self) -> dict[str, Any] | None:
        if not self.spec.rpc_workers:
            return None
        live = self.deployment if self.state in LOADED_STATES else None
        return {"workers": list(self.spec.rpc_workers),
                "split": list(self.spec.rpc_split) if self.spec.rpc_split else "auto",
                "deployed": live.describe() if live else None,
                "missing": list(live.missing) if live else []}

    def describe(self, now_mono: float | None = None) -> dict[str, Any]:
        now = now_mono or time.monotonic()
        idle = self.idle_seconds(now)
        ttl_left = None
        if self.state is State.READY and self.spec.ttl > 0 and not self.pinned:
            # In use, the clock has not started: it runs from the last release.
            ttl_left = self.spec.ttl if self.busy else max(0.0, self.spec.ttl - idle)
        backoff = self.backoff_left(now)
        return {
            "name": self.name,
            "replica_of": self.model if self.spec.replicas_max > 1 else None,
            "replica": self.replica,
            "backend": self.spec.backend,
            "model_path": self.spec.model_id or str(self.spec.model_path),
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
            "cache_type_k": self.started_with.cache_type_k,
            "cache_type_v": self.started_with.cache_type_v,
            # vLLM's share of each GPU it uses (None: not on a GPU, or vLLM's default)
            "gpu_memory_utilization": self.started_with.gpu_memory_utilization,
            # RPC workers with the layers each holds (None: not split over workers)
            "rpc": self._rpc_state(),
            "ttl": self.spec.ttl,
            "ttl_left": ttl_left,
            "pinned": self.pinned,
            "starts": self.starts,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "start_failures": self.start_failures,
            "retry_at": time.time() + backoff if backoff > 0 else None,
            "health": self.health.as_dict(),
        }


def _owned_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task the instance owns, run in a fresh context: started from inside a request, it
    must not carry that request's id (structlog contextvars) into every log line it and the
    tasks it creates (exit watch, watchdog, log reader) write for the child's whole life."""
    return asyncio.create_task(coro, name=name, context=contextvars.Context())


async def _stop_uncancellable(process: ChildProcess) -> None:
    """Stop `process` even though the calling task is being cancelled."""
    task = asyncio.ensure_future(process.stop(0))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        process.sweep_group()
        raise
