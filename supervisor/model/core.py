"""One configured model above its instances: replica 1 (named like the model), replicas 2..max,
the new child of a blue/green switch-over; the operator's wish; and the operations that take
time (an in-place restart, a switch-over, a KV step, bringing a pinned model back, starting
replicas), each a task the model owns. An unload wins over all of them: it cancels whatever
runs and stops every child, and nothing brings the model back until a request, a load or a
reload that pins it anew.

The model decides; what it needs of the daemon (room, the door, retiring a child) it asks
through its Host, so this package never imports the daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, Protocol

import structlog

from corral.supervisor.backends.base import Backend
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import StartBackoff, SupervisorError, Unloaded
from corral.supervisor.instance import LOADED_STATES, Instance, State
from corral.supervisor.model.overrides import Overrides
from corral.supervisor.model.state import REPLACES, ModelState, OperationRefused, Wish
from corral.supervisor.tasks import TaskScope

log = structlog.get_logger("corral.model")

# A pinned model whose start was refused (no room, the back-off of a failing child) tries
# again after this long, doubling up to the cap.
KEEP_UP_FIRST_S = 1.0
KEEP_UP_MAX_S = 30.0


class Host(Protocol):
    """What a model asks of the daemon."""

    @property
    def closing(self) -> bool: ...
    def drain_seconds(self) -> float: ...
    def configured(self, model: Model) -> bool: ...
    def new_instance(self, spec: ModelSpec, backend: Backend, replica: int) -> Instance: ...
    def retire(self, inst: Instance, why: str) -> None: ...
    def start_beside(self, model: Model, fresh: Instance, reason: str) -> bool: ...
    async def bring_up(self, model: Model, ignore_backoff: bool) -> None: ...
    async def start_member(self, model: Model, inst: Instance) -> None: ...
    def switched(self, model: Model) -> None: ...


class Operation:
    def __init__(self, kind: ModelState, task: asyncio.Task[None]):
        self.kind = kind
        self.task = task


class Model:
    def __init__(self, spec: ModelSpec, backend: Backend, host: Host):
        self._host = host
        self.primary = host.new_instance(spec, backend, 1)
        self.extra: list[Instance] = []  # replicas 2..max, not routable by name
        # Blue/green: the new child of a model whose settings changed, starting beside the
        # primary that still serves; it becomes the primary once ready.
        self.incoming: Instance | None = None
        self.kv_level = 0  # the KV ladder step the model runs at (0: its best)
        self.kept = False  # the policy keeps it loaded (the pin)
        self.down = False  # an unload asked: it stays stopped until a request or a load
        # An operator's load overrides, while that load runs: the starts it makes take them
        # (the planner reads them for the estimate and the start); none after it.
        self.overrides = Overrides()
        # How many times a reload's change overtook what was under way (call_off): a load
        # that saw it change while it waited ran the new config, not its overrides.
        self.called_off = 0
        self._waiting: str | None = None  # why a pinned model is not up yet
        self._op: Operation | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._filler: asyncio.Task[None] | None = None
        self._fill_target = 0
        self.tasks = TaskScope(f"model {spec.name}")

    # -- what it is ----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.primary.model

    @property
    def spec(self) -> ModelSpec:
        return self.primary.spec

    @property
    def members(self) -> list[Instance]:
        """The model's replicas, the one named like it first."""
        return [self.primary, *self.extra] if self.extra else [self.primary]

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.members)

    def member(self, key: str) -> Instance | None:
        return next((r for r in self.members if r.name == key), None)

    def holds(self, inst: Instance) -> bool:
        """Whether `inst` is one of the config's instances of this model now."""
        return inst is self.primary or inst in self.extra

    @property
    def waiting(self) -> str | None:
        """Why a pinned model is not up yet (admin shows it); None once it serves."""
        return None if self.primary.state is State.READY else self._waiting

    @waiting.setter
    def waiting(self, why: str | None) -> None:
        self._waiting = why

    @property
    def operation(self) -> ModelState | None:
        op = self._op
        return op.kind if op is not None and not op.task.done() else None

    @property
    def restarting(self) -> bool:
        """Stopped (or stopping) to start again: a reload's restart or a KV step."""
        return self.operation in (ModelState.RESTARTING, ModelState.STEPPING_KV)

    @property
    def stepping_kv(self) -> bool:
        return self.operation is ModelState.STEPPING_KV

    @property
    def wish(self) -> Wish:
        if self.down:
            return Wish.ABSENT
        if self.kept:
            return Wish.PINNED
        up = any(m.state in LOADED_STATES for m in self.members)
        return Wish.LOADED if up or self.operation is not None else Wish.ABSENT

    def instance_state(self) -> State:
        """Over its replicas: ready when any serves, starting while one starts."""
        states = {m.state for m in self.members}
        return State.READY if State.READY in states else \
            State.STARTING if State.STARTING in states else self.primary.state

    def state(self) -> ModelState:
        """The operation under way, or the model's state over its replicas."""
        op = self.operation
        if op is not None:
            return op
        states = {m.state for m in self.members}
        for state in (State.READY, State.STARTING, State.DRAINING, State.STOPPING):
            if state in states:
                return ModelState(str(state))
        return ModelState.FAILED if self.primary.state is State.FAILED else ModelState.STOPPED

    def describe(self) -> dict[str, Any]:
        return {"model_state": str(self.state()), "wish": str(self.wish),
                "waiting": self.waiting}

    def for_start(self, spec: ModelSpec) -> ModelSpec:
        """The spec a start of one of its children runs now: the config, with the overrides
        in force (start_overrides)."""
        return self.start_overrides().apply(spec)

    def start_overrides(self) -> Overrides:
        """The overrides a child started now takes: the load's under way; else those a
        sibling that starts or serves runs with, so one model's replicas never run different
        settings (a replica replaced, or added by autoscaling); else none. A child stopping
        does not count: a restart, a crash of the last child, a KV step run the config."""
        if self.overrides:
            return self.overrides
        for replica in self.members:
            if replica.state in (State.STARTING, State.READY) and replica.started_with.overrides:
                return Overrides(replica.started_with.overrides)
        return Overrides()

    @property
    def operation_task(self) -> asyncio.Task[None] | None:
        op = self._op
        return op.task if op is not None and not op.task.done() else None

    def up(self) -> list[Instance]:
        return [r for r in self.members if r.state in (State.STARTING, State.READY)]

    def least_busy(self) -> Instance | None:
        best: Instance | None = None
        for replica in self.members:
            if replica.state is State.READY and not replica.slots_full and (
                    best is None or replica.in_flight < best.in_flight):
                best = replica
        return best

    def everyone(self) -> list[Instance]:
        return [*self.members, *([self.incoming] if self.incoming is not None else [])]

    # -- the config ----------------------------------------------------------------------------

    def fit(self, drain: float, fresh_start: bool = False) -> None:
        """Give the model the replicas its spec asks for: new ones start cold; ones past
        replicas.max drain and stop (retired)."""
        spec, backend = self.primary.spec, self.primary.backend
        want = spec.replicas_max - 1
        for replica in self.extra[want:]:
            replica.begin_stop("replicas lowered by a reload", drain=drain, cause="scale_down")
            self._host.retire(replica, "scaled down")
        extra = self.extra[:want]
        for number in range(len(extra) + 2, want + 2):
            extra.append(self._host.new_instance(spec, backend, number))
        for replica in extra:
            if replica.spec is not spec:
                replica.reconfigure(spec, backend, fresh_start=fresh_start)
        self.extra = extra

    def mark_kept(self, kept: bool) -> None:
        """What the strategy keeps loaded: the model, and the replicas it loads with."""
        self.kept = kept
        for replica in self.members:
            replica.set_pinned(kept and replica.replica <= replica.spec.replicas_min)
        if not kept:
            self.waiting = None

    # -- wishes --------------------------------------------------------------------------------

    def want(self) -> None:
        """A request or a load names the model: an unload's 'stay down' ends."""
        self.down = False

    def pin_anew(self) -> None:
        """A reload pins the model: up it comes, even after an unload."""
        self.down = False
        self.keep_up()

    def unload(self, reason: str, drain: float, cause: str = "unload",
               ) -> list[asyncio.Task[None]]:
        """Stop every child and stay stopped: whatever restart, switch-over, KV step, replica
        start or pin keeping is under way is cancelled first (before any of it runs again), so
        nothing of it can start a child after this. Returns the stops to wait for."""
        self.down = True
        self.waiting = None
        self.tasks.cancel()
        self._op = None
        incoming, self.incoming = self.incoming, None
        if incoming is not None:
            incoming.begin_stop("its model was unloaded", cause=cause)
            self._host.retire(incoming, "its model was unloaded")
            self._adopt(incoming)
        stops = []
        for replica in self.members:
            task = replica.begin_stop(reason, drain=drain, cause=cause)
            replica.wake_waiters()  # requests queued for a slot are told now, not after the drain
            if task is not None:
                stops.append(task)
        return stops

    def forget(self) -> None:
        """Removed from the config: nothing of it runs on (its children are retired)."""
        self.down = True
        self.tasks.cancel()
        self._op = None

    # -- operations ----------------------------------------------------------------------------

    def _begin(self, kind: ModelState, work: Coroutine[Any, Any, None]) -> None:
        """Compare-and-swap on the operation under way: `kind` may replace it (REPLACES), and
        the one it replaces is cancelled now."""
        current = self.operation
        if kind not in REPLACES.get(current, frozenset()):
            work.close()
            raise OperationRefused(f"{self.name}: {kind} cannot begin while {current} runs")
        if self._op is not None:
            self._op.task.cancel()
        task = self.tasks.spawn(self._operate(work), f"{kind}:{self.name}")
        self._op = Operation(kind, task)

    async def _operate(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        finally:
            if self._op is not None and self._op.task is asyncio.current_task():
                self._op = None
                if not self._host.closing and not self.down:
                    self.keep_up()  # a pinned model refused a start: it tries again

    def call_off(self, why: str) -> None:
        """A newer config change overtakes the operation under way: it is cancelled now, and
        the new child of a switch-over stops (its room is free for what comes next). A load's
        overrides end too: the next start runs the new config (the load is told, not answered
        with settings it did not ask for); else they would mask what the reload changed."""
        self.overrides = Overrides()
        self.called_off += 1
        if self._op is not None:
            self._op.task.cancel()
            self._op = None
        incoming, self.incoming = self.incoming, None
        if incoming is not None:
            incoming.begin_stop(why, cause="reload")
            self._host.retire(incoming, "superseded")

    def restart(self, why: str, *, cause: str = "reload", start_after: bool = True,
                kind: ModelState = ModelState.RESTARTING) -> None:
        """Restart in place: every child drains and stops (new requests wait for the
        restart), then, when it was up (or is pinned), it starts again with the newest
        spec."""
        drain = self._host.drain_seconds()
        for replica in self.members:
            if replica.state in LOADED_STATES:
                replica.begin_stop(why, drain=drain, cause=cause)
        self._begin(kind, self._restart(start_after or self.kept))
        if self.incoming is not None:  # the switch-over just cancelled (its finally stops it)
            self._adopt(self.incoming)

    def _adopt(self, incoming: Instance) -> None:
        """A switch-over dropped by an unload or an admin restart (not by a newer config):
        its new child carried the config as it is now, so the child that stays takes those
        settings for its next start; else that start would run the config before the reload,
        and the reload would be undone."""
        if self._host.configured(self) and self.primary.spec is not incoming.spec:
            self.primary.reconfigure(incoming.spec, incoming.backend)

    async def _restart(self, start_after: bool) -> None:
        stops = [task for m in self.members if (task := m.stop_task) is not None]
        if stops:  # every stop under way, ours and any that began before
            await asyncio.wait(stops)
        if not start_after or self.down or self._host.closing \
                or not self._host.configured(self) or not self.primary.can_start:
            return
        try:
            await self._host.bring_up(self, True)
        except Unloaded:
            return
        except SupervisorError as exc:
            # Its next request tries again (a pinned one: its keeper); admin shows why.
            log.error("daemon.restart_failed", model=self.name, error=str(exc))
            if self.kept:
                self.waiting = f"restart refused: {exc}"

    def switch_over(self, spec: ModelSpec, backend: Backend, fields: tuple[str, ...],
                    kind: ModelState = ModelState.SWITCHING) -> bool:
        """Blue/green for a ready model whose child-affecting settings changed: the new child
        starts beside the old one (which keeps serving) when the host finds room for both
        without evicting anything; once it is ready (and still is), it takes the model's name
        and the old one drains. False (the caller restarts in place) for replicas, a model not
        serving now, or no room."""
        old = self.primary
        if old.spec.replicas_max > 1 or spec.replicas_max > 1 or old.state is not State.READY \
                or self._host.closing or kind not in REPLACES.get(self.operation, frozenset()):
            return False
        fresh = self._host.new_instance(spec, backend, 1)
        self.incoming = fresh  # seen by the strategy, as "<model> (new)"
        if not self._host.start_beside(self, fresh, "switch-over: " + ", ".join(fields)):
            self.incoming = None
            return False
        fresh.set_pinned(old.pinned)
        log.info("daemon.switch_over_started", model=self.name, old_pid=old.pid,
                 fields=list(fields))
        self._begin(kind, self._switch(old, fresh, fields))
        return True

    async def _switch(self, old: Instance, fresh: Instance, fields: tuple[str, ...]) -> None:
        promoted = False
        try:
            try:
                await fresh.wait_ready()
            except SupervisorError as exc:
                self._switch_failed(old, fresh, fields, str(exc))
                return
            if fresh.state is not State.READY:
                # It became ready and died (or was stopped) before it could take over: the
                # old child, still serving, stays.
                self._switch_failed(old, fresh, fields,
                                    fresh.last_error or f"the new child is {fresh.state}")
                return
            if self.incoming is not fresh or self.primary is not old \
                    or not self._host.configured(self) or self._host.closing:
                return  # superseded: the finally below retires it
            self.incoming = None
            fresh.touch(old.last_used)
            fresh.set_pinned(old.pinned)
            self.primary = fresh
            promoted = True
            old.begin_stop("replaced by its new child (config changed: " + ", ".join(fields)
                           + ")", drain=self._host.drain_seconds(), cause="reload")
            old.wake_waiters()  # requests queued on the old child go to the new one
            self._host.retire(old, "replaced by its new child")
            log.info("daemon.switched_over", model=self.name, old_pid=old.pid, pid=fresh.pid)
            self._host.switched(self)
        finally:
            if not promoted:
                # Failed, cancelled (an unload, a newer change, the shutdown) or superseded:
                # the new child does not outlive the switch-over.
                if self.incoming is fresh:
                    self.incoming = None
                fresh.begin_stop("superseded before it was switched in", cause="reload")
                self._host.retire(fresh, "superseded")

    def _switch_failed(self, old: Instance, fresh: Instance, fields: tuple[str, ...],
                       error: str) -> None:
        if self.incoming is fresh:
            self.incoming = None
        fresh.begin_stop("its switch-over failed", cause="reload")
        self._host.retire(fresh, "its switch-over failed")
        log.warning("daemon.switch_over_failed", model=self.name, error=error,
                    old_pid=old.pid, note="the previous child keeps serving")
        if self._host.configured(self) and self.primary is old:
            # Nothing fails: the old child goes on serving. It takes the new settings, so its
            # next start uses them (and shows their failure); admin shows why now.
            old.reconfigure(fresh.spec, fresh.backend)
            old.last_error = (f"the new settings ({', '.join(fields)}) failed to start: "
                              f"{error}; the previous child keeps serving")

    # -- keeping up ----------------------------------------------------------------------------

    def keep_up(self) -> None:
        """A pinned model that is down comes back: one keeper task tries until it runs,
        waiting out a failed child's back-off and, when a start is refused (no room), trying
        again later with back-off; admin shows why it waits (`waiting`)."""
        if not self.kept or self.down or self._host.closing or self.operation is not None \
                or (self._keeper is not None and not self._keeper.done()):
            return
        if any(m.state in (State.STARTING, State.READY) for m in self.members):
            return
        self._keeper = self.tasks.spawn(self._keep_up(), f"keep-up:{self.name}")

    async def _keep_up(self) -> None:
        delay = KEEP_UP_FIRST_S
        if self.primary.state is State.FAILED:
            log.info("daemon.restart_kept", model=self.name, error=self.primary.last_error)
        while self.kept and not self.down and not self._host.closing \
                and self._host.configured(self):
            if self.primary.state is State.READY or self.operation is not None:
                self.waiting = None
                return
            try:
                await self._host.bring_up(self, False)
            except Unloaded:
                return
            except StartBackoff as exc:
                wait = exc.retry_after or KEEP_UP_FIRST_S
                self.waiting = f"its last start failed; next try in {wait:.1f}s"
                await asyncio.sleep(wait)
                continue
            except SupervisorError as exc:
                self.waiting = f"start refused: {exc}; next try in {delay:g}s"
                log.warning("daemon.keep_up_refused", model=self.name, error=str(exc),
                            retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, KEEP_UP_MAX_S)
                continue
            self.waiting = None
            return

    # -- replicas ------------------------------------------------------------------------------

    def fill(self, target: int) -> asyncio.Task[None] | None:
        """Run at least `target` replicas (up to replicas.max): one task starts them one after
        another, each through the door (room made, evictions waited for); it ends when they
        run or a start is refused (logged: the next request asks again)."""
        target = min(target, self.spec.replicas_max)
        self._fill_target = max(self._fill_target, target)
        if self._filler is not None and not self._filler.done():
            return self._filler
        if len(self.up()) >= target or self._host.closing:
            return None
        self._filler = self.tasks.spawn(self._fill(), f"replicas:{self.name}")
        return self._filler

    async def _fill(self) -> None:
        try:
            while len(self.up()) < self._fill_target and not self.down:
                replica = next((r for r in self.members if r.can_start
                                and r.backoff_left() <= 0), None)
                if replica is None:
                    return
                try:
                    await self._host.start_member(self, replica)
                except SupervisorError as exc:
                    log.warning("daemon.scale_up_refused", model=self.name,
                                replica=replica.replica, error=str(exc))
                    return
                log.info("daemon.scaled_up", model=self.name, replica=replica.replica,
                         queued=self.primary.queued)
        finally:
            self._fill_target = 0
