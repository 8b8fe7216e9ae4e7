"""The door: acquire() leases a ready child of a model, starting it (and making room) when
needed. Every wait is bounded by the model's queue_timeout, counted from the door."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from corral.supervisor import policy
from corral.supervisor.daemon.replicas import ReplicaSet
from corral.supervisor.errors import (
    NoCapacity,
    NotServed,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    StartBackoff,
    SupervisorError,
    UnknownModel,
    Unloaded,
)
from corral.supervisor.instance import Instance, State
from corral.supervisor.port import Lease

if TYPE_CHECKING:
    from corral.supervisor.daemon.core import Daemon

log = structlog.get_logger("corral.daemon")


async def acquire(self: Daemon, name: str, *, ignore_backoff: bool = False) -> Lease:
    """Lease a ready instance of `name`, starting it (and evicting others) if needed."""
    if self._closing:
        raise ShuttingDown("corral is shutting down")
    rs = self.replica_set(name)
    inst = rs.primary
    if inst.state is State.READY and not inst.slots_full and inst.spec.replicas_max == 1:
        return await inst.take_slot(inst.spec.queue_timeout)  # the hot path: no waiting
    if inst.spec.replicas_max > 1:
        return await self._acquire_replica(rs, ignore_backoff)
    # Bounded in every state: a cold, starting or draining model queues no more than a
    # ready one would (its free slots plus max_queue).
    if inst.queued >= inst.spec.max_queue + inst.free_slots:
        raise QueueFull(f"{inst.name}: {inst.in_flight} in flight and {inst.queued} queued "
                        f"(max_queue {inst.spec.max_queue}, state {inst.state})")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + inst.spec.queue_timeout
    unloads = inst.unloads
    inst.queue_enter()
    try:
        while True:
            current = self.models.get(inst.model)
            if current is not None and current.primary is not inst:
                # A reload switched the model to a new child (blue/green) while we
                # queued: wait for that one instead.
                inst.queue_leave()
                inst = current.primary
                unloads = inst.unloads
                inst.queue_enter()
            _refuse_if_unloaded(inst, unloads)
            await self._ensure_ready(inst, deadline, ignore_backoff)
            if not self._configured(inst):
                continue
            _refuse_if_unloaded(inst, unloads)
            try:
                lease = await inst.take_slot(max(deadline - loop.time(), 0.001))
            except TimeoutError:
                raise QueueTimeout(
                    f"{inst.name}: no free slot within {inst.spec.queue_timeout:g}s") from None
            if inst.state is State.READY:
                return lease
            lease.release()  # it died or began draining while we queued: go round again
    finally:
        inst.queue_leave()

async def _acquire_replica(self: Daemon, rs: ReplicaSet, ignore_backoff: bool) -> Lease:
    """Lease the least busy ready replica. Loading the model starts replicas.min children;
    while every replica is busy and a request has waited `scale_after` seconds, one more
    starts (up to replicas.max); TTL retires idle ones. Requests queue on the model (its
    first instance counts them): whichever replica frees a slot first serves the next."""
    model, spec = rs.primary, rs.spec
    self._keep_min_replicas(rs)
    ready = rs.least_busy()
    if ready is not None:
        return await ready.take_slot(spec.queue_timeout)
    free = sum(r.free_slots for r in rs.members if r.state is State.READY)
    if model.queued >= spec.max_queue + free:
        raise QueueFull(f"{model.name}: every replica busy and {model.queued} queued "
                        f"(max_queue {spec.max_queue})")
    loop = asyncio.get_running_loop()
    started_waiting = loop.time()
    deadline = started_waiting + spec.queue_timeout
    unloads = model.unloads
    model.queue_enter()
    try:
        while True:
            if self._closing:
                raise ShuttingDown("corral is shutting down")
            if self.models.get(model.model) is not rs:
                raise UnknownModel(model.name, sorted(self.models))
            _refuse_if_unloaded(model, unloads)
            self._keep_min_replicas(rs)
            ready = rs.least_busy()
            if ready is not None:
                return await ready.take_slot(spec.queue_timeout)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise QueueTimeout(f"{model.name}: no replica had a free slot within "
                                   f"{spec.queue_timeout:g}s")
            up = rs.up()
            if not up:
                # Cold: the first replica starts like any model (room, eviction, back-off)
                # and the loop starts the rest of replicas.min.
                cold = next((r for r in rs.members if r.can_start), model)
                await self._ensure_ready(cold, deadline, ignore_backoff)
                continue
            waited = loop.time() - started_waiting
            if waited >= spec.scale_after and len(up) < spec.replicas_max \
                    and not any(r.state is State.STARTING for r in up):
                self._scale_up(rs, 1)
            await self._changed.wait(min(remaining, max(spec.scale_after - waited, 0.05),
                                         1.0))
    finally:
        model.queue_leave()

def _keep_min_replicas(self: Daemon, rs: ReplicaSet) -> None:
    """A loaded model runs at least replicas.min children (one that died is replaced
    here, at the next request)."""
    up = len(rs.up())
    if 0 < up < rs.spec.replicas_min:
        self._scale_up(rs, rs.spec.replicas_min - up)

def _scale_up(self: Daemon, rs: ReplicaSet, count: int) -> None:
    """Start up to `count` more replicas where the strategy finds room now; no waiting:
    the requests queued meanwhile are served by whichever replica frees first."""
    victim = rs.evicting_for
    if victim is not None and victim.state is not State.STOPPED:
        return  # room is being made for the last replica: one eviction at a time
    rs.evicting_for = None
    for replica in rs.members:
        if count <= 0:
            return
        if not replica.can_start or replica.backoff_left() > 0:
            continue
        try:
            victim, placement = self._try_start(replica, None, ignore_backoff=False)
        except SupervisorError as exc:
            log.warning("daemon.scale_up_refused", model=rs.name,
                        replica=replica.replica, error=str(exc))
            return
        if not placement.fits:
            if victim is not None:  # evicted for it: the next round starts it
                rs.evicting_for = victim
            return
        log.info("daemon.scaled_up", model=rs.name, replica=replica.replica,
                 queued=rs.primary.queued)
        count -= 1

async def _ensure_ready(self: Daemon, inst: Instance, deadline: float,
                        ignore_backoff: bool) -> None:
    loop = asyncio.get_running_loop()
    victim: Instance | None = None  # evicted on our behalf, still on its way out
    room_deadline: float | None = None  # evict_timeout, from the first wait for room
    while inst.state is not State.READY:
        if self._closing:
            raise ShuttingDown("corral is shutting down")
        if inst.model not in self.models:  # a reload removed it meanwhile
            raise UnknownModel(inst.model, sorted(self.models))
        if not self._configured(inst):
            return  # replaced by a new child: the caller goes to that one
        now = loop.time()
        remaining = deadline - now
        if remaining <= 0:
            raise QueueTimeout(f"{inst.name} did not become ready in time "
                               f"(state {inst.state})")
        if inst.state is State.STARTING:
            await self._wait_started(inst)
        elif not inst.can_start:
            # Draining, stopping, or failed under a stop that is still running: no start
            # may begin before that stop has ended.
            await inst.wait_change(remaining)
        else:
            victim, placement = self._try_start(inst, victim, ignore_backoff)
            if placement.fits:
                continue  # started: wait for it on the next round
            if room_deadline is None:
                room_deadline = now + self.loaded.config.policy.evict_timeout
            elif now >= room_deadline:
                raise NoCapacity(
                    f"cannot start {inst.name}: {placement.reason}; retry later"
                    if placement.reason else
                    f"cannot start {inst.name}: max_loaded="
                    f"{self.loaded.config.policy.max_loaded} and every loaded model is busy "
                    f"or pinned ({', '.join(placement.blocked_by)}); retry later")
            await self._changed.wait(min(remaining, room_deadline - now, 1.0))

def _try_start(self: Daemon, inst: Instance, victim: Instance | None, ignore_backoff: bool,
               ) -> tuple[Instance | None, policy.Placement]:
    """Decide, with no await in between, whether `inst` starts now, and act on it: start
    it, or stop one idle model to make room (returned: the caller waits for it rather
    than evicting another). Deciding and acting in one synchronous step is what keeps
    two cold starts from claiming the same room, with no lock held across waits."""
    backoff = inst.backoff_left()
    if backoff > 0 and not ignore_backoff:
        # The reason stays in /admin/models and the logs: it quotes the child's output.
        raise StartBackoff(
            f"{inst.name} failed to start ({inst.start_failures} time"
            f"{'s' if inst.start_failures != 1 else ''} in a row); next try in "
            f"{backoff:.1f}s", retry_after=backoff)
    if not inst.backend.spawns:
        # A remote: no memory, no room, nothing to evict for it.
        inst.begin_start(self._http(), self._on_spawn, reason="demand")
        inst.touch()
        return None, policy.Placement(fits=True)
    snap = self._snapshot()
    refusal = self._decide("refuse", None, snap, inst.model)
    if refusal:
        raise NotServed(str(refusal))
    placement = self._decide("place", None, snap, inst.name)
    if placement is None:  # the strategy failed: today's LRU decides
        placement = policy.Generic().place(snap, inst.name)
    if placement.fits:
        self._begin_start(inst, snap, inst.name)
        inst.touch()
        return None, placement
    if not placement.retry:  # waiting cannot help: say why now
        raise NoCapacity(f"cannot start {inst.name}: {placement.reason}")
    if victim is not None and victim.state is not State.STOPPED:
        return victim, placement
    if placement.shrink is not None:
        shrink = snap.view(placement.shrink)
        if shrink is not None and self._kv_configured(shrink.model or shrink.name):
            self._change_kv(shrink.model or shrink.name, shrink.kv_level + 1,
                            f"memory: to make room for {inst.name}")
        return None, placement
    victim = self._loaded_member(placement.evict) if placement.evict else None
    if victim is not None and victim.state is State.READY:
        victim.begin_stop(f"evicted (least recently used) to start {inst.name}", cause="lru")
        return victim, placement
    return None, placement

async def _wait_started(self: Daemon, inst: Instance) -> None:
    try:
        await inst.wait_ready()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # our own caller is being cancelled (client gone)
        # The start was called off (unload, eviction): go round; it may start again.


def _refuse_if_unloaded(inst: Instance, seen: int) -> None:
    """A request that queued before an unload is told, not served: an unload ends with the
    model stopped, not started again by the requests that waited on it. One that arrives
    after the unload began waits for its stop to end, then starts the model anew."""
    if inst.unloads != seen:
        raise Unloaded(f"{inst.model} was unloaded while this request waited for it")
