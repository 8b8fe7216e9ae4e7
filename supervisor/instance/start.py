"""Starting an instance: one start task every waiter shares; it returns a healthy child or
ends FAILED with the reason (whatever the error), never between states."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp

from corral.supervisor.backends.base import BinaryNotFound
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import StartFailed, StartTimedOut, WorkersUnavailable
from corral.supervisor.instance.state import STARTABLE, Health, IllegalTransition
from corral.supervisor.memory.estimate import EstimateError
from corral.supervisor.port import State
from corral.supervisor.process import (
    ChildExited,
    ChildProcess,
    ChildStartTimeout,
    free_port,
    port_open,
    probe_health,
    probe_lists_model,
)
from corral.supervisor.rpc.deploy import Deployment, ProcessSet
from corral.supervisor.rpc.workers import RpcError

if TYPE_CHECKING:
    from corral.supervisor.instance.core import Instance


def backoff_left(self: Instance, now: float | None = None) -> float:
    """Seconds before a failed model may be started again (0: now)."""
    if self.state is not State.FAILED or self._retry_at is None:
        return 0.0
    return max(0.0, self._retry_at - (now or time.monotonic()))

def begin_start(self: Instance, session: aiohttp.ClientSession,
                on_spawn: Callable[[Instance], None],
                kv_cache: tuple[str | None, str | None] | None = None,
                tune: Callable[[ModelSpec], ModelSpec] | None = None,
                reason: str = "demand") -> None:
    """STOPPED|FAILED → STARTING and launch the one start task every waiter shares.
    Refused (IllegalTransition) while a stop is pending: a start under a running stop is
    how an unload used to be undone. `kv_cache`: KV cache types the strategy chose for this
    start (None: as configured); `tune`: the backend's settings for this start from those
    (a vLLM GPU share); `reason`: why it starts (a request's demand, a reload)."""
    from corral.supervisor.instance.core import owned_task

    if self.stop_pending:
        raise IllegalTransition(f"{self.name}: a start was asked while its stop runs")
    if self.state not in STARTABLE:
        raise IllegalTransition(f"{self.name}: cannot start from {self.state}")
    started_with = self.spec
    if kv_cache is not None:
        started_with = dataclasses.replace(
            self.spec, cache_type_k=kv_cache[0] or self.spec.cache_type_k,
            cache_type_v=kv_cache[1] or self.spec.cache_type_v)
    if tune is not None:
        started_with = tune(started_with)
    if started_with.prompt_cache and self._prompt_cache is not None:
        started_with = dataclasses.replace(started_with,
                                           slot_save_path=self._prompt_cache.store.dir)
    self.started_with = started_with
    self.prompt_slots = None
    restart = self.state is State.FAILED
    if restart:
        self.restarts += 1
    self._swap(STARTABLE, State.STARTING)
    self._fit_slots()
    self.starts += 1
    self.served = 0
    self._session = session
    self._events.publish("load", model=self.model, instance=self.name, reason=reason,
                         restart=restart)
    self._start_task = owned_task(self._start(session, on_spawn), f"start:{self.name}")

async def wait_ready(self: Instance) -> None:
    """Wait for the shared start to finish; raises its StartFailed for every waiter."""
    task = self._start_task
    if task is None:
        return
    # Shield: one impatient client hanging up must not cancel the start for the others.
    await asyncio.shield(task)

async def _start(self: Instance, session: aiohttp.ClientSession,
                 on_spawn: Callable[[Instance], None]) -> None:
    began = time.monotonic()
    if not self.backend.spawns:
        _connect_remote(self, began)
        return
    progress = asyncio.create_task(self._report_progress(began), name=f"load:{self.name}")
    try:
        try:
            process = await self._spawn_and_wait(session, on_spawn, last_try=False)
            if process is None:  # someone took its port before the child bound it
                process = await self._spawn_and_wait(session, on_spawn, last_try=True)
        except (StartFailed, asyncio.CancelledError):
            raise
        except Exception as exc:
            # Any error at all ends the start FAILED with the reason, counted for the back-off.
            # A model file that cannot be read or parsed, a peer's odd answer: said plainly; any
            # other error is a bug in corral, logged with its traceback.
            if isinstance(exc, (OSError, ValueError, EstimateError)):
                self._log.warning("instance.start_error", pid=self.pid,
                                  error=f"{type(exc).__name__}: {exc}")
            else:
                self._log.exception("instance.start_crashed", pid=self.pid)
            await self._stop_own_child()
            message = f"{self.name}: start failed: {type(exc).__name__}: {exc}"
            self._fail_start(message)
            raise StartFailed(message) from exc
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
    cache, spec = self._prompt_cache, self.started_with
    if cache is not None and spec.slot_save_path is not None:
        self.prompt_slots = cache.slots(
            model=self.model, instance=self.name, spec=spec, binary=process.argv[0],
            base_url=f"http://127.0.0.1:{self.port}", headers=self._headers, session=session)
    self._swap(State.STARTING, State.READY)
    self._watch(session, process)

def _connect_remote(self: Instance, began: float) -> None:
    """A remote has nothing to start: its leases point at its URL with its key. Whether it
    answers is what its requests find (Health), not a gate here: a probe would cost every
    cold request a round trip and still say nothing of the next one."""
    spec = self.started_with
    assert spec.url is not None  # checks/backends.py requires it
    self._base_url = spec.url
    self._headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    self.port = None
    self._events.publish("loaded", model=self.model, instance=self.name, pid=None,
                         port=None, seconds=round(time.monotonic() - began, 3))
    self.last_error = None
    self.start_failures = 0
    self._retry_at = None
    self.health = Health()
    self._swap(State.STARTING, State.READY)

async def _stop_own_child(self: Instance) -> None:
    process = self.process
    if process is not None and process.pid is not None:
        await stop_uncancellable(process)

async def _report_progress(self: Instance, began: float, every: float = 1.0) -> None:
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

def _note_start_failure(self: Instance) -> None:
    self.start_failures += 1
    base = self.spec.start_backoff
    if base <= 0:
        self._retry_at = None
        return
    delay = min(base * 2 ** (self.start_failures - 1), self.spec.start_backoff_max)
    self._retry_at = time.monotonic() + delay
    self._log.warning("instance.start_backoff", failures=self.start_failures,
                      retry_in=round(delay, 3))

def _fail_start(self: Instance, message: str) -> None:
    if self.state is State.STARTING:  # a stop may have taken over meanwhile
        self._swap(State.STARTING, State.FAILED, message)

async def _spawn_and_wait(self: Instance, session: aiohttp.ClientSession,
                          on_spawn: Callable[[Instance], None],
                          last_try: bool) -> ChildProcess | None:
    """One start attempt: the healthy child, or None when it lost its port (retry)."""
    self.port = free_port()
    self._base_url = f"http://127.0.0.1:{self.port}"
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
    process = ChildProcess(self.name, argv, env, keeper=self._keeper,
                           stop_signal=signal.Signals[self.started_with.stop_signal]) \
        if deployment is None else \
        ProcessSet(self.name, argv, env, deployment, keeper=self._keeper)
    self.process = process
    # A reader following the model's log (GET /admin/models/<m>/logs?follow=1) moves on to
    # this child's lines as it starts, not once it is ready.
    self._on_change()
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
        await stop_uncancellable(process)
        raise
    try:
        on_spawn(self)
        await process.wait_healthy(self._readiness(session), self.spec.start_timeout)
    except ChildExited as exc:
        await stop_uncancellable(process)
        if not last_try and self.backend.lost_port_race(exc.tail):
            self._log.warning("instance.port_taken", port=self.port, pid=process.pid)
            return None
        self._fail_start(str(exc))
        raise StartFailed(str(exc), exc.tail) from exc
    except ChildStartTimeout as exc:
        # Killed first, failed after: a request in between must not find the model
        # FAILED (and restart it at once, beside a child still running).
        await stop_uncancellable(process)
        message = f"{exc}; stopped it"
        self._fail_start(message)
        raise StartTimedOut(message, exc.tail) from exc
    except asyncio.CancelledError:
        # Stopped (unload, eviction, shutdown) mid-start: the child must not outlive it.
        await stop_uncancellable(process)
        raise
    except Exception as exc:
        # Bookkeeping around the child failed (e.g. the state file): a child nobody
        # tracks must not keep running.
        self._log.exception("instance.start_bookkeeping_failed", pid=process.pid)
        await stop_uncancellable(process)
        message = f"{self.name}: start aborted: {type(exc).__name__}: {exc}"
        self._fail_start(message)
        raise StartFailed(message) from exc
    return process

async def _deploy(self: Instance) -> Deployment:
    """Start the model's RPC workers and plan its split; the head's argv takes both.
    On any failure (cancellation included) no worker is left running."""
    if self._deployer is None:
        message = f"{self.name}: no RPC deployer (models split over workers need the daemon)"
        self._fail_start(message)
        raise StartFailed(message)
    try:
        deployment = await self._deployer.deploy(self.started_with, self.spec.start_timeout,
                                                 avoid_ports={self.port or 0})
    except RpcError as exc:
        # The worker's output and the peer's answer: for the admin view, not the client.
        self._fail_start(exc.for_operators())
        raise WorkersUnavailable(str(exc), exc.tail) from exc
    except BinaryNotFound as exc:
        self._fail_start(str(exc))
        raise WorkersUnavailable(str(exc)) from exc
    self.started_with = dataclasses.replace(
        self.started_with, rpc_servers=deployment.endpoints,
        tensor_split=deployment.plan.layers)
    return deployment

def _readiness(self: Instance, session: aiohttp.ClientSession,
               ) -> Callable[[float], Awaitable[bool]]:
    """The start's readiness probe: /health answers 200 and, for a backend that answers
    it early (vLLM), /v1/models lists the model's name. A command child polls its own
    `health` path, or with `health: none` waits for its port to accept connections."""
    base = f"http://127.0.0.1:{self.port}"
    path = self.started_with.health_path if self.backend.kind == "command" \
        else self.backend.health_path
    health, headers, lists_models = base + (path or ""), self._headers, \
        self.backend.lists_models
    port = self.port or 0

    async def ready(timeout: float) -> bool:
        if path is None:
            return await port_open(port, timeout)
        if await probe_health(session, health, timeout) is not None:
            return False
        return not lists_models or await probe_lists_model(
            session, base + "/v1/models", self.spec.name, headers, timeout)

    return ready


async def stop_uncancellable(process: ChildProcess) -> None:
    """Stop `process` even though the calling task is being cancelled."""
    task = asyncio.ensure_future(process.stop(0))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        process.sweep_group()
        raise
