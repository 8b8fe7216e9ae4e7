"""One schedulable unit: its state machine (compare-and-swap), its start and stop, slots and
leases.

The work around a child is done by objects of their own, each made for one child: a Launch
(instance/launch.py) spawns it and waits for it to be ready, a ChildWatch (instance/watch.py)
watches its exit and health. They report; the instance alone changes its state. The admin
view of an instance is the read model's (instance/view.py), which this module never imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import os
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any

import aiohttp
import structlog

from corral.supervisor.backends.base import Backend
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import StartFailed
from corral.supervisor.events import EventBus
from corral.supervisor.instance.launch import Attached, Launch, health_path, stop_uncancellable
from corral.supervisor.instance.state import (
    STARTABLE,
    TRANSITIONS,
    Backoff,
    Changed,
    Health,
    IllegalTransition,
)
from corral.supervisor.instance.watch import ChildWatch
from corral.supervisor.port import Broken, Lease, State
from corral.supervisor.process import ChildProcess
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.prompt_cache.slots import Slots
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.deploy import Deployment, ProcessSet, RpcDeployer


class Instance:
    def __init__(self, spec: ModelSpec, backend: Backend, on_change: Callable[[], None],
                 replica: int = 1, keeper: GroupKeeper | None = None,
                 deployer: RpcDeployer | None = None, events: EventBus | None = None,
                 prompt_cache: PromptCache | None = None):
        self.spec = spec
        self._prompt_cache = prompt_cache
        # The current child's slots as the prompt cache tracks them (None: cache off for it).
        self.prompt_slots: Slots | None = None
        # corral's shutdown: when this child's SIGKILL must have gone out (None: no bound
        # but save_timeout and stop_grace).
        self._kill_by: float | None = None
        self._events = events or EventBus()
        self._keeper = keeper
        self._deployer = deployer  # for models split over RPC workers
        # A model with `replicas` runs several instances: replica 1 is named like the model,
        # the others "<model>#<n>". Each is a state machine of its own.
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
        self.held = 0  # groups running with this model as a member
        self.pinned = False  # kept loaded by the policy
        self.last_used = time.monotonic()
        self.restarts = 0
        self.starts = 0
        self.served = 0  # requests the current child has answered
        self.unloads = 0  # unloads begun: a request queued before one is told, not served
        self.last_error: str | None = None
        self.health = Health()
        self.backoff = Backoff()  # consecutive failed starts, and when the next may begin
        self._headers: dict[str, str] = {}
        self._base_url = ""  # where leases send requests: the child's port, or a remote's URL
        # Leases whose request broke (report_broken): a remote's health counts the others as
        # answered when they come back.
        self._broken_leases: set[int] = set()
        self._slots = asyncio.Semaphore(spec.parallel)
        self._slots_size = spec.parallel
        self._session: aiohttp.ClientSession | None = None
        self._start_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._watch: ChildWatch | None = None  # the current child's exit and health watch
        self._drain_until = 0.0
        # The child a request saw die (mark_if_dead), before the exit watcher ran: the mark
        # is that child's, not the instance's (a later child's stop must not take it).
        self._dead_pid: int | None = None
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
        return max(0, self._slots_size - self.in_flight)

    @property
    def stop_pending(self) -> bool:
        return self._stop_task is not None and not self._stop_task.done()

    @property
    def stop_task(self) -> asyncio.Task[None] | None:
        """The stop under way, to wait for (None: none)."""
        task = self._stop_task
        return task if task is not None and not task.done() else None

    @property
    def can_start(self) -> bool:
        """Whether a start may begin now: from STOPPED or FAILED, and never under a stop."""
        return self.state in STARTABLE and not self.stop_pending

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

    @property
    def deployment(self) -> Deployment | None:
        """The RPC workers of the current child (None: not split over workers)."""
        process = self.process
        return process.deployment if isinstance(process, ProcessSet) else None

    def idle_seconds(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.last_used

    def child_alive(self) -> bool:
        return self.process is not None and self.process.alive()

    # -- what others may change: through these, never by writing fields --------------------------

    def queue_enter(self) -> None:
        self.queued += 1

    def queue_leave(self) -> None:
        self.queued -= 1

    def hold(self) -> None:
        self.held += 1

    def unhold(self) -> None:
        self.held -= 1
        self._on_change()

    def set_pinned(self, pinned: bool) -> None:
        self.pinned = pinned

    def touch(self, at: float | None = None) -> None:
        """Count as used now (or at `at`, monotonic): the TTL clock restarts."""
        self.last_used = time.monotonic() if at is None else at

    # -- state machine -------------------------------------------------------------------------

    def _swap(self, expected: State | Collection[State], new: State,
              error: str | None = None) -> None:
        """Compare-and-swap: from a state the caller expects to `new`, or IllegalTransition."""
        allowed = (expected,) if isinstance(expected, State) else expected
        if self.state not in allowed:
            raise IllegalTransition(f"{self.name}: expected state mismatch: {self.state} is "
                                    f"not {'/'.join(map(str, allowed))} (wanted {new})")
        if new not in TRANSITIONS[self.state]:
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

    def _noted(self, message: str) -> None:
        """Something happened that the state does not show (a stop owns the ending)."""
        self.last_error = message
        self._state_changed.fire()
        self._on_change()

    # -- slots and leases ----------------------------------------------------------------------

    async def take_slot(self, timeout: float) -> Lease:
        """Wait for one of the `parallel` slots; the caller has checked the state is READY."""
        slots = self._slots
        if slots.locked():
            # asyncio.timeout: wait_for on Python 3.11 can lose a slot won as it times out.
            async with asyncio.timeout(timeout):
                await slots.acquire()
        else:
            await slots.acquire()  # free slot: no timer task on the hot path
        self.in_flight += 1
        self.last_used = time.monotonic()
        spec = self.spec
        return Lease(self, model=self.model, instance=self.name, pid=self.pid,
                     base_url=self._base_url, headers=self._headers,
                     served_name=spec.served_name,
                     first_byte_timeout=spec.first_byte_timeout,
                     idle_timeout=spec.idle_timeout, ready_since=self.since, slots=slots,
                     prompt_slots=self.prompt_slots,
                     salts=self._prompt_cache.salts
                     if spec.backend == "vllm" and self._prompt_cache is not None else None)

    def _give_back(self, lease: Lease) -> None:
        self.in_flight -= 1
        self.served += 1
        self.last_used = time.monotonic()
        (lease._slots or self._slots).release()
        broke = id(lease) in self._broken_leases
        self._broken_leases.discard(id(lease))
        if not self.backend.spawns and not broke:
            self.health = self.health.answered(time.time())
        if self.state is State.DRAINING:
            self._state_changed.fire()  # the drain waits for its last request on this
        self._on_change()

    def _child_alive(self, lease: Lease) -> bool:
        if not self.backend.spawns:
            return True  # a remote has no process of ours (the relay never resends to one)
        return lease.pid == self.pid and self.child_alive()

    async def _broken(self, lease: Lease, timed_out: bool) -> Broken:
        if not self.backend.spawns:
            # A remote that failed a request: its health says so (state stays ready: the next
            # request tries it again, and a group falls back now).
            self._broken_leases.add(id(lease))
            error = "timed out" if timed_out else "request failed"
            self.health = self.health.failed(time.time(), error)
            self._noted(f"{self.spec.url}: {error}")
            return Broken(unresponsive=False, detail=self.last_error)
        watch = self._watch
        if lease.pid == self.pid:
            self.mark_if_dead()
            if watch is not None:
                await watch.settle(0.5)
                if timed_out and lease.pid == self.pid and self.child_alive():
                    await watch.probe_now()
        unresponsive = watch is not None and watch.unresponsive \
            and lease.pid == watch.process.pid
        return Broken(unresponsive=unresponsive, detail=self.last_error)

    def wake_waiters(self, parallel: int | None = None) -> None:
        """The child serves no more (unloaded, replaced, removed), or a start changed
        `parallel`: requests blocked on its slots wake, find it not READY, give the slot back
        and go on; the next child gets a fresh set (leases still out return to the old one)."""
        old, self._slots = self._slots, asyncio.Semaphore(parallel or self._slots_size)
        self._slots_size = parallel or self._slots_size  # an admin load may set it
        for _ in range(self.queued):
            old.release()

    def _fit_slots(self) -> None:
        if self._slots_size != self.started_with.parallel:  # a reload or a load changed it
            self.wake_waiters(self.started_with.parallel)

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
            self.backoff.reset()
        self._log.info("instance.reconfigured", state=str(self.state), pid=self.pid)
        self._on_change()

    # -- stop ----------------------------------------------------------------------------------

    def begin_stop(self, reason: str, drain: float = 0.0,
                   cause: str = "other") -> asyncio.Task[None] | None:
        """Begin stopping; returns the stop task (None when already stopped).

        The state leaves READY before this returns, so no lease is handed out after the
        decision to stop, with no await in between (TTL, eviction and unload rely on that), and
        no start can begin until the stop has ended (`can_start`). The task belongs to the
        instance: a caller that is cancelled stops waiting, the stop runs to STOPPED regardless.
        With `drain`, in-flight requests get that many seconds to finish first. `cause`: one of
        events.STOP_CAUSES (a metric's label); `reason` says it in words."""
        loop = asyncio.get_running_loop()
        if cause == "unload":
            self.unloads += 1  # requests queued before this are told, not served
        if self.stop_pending:
            assert self._stop_task is not None
            if drain <= 0 and self._drain_until > loop.time():
                self._drain_until = loop.time()  # a forced stop cuts a drain short
                self._state_changed.fire()
            return self._stop_task
        if self.state is State.STOPPED:
            return None
        if self.state is State.READY and drain > 0:
            self._drain_until = loop.time() + drain
            self._swap(State.READY, State.DRAINING)
        else:
            self._drain_until = loop.time()
            self._swap((State.STARTING, State.READY, State.FAILED), State.STOPPING)
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()  # delivered before the start task runs again
        self._log.info("instance.stop", reason=reason, pid=self.pid, drain=drain)
        self._events.publish("stop", model=self.model, instance=self.name, pid=self.pid,
                             reason=reason, cause=cause, drain=drain)
        self._stop_task = owned_task(self._stop(), f"stop:{self.name}")
        return self._stop_task

    def when_stopped(self, callback: Callable[[], None]) -> bool:
        """Call `callback` once the pending stop has ended; False (never called) when no stop
        is pending."""
        task = self._stop_task
        if task is None or task.done():
            return False
        task.add_done_callback(lambda _task: callback())
        return True

    async def stop(self, reason: str, drain: float = 0.0, cause: str = "other",
                   kill_by: float | None = None) -> None:
        """Stop and wait until STOPPED (or until the caller is cancelled). `kill_by` (the
        loop's clock; corral's shutdown budget): the saves and stop_grace are cut short so
        that the SIGKILL goes out by then."""
        if kill_by is not None:
            self._kill_by = kill_by  # read by the stop task, which may be running already
        task = self.begin_stop(reason, drain, cause)
        if task is not None:
            await asyncio.shield(task)

    def _grace(self) -> float:
        """stop_grace, or what is left before `_kill_by`."""
        if self._kill_by is None:
            return self.spec.stop_grace
        left = self._kill_by - asyncio.get_running_loop().time()
        return max(0.0, min(self.spec.stop_grace, left))

    async def _stop(self) -> None:
        loop = asyncio.get_running_loop()
        process = self.process
        try:
            # Each request given back and the child's exit fire a change: no polling.
            while self.state is State.DRAINING and self.in_flight > 0 and self.child_alive():
                remaining = self._drain_until - loop.time()
                if remaining <= 0:
                    break
                await self.wait_change(remaining)
            if self.state is State.DRAINING:
                self._swap(State.DRAINING, State.STOPPING)
            start = self._start_task
            if start is not None and not start.done():
                await asyncio.wait([start])  # it stops its own child on the way out
            watch = self._watch
            if watch is not None:
                watch.stop_watchdog()
            # No start can have begun since this stop did: this is the child it was for.
            process = self.process
            slots, self.prompt_slots = self.prompt_slots, None
            # Not from a child that stopped answering or that a request saw die (its slots
            # would cost the whole save_timeout, and the stop waits on them).
            if slots is not None and process is not None and process.alive() \
                    and self._dead_pid != process.pid and self.health.failures == 0 \
                    and not (watch is not None and watch.unresponsive
                             and watch.process is process):
                await slots.save_all(self._kill_by)  # bounded by save_timeout; never raises
            if slots is not None:
                slots.close()  # no idle save of a child that goes
            if process is not None:
                await process.stop(self._grace())
                if process.alive():
                    self.last_error = (
                        f"{self.name} (pid {process.pid}) did not exit within "
                        f"{process.kill_wait:g}s of SIGKILL (uninterruptible sleep?); corral "
                        f"stopped waiting for it")
        finally:
            # Whatever happened above, the stop ends here: group gone, state STOPPED. A
            # sweep never raises (process.py): nothing here can keep it from STOPPED.
            try:
                if process is not None:
                    process.sweep_group()
            except Exception:
                self._log.exception("instance.sweep_failed", pid=process.pid if process else None)
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            if self.state is State.DRAINING:  # cancelled mid-drain (shutdown)
                self._swap(State.DRAINING, State.STOPPING)
            self._swap(State.STOPPING, State.STOPPED)

    # -- start ---------------------------------------------------------------------------------

    def backoff_left(self, now: float | None = None) -> float:
        """Seconds before a failed model may be started again (0: now)."""
        if self.state is not State.FAILED:
            return 0.0
        return self.backoff.left(now or time.monotonic())

    @property
    def start_failures(self) -> int:
        return self.backoff.failures

    def begin_start(self, session: aiohttp.ClientSession,
                    on_spawn: Callable[[Instance], None],
                    kv_cache: tuple[str | None, str | None] | None = None,
                    tune: Callable[[ModelSpec], ModelSpec] | None = None,
                    reason: str = "demand") -> None:
        """STOPPED|FAILED → STARTING and launch the one start task every waiter shares.
        Refused (IllegalTransition) while a stop is pending: a start under a running stop is
        how an unload used to be undone. `kv_cache`: KV cache types the strategy chose for
        this start (None: as configured); `tune`: the backend's settings for this start from
        those (a vLLM GPU share); `reason`: why it starts (a request's demand, a reload)."""
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
        if self.prompt_slots is not None:
            self.prompt_slots.close()  # a child that died: its slots are no one's to save
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
        if not self.backend.spawns:
            self._connect_remote(began)
            return
        cache = self._prompt_cache
        launch = Launch(self.name, self.started_with, self.backend, model=self.model,
                        start_timeout=self.spec.start_timeout, session=session,
                        keeper=self._keeper, deployer=self._deployer, events=self._events,
                        attach=self._attach, on_spawn=lambda: on_spawn(self), log=self._log,
                        identify=cache.setup if cache is not None
                        and self.started_with.slot_save_path is not None else None)
        try:
            process = await launch.run(lambda: self.state is State.STARTING)
        except StartFailed as exc:
            if self.state is State.STARTING:  # not when a stop took over mid-start
                self._swap(State.STARTING, State.FAILED, exc.for_operators or str(exc))
                delay = self.backoff.failed(self.spec.start_backoff,
                                            self.spec.start_backoff_max, time.monotonic())
                if delay is not None:
                    self._log.warning("instance.start_backoff", failures=self.backoff.failures,
                                      retry_in=round(delay, 3))
                self._events.publish("load_failed", model=self.model, instance=self.name,
                                     seconds=round(time.monotonic() - began, 3),
                                     error=str(exc))
            raise
        if self.state is not State.STARTING:  # a stop took over as it became ready
            await stop_uncancellable(process)
            return
        self._events.publish("loaded", model=self.model, instance=self.name, pid=process.pid,
                             port=self.port, seconds=round(time.monotonic() - began, 3))
        self.last_error = None
        self.backoff.reset()
        self.health = Health()
        self._dead_pid = None
        spec = self.started_with
        if cache is not None and (setup := launch.current_setup()) is not None:
            self.prompt_slots = cache.slots(
                model=self.model, instance=self.name, spec=spec, setup=setup,
                base_url=f"http://127.0.0.1:{self.port}", headers=self._headers,
                session=session, busy=lambda: self.in_flight > 0, live=lambda: self.spec)
        self._swap(State.STARTING, State.READY)
        self._watch = ChildWatch(
            self.name, process, session, port=self.port or 0,
            health_path=health_path(self.started_with, self.backend),
            settings=lambda: self.spec, health=self.health,
            serving=lambda: self.process is process and self.state in (State.READY,
                                                                       State.DRAINING),
            on_exit=self._child_exited, on_unresponsive=self._child_unresponsive,
            log=self._log)
        self._watch.start()

    def _attach(self, child: Attached) -> None:
        self.process, self.port = child.process, child.port
        self._base_url, self._headers = child.base_url, child.headers
        self.started_with = child.spec
        self._on_change()

    def _connect_remote(self, began: float) -> None:
        """A remote has nothing to start: its leases point at its URL with its key. Whether
        it answers is what its requests find (Health), not a gate here: a probe would cost
        every cold request a round trip and still say nothing of the next one."""
        spec = self.started_with
        assert spec.url is not None  # checks/backends.py requires it
        self._base_url = spec.url
        self._headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.port = None
        self._events.publish("loaded", model=self.model, instance=self.name, pid=None,
                             port=None, seconds=round(time.monotonic() - began, 3))
        self.last_error = None
        self.backoff.reset()
        self.health = Health()
        self._swap(State.STARTING, State.READY)

    # -- what the watch reports ------------------------------------------------------------------

    def _child_exited(self, process: ChildProcess, code: int, message: str) -> None:
        if self.process is not process:
            return
        if self.state is State.READY:
            self._swap(State.READY, State.FAILED, message)
        elif self.state is State.DRAINING or (self.state is State.FAILED
                                              and self._dead_pid == process.pid):
            # Draining: the stop under way owns the ending (STOPPED, not FAILED: no restart
            # may begin under it). Marked dead: the exit code says more than "gone".
            self._noted(message)

    def _child_unresponsive(self, process: ChildProcess, message: str) -> None:
        if self.process is not process:
            return
        if self.state is State.READY:
            self._swap(State.READY, State.FAILED, message)
        else:
            self._noted(message)

    def mark_if_dead(self) -> None:
        """A request saw the child break: if it is gone, fail the instance now, before the
        exit watcher runs, so no other request is handed its port."""
        if self.child_alive():
            return
        message = f"{self.name} (pid {self.pid}) died while serving"
        if self.state is State.READY:
            self._dead_pid = self.pid
            self._swap(State.READY, State.FAILED, message)
        elif self.state is State.DRAINING:
            self._noted(message)  # the drain ends now; its stop goes on to STOPPED


def owned_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task the instance owns, run in a fresh context: started from inside a request, it
    must not carry that request's id (structlog contextvars) into every log line it and the
    tasks it creates (exit watch, watchdog, log reader) write for the child's whole life."""
    return asyncio.create_task(coro, name=name, context=contextvars.Context())
