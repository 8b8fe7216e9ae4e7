"""The door: acquire() leases a ready child of a model, starting it (and making room) when
needed. Every wait is bounded by the model's queue_timeout, counted from the door, and is a
wait on an event (a state change, a slot given back, a memory sample), never a poll."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from corral.supervisor import policy
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.errors import (
    NoCapacity,
    NotServed,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    StartBackoff,
    UnknownModel,
    Unloaded,
)
from corral.supervisor.instance import Instance, State
from corral.supervisor.model import Model
from corral.supervisor.port import Lease

log = structlog.get_logger("corral.daemon")

# Run a model at another KV step (model, level, reason): the memory loop's, used to make room.
StepKv = Callable[[str, int, str], None]


class Door:
    def __init__(self, herd: Herd, planner: Planner, step_kv: StepKv):
        self._herd = herd
        self._planner = planner
        self._step_kv = step_kv

    async def acquire(self, name: str, *, ignore_backoff: bool = False) -> Lease:
        """Lease a ready instance of `name`, starting it (and evicting others) if needed."""
        herd = self._herd
        if herd.closing:
            raise ShuttingDown("corral is shutting down")
        model = herd.model(name)
        inst = model.primary
        if inst.state is State.READY and not inst.slots_full and inst.spec.replicas_max == 1:
            return await inst.take_slot(inst.spec.queue_timeout)  # the hot path: no waiting
        model.want()
        if inst.spec.replicas_max > 1:
            return await self._acquire_replica(model, ignore_backoff)
        # Bounded in every state: a cold, starting or draining model queues no more than a
        # ready one would (its free slots plus max_queue).
        if inst.queued >= inst.spec.max_queue + inst.free_slots:
            raise QueueFull(f"{inst.name}: {inst.in_flight} in flight and {inst.queued} "
                            f"queued (max_queue {inst.spec.max_queue}, state {inst.state})")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + inst.spec.queue_timeout
        unloads = inst.unloads
        inst.queue_enter()
        try:
            while True:
                current = herd.models.get(inst.model)
                if current is not None and current.primary is not inst:
                    # A reload switched the model to a new child (blue/green) while we
                    # queued: wait for that one instead.
                    inst.queue_leave()
                    inst = current.primary
                    unloads = inst.unloads
                    inst.queue_enter()
                _refuse_if_unloaded(inst, unloads)
                # A request that queued before an unload never starts the model again.
                await self.ensure_ready(inst, deadline, ignore_backoff,
                                        called_off=_unloaded_since(inst, unloads))
                if not herd.configured(inst):
                    continue
                _refuse_if_unloaded(inst, unloads)
                try:
                    lease = await inst.take_slot(max(deadline - loop.time(), 0.001))
                except TimeoutError:
                    raise QueueTimeout(f"{inst.name}: no free slot within "
                                       f"{inst.spec.queue_timeout:g}s") from None
                if inst.state is State.READY:
                    return lease
                lease.release()  # it died or began draining while we queued: go round again
        finally:
            inst.queue_leave()

    async def bring_up(self, model: Model, ignore_backoff: bool) -> None:
        """Up and ready (a load, a restart, a pinned model kept up): a lease taken and given
        back at once."""
        lease = await self.acquire(model.name, ignore_backoff=ignore_backoff)
        lease.release()

    async def start_member(self, model: Model, inst: Instance) -> None:
        """Start one replica (room made, evictions waited for), within the time a request
        would wait for room plus the start itself; an unload calls it off."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._herd.loaded.config.policy.evict_timeout \
            + inst.spec.start_timeout
        await self.ensure_ready(inst, deadline, ignore_backoff=False,
                                called_off=lambda: model.down)

    async def _acquire_replica(self, model: Model, ignore_backoff: bool) -> Lease:
        """Lease the least busy ready replica. Loading the model starts replicas.min children;
        while every replica is busy and a request has waited `scale_after` seconds, one more
        starts (up to replicas.max); TTL retires idle ones. Requests queue on the model (its
        first instance counts them): whichever replica frees a slot first serves the next."""
        first, spec, herd = model.primary, model.spec, self._herd
        self._keep_min_replicas(model)
        ready = model.least_busy()
        if ready is not None:
            return await ready.take_slot(spec.queue_timeout)
        free = sum(r.free_slots for r in model.members if r.state is State.READY)
        if first.queued >= spec.max_queue + free:
            raise QueueFull(f"{first.name}: every replica busy and {first.queued} queued "
                            f"(max_queue {spec.max_queue})")
        loop = asyncio.get_running_loop()
        started_waiting = loop.time()
        deadline = started_waiting + spec.queue_timeout
        unloads = first.unloads
        first.queue_enter()
        try:
            while True:
                if herd.closing:
                    raise ShuttingDown("corral is shutting down")
                if herd.models.get(first.model) is not model:
                    raise UnknownModel(first.name, sorted(herd.models))
                _refuse_if_unloaded(first, unloads)
                self._keep_min_replicas(model)
                ready = model.least_busy()
                if ready is not None:
                    return await ready.take_slot(spec.queue_timeout)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise QueueTimeout(f"{first.name}: no replica had a free slot within "
                                       f"{spec.queue_timeout:g}s")
                up = model.up()
                if not up:
                    # Cold: the first replica starts like any model (room, eviction,
                    # back-off), and the replicas task starts the rest of replicas.min.
                    cold = next((r for r in model.members if r.can_start), first)
                    await self.ensure_ready(cold, deadline, ignore_backoff,
                                            called_off=_unloaded_since(first, unloads))
                    continue
                waited = loop.time() - started_waiting
                if waited >= spec.scale_after and len(up) < spec.replicas_max \
                        and not any(r.state is State.STARTING for r in up):
                    model.fill(len(up) + 1)
                # A slot given back, a replica ready, or the moment to scale up.
                await herd.changed.wait(min(remaining, max(spec.scale_after - waited, 0.05)))
        finally:
            first.queue_leave()

    def _keep_min_replicas(self, model: Model) -> None:
        """A loaded model runs at least replicas.min children (one that died is replaced
        here, at the next request)."""
        up = len(model.up())
        if 0 < up < model.spec.replicas_min:
            model.fill(model.spec.replicas_min)

    async def ensure_ready(self, inst: Instance, deadline: float, ignore_backoff: bool,
                           called_off: Callable[[], bool] | None = None) -> None:
        """Until `inst` is ready: started when it may, room made, evictions waited for.
        `called_off`: asked each round (a replica start an unload called off)."""
        herd = self._herd
        loop = asyncio.get_running_loop()
        victim: Instance | None = None  # evicted on our behalf, still on its way out
        room_deadline: float | None = None  # evict_timeout, from the first wait for room
        while inst.state is not State.READY:
            if herd.closing:
                raise ShuttingDown("corral is shutting down")
            if called_off is not None and called_off():
                raise Unloaded(f"{inst.model} was unloaded while {inst.name} waited to start")
            if inst.model not in herd.models:  # a reload removed it meanwhile
                raise UnknownModel(inst.model, sorted(herd.models))
            if not herd.configured(inst):
                return  # replaced by a new child: the caller goes to that one
            now = loop.time()
            remaining = deadline - now
            if remaining <= 0:
                raise QueueTimeout(f"{inst.name} did not become ready in time "
                                   f"(state {inst.state})")
            if inst.state is State.STARTING:
                await self._wait_started(inst, remaining)
            elif not inst.can_start:
                # Draining, stopping, or failed under a stop that is still running: no
                # start may begin before that stop has ended.
                await inst.wait_change(remaining)
            else:
                victim, placement = self._try_start(inst, victim, ignore_backoff)
                if placement.fits:
                    continue  # started: wait for it on the next round
                if room_deadline is None:
                    room_deadline = now + herd.loaded.config.policy.evict_timeout
                elif now >= room_deadline:
                    raise NoCapacity(
                        f"cannot start {inst.name}: {placement.reason}; retry later"
                        if placement.reason else
                        f"cannot start {inst.name}: max_loaded="
                        f"{herd.loaded.config.policy.max_loaded} and every loaded model is "
                        f"busy or pinned ({', '.join(placement.blocked_by)}); retry later")
                # Room comes with a stop that ends, a hold or lease given back, or a memory
                # sample: each fires `changed`.
                await herd.changed.wait(min(remaining, room_deadline - now))

    def _try_start(self, inst: Instance, victim: Instance | None, ignore_backoff: bool,
                   ) -> tuple[Instance | None, policy.Placement]:
        """Decide, with no await in between, whether `inst` starts now, and act on it: start
        it, or stop one idle model to make room (returned: the caller waits for it rather
        than evicting another). Deciding and acting in one synchronous step is what keeps
        two cold starts from claiming the same room, with no lock held across waits."""
        planner = self._planner
        backoff = inst.backoff_left()
        if backoff > 0 and not ignore_backoff:
            # The reason stays in /admin/models and the logs: it quotes the child's output.
            raise StartBackoff(
                f"{inst.name} failed to start ({inst.start_failures} time"
                f"{'s' if inst.start_failures != 1 else ''} in a row); next try in "
                f"{backoff:.1f}s", retry_after=backoff)
        if not inst.backend.spawns:
            # A remote: no memory, no room, nothing to evict for it.
            inst.begin_start(planner.http(), self._herd.on_spawn, reason="demand")
            inst.touch()
            return None, policy.Placement(fits=True)
        snap = planner.snapshot()
        refusal = planner.decide("refuse", None, snap, inst.model)
        if refusal:
            raise NotServed(str(refusal))
        placement = planner.decide("place", None, snap, inst.name)
        if placement is None:  # the strategy failed: today's LRU decides
            placement = policy.Generic().place(snap, inst.name)
        if placement.fits:
            planner.begin_start(inst, snap, inst.name)
            inst.touch()
            return None, placement
        if not placement.retry:  # waiting cannot help: say why now
            raise NoCapacity(f"cannot start {inst.name}: {placement.reason}")
        if victim is not None and victim.state is not State.STOPPED:
            return victim, placement
        if placement.shrink is not None:
            shrink = snap.view(placement.shrink)
            if shrink is not None:
                self._step_kv(shrink.model or shrink.name, shrink.kv_level + 1,
                              f"memory: to make room for {inst.name}")
            return None, placement
        victim = self._herd.loaded_member(placement.evict) if placement.evict else None
        if victim is not None and victim.state is State.READY:
            victim.begin_stop(f"evicted (least recently used) to start {inst.name}",
                              cause="lru")
            return victim, placement
        return None, placement

    async def _wait_started(self, inst: Instance, remaining: float) -> None:
        """Wait for the start under way, no longer than the request may wait (the start goes
        on: it is the instance's)."""
        try:
            async with asyncio.timeout(remaining):
                await inst.wait_ready()
        except TimeoutError:
            raise QueueTimeout(
                f"{inst.name} is still starting; it did not become ready within the "
                f"request's queue_timeout ({inst.spec.queue_timeout:g}s)") from None
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


def _unloaded_since(inst: Instance, seen: int) -> Callable[[], bool]:
    return lambda: inst.unloads != seen
