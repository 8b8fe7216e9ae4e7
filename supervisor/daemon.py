"""The daemon: owns every instance, the policy, the TTL sweeper and the one door, acquire()."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from corral.supervisor import policy
from corral.supervisor import reload as reloading
from corral.supervisor.backends import BACKENDS
from corral.supervisor.backends.base import Backend
from corral.supervisor.config import (
    ConfigError,
    ConfigIssue,
    LoadedConfig,
    ModelSpec,
    load_config,
)
from corral.supervisor.errors import (
    NoCapacity,
    NotServed,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    StartBackoff,
    SupervisorError,
    UnknownModel,
)
from corral.supervisor.events import EventBus
from corral.supervisor.instance import LOADED_STATES, Changed, Instance, Lease, State
from corral.supervisor.inventory import cached_facts, read_facts
from corral.supervisor.memory.estimate import model_facts
from corral.supervisor.memory.gguf_info import describe_gguf
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.memory.view import MIB, Footprint
from corral.supervisor.pull import Puller
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.reservation import Reservation
from corral.supervisor.rpc.deploy import RpcDeployer
from corral.supervisor.rpc.lender import Lender
from corral.supervisor.rpc.plan import layer_need
from corral.supervisor.statefile import ChildRegistry

log = structlog.get_logger("corral.daemon")


@dataclasses.dataclass(frozen=True)
class ModelStatus:
    """What the proxy may read of a model (DESIGN: it reads the supervisor through acquire()
    and this read model only)."""

    name: str
    spec: ModelSpec
    state: State
    since: float  # wall clock of the first replica's last state change

# How long a config file the watcher saw change may stay empty before the reload reports it:
# an in-place save truncates first, then writes.
EMPTY_SAVE_GRACE_S = 0.5


class Daemon:
    def __init__(self, loaded: LoadedConfig, state_file: Path,
                 config_loader: Callable[[], LoadedConfig] | None = None):
        self.loaded = loaded
        # What happens here, for /admin/events, metrics and the service manager.
        self.events = EventBus()
        # Models being downloaded into models_dir (POST /admin/pull): tasks of their own.
        self.pulls = Puller(self.events, lambda: self.loaded)
        # Kills the children's process groups if this daemon dies without stopping them.
        self._keeper = GroupKeeper()
        self._session: aiohttp.ClientSession | None = None
        # Models split over RPC workers: their rpc-servers, local or a peer's.
        self.deployer = RpcDeployer(loaded.config.peers, self._keeper, self._http,
                                    self._device_free)
        # Worker mode: rpc-servers this corral lends to other heads.
        self.lender = Lender(loaded.config.worker, loaded.config.binary, self._keeper,
                             self._device_free) if loaded.config.worker.enabled else None
        self.instances: dict[str, Instance] = {
            name: self._new_instance(spec, BACKENDS[spec.backend])
            for name, spec in loaded.models.items()
        }
        # Replicas 2..max of models with `replicas`: instances of their own, not routable by
        # name; acquire() picks among a model's replicas.
        self.replicas: dict[str, list[Instance]] = {}
        for inst in self.instances.values():
            self._fit_replicas(inst, drain=0.0)
        self._changed = Changed()
        self._registry = ChildRegistry(state_file)
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        # Reload: how to read the config again (runs in a thread), one reload at a time,
        # models removed from the config that still drain, replaced models awaiting restart.
        self._config_loader = config_loader or self._load_source
        self._reload_lock = asyncio.Lock()
        self._retiring: set[Instance] = set()
        # Blue/green: the new child of a model whose settings changed, starting beside the
        # old one that still serves; swapped in once ready.
        self._incoming: dict[str, Instance] = {}
        self._evicting_for: dict[str, Instance] = {}  # model → the idle one stopped for it
        self._restarting: set[str] = set()
        self.last_reload: reloading.ReloadAttempt | None = None
        self._recent_reloads: collections.deque[reloading.ReloadAttempt] = \
            collections.deque(maxlen=20)
        self._config_since = time.time()
        self._generation = 1
        self._config_view: tuple[LoadedConfig | None, dict[str, Any]] = (None, {})
        self._preloading: set[str] = set()  # kept-loaded models being loaded by the daemon
        self._strategy_failures: dict[str, str] = {}  # decision → last error (logged once)
        self._mark_kept(loaded.kept)
        # Memory: the latest sample of devices and children, estimates and measurements; the
        # KV ladder step each adaptive model runs at (0: its best).
        self.memory = MemoryTracker(loaded.config.memory, loaded.gpu_reader)
        self._kv_level: dict[str, int] = {}
        self._kv_restart: set[str] = set()  # models whose next start is for a KV change
        self._memory_task: asyncio.Task[None] | None = None
        self._memory_wake = asyncio.Event()
        self._rebalance_interval = 2.0

    def _new_instance(self, spec: ModelSpec, backend: Backend, replica: int = 1) -> Instance:
        return Instance(spec, backend, self._on_instance_change, replica=replica,
                        keeper=self._keeper, deployer=self.deployer, events=self.events)

    def _device_free(self) -> dict[str, int]:
        return self.memory.device_free()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        reaped = self._registry.reap_leftovers()
        if reaped:
            log.warning("daemon.reaped_orphans", pids=reaped)
        self._keeper.start()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self._sweeper = asyncio.create_task(self._sweep_ttl(), name="ttl-sweeper")
        try:
            await self._sample_memory()  # decisions see memory from the first request on
        except Exception:
            log.exception("daemon.memory_watch_failed")  # corral serves without it meanwhile
        self._spawn_task(self._prefetch_facts(self.loaded))
        self._spawn_task(self._read_inventory(self.loaded))
        self._memory_task = asyncio.create_task(self._watch_memory(), name="memory")
        self._spawn_task(self._watch_missing_workers())
        for inst in self.instances.values():
            if inst.pinned:
                self._spawn_task(self._preload(inst.name))
        log.info("daemon.started", models=sorted(self.instances))

    async def _preload(self, name: str) -> None:
        self._preloading.add(name)
        try:
            await self.load(name)
        except SupervisorError as exc:
            log.error("daemon.pinned_load_failed", model=name, error=str(exc))
        finally:
            self._preloading.discard(name)

    async def close(self, grace: float) -> None:
        """Stop taking work, let in-flight requests finish (bounded), stop every child."""
        self._closing = True
        self.events.publish("stopping", in_flight=sum(i.in_flight for i in self._everyone()))
        self._changed.fire()
        deadline = time.monotonic() + grace
        while any(i.in_flight for i in self._everyone()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("daemon.drain_expired", in_flight={
                    i.name: i.in_flight for i in self._everyone() if i.in_flight})
                break
            await self._changed.wait(min(remaining, 0.2))
        if self._sweeper:
            self._sweeper.cancel()
        if self._memory_task:
            self._memory_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.pulls.close()  # their parts stay, to be resumed
        # Stops are never cancelled: each ends with its process group gone.
        await asyncio.gather(*(i.stop("daemon shutdown", cause="shutdown") for i in self._everyone()
                               if i.state is not State.STOPPED), return_exceptions=True)
        if self.lender is not None:
            await self.lender.close()
        self._registry.clear()
        self._keeper.close()
        if self._session:
            await self._session.close()
        self.events.publish("stopped")
        self.events.close()
        log.info("daemon.stopped")

    @property
    def closing(self) -> bool:
        return self._closing

    # -- lookups -------------------------------------------------------------------------------

    def resolve(self, name: str) -> str | None:
        """Canonical model name for a name or alias, or None."""
        if name in self.instances:
            return name
        return self.loaded.aliases.get(name)

    def instance(self, name: str) -> Instance:
        canonical = self.resolve(name)
        if canonical is None:
            raise UnknownModel(name, sorted(self.instances))
        return self.instances[canonical]

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [r.describe(now) for i in self.instances.values() for r in self.members(i)]

    def status(self, name: str) -> ModelStatus:
        """The read model of one model (a canonical name, an alias, a replica's model) for the
        proxy: its spec and its state over its replicas. Raises UnknownModel."""
        inst = self.instance(name)
        states = {m.state for m in self.members(inst)}
        # A model with replicas is ready when any replica serves, starting while one starts.
        state = State.READY if State.READY in states else \
            State.STARTING if State.STARTING in states else inst.state
        return ModelStatus(inst.name, inst.spec, state, inst.since)

    def statuses(self) -> list[ModelStatus]:
        return [self.status(name) for name in self.instances]

    def ready_now(self, name: str) -> bool:
        """Whether a request for `name` would find a ready child (of any replica) now."""
        inst = self.instances.get(name)
        return inst is not None and any(r.state is State.READY for r in self.members(inst))

    def members(self, inst: Instance) -> list[Instance]:
        """A model's replicas, the instance named like it first."""
        extra = self.replicas.get(inst.name)
        return [inst, *extra] if extra else [inst]

    def member(self, key: str) -> Instance:
        """An instance by its own name: a model (or alias), or one replica ("<model>#<n>")."""
        model, sep, number = key.rpartition("#")
        if sep and number.isdigit() and model in self.instances:
            for replica in self.members(self.instances[model]):
                if replica.name == key:
                    return replica
        return self.instance(key)

    # -- the door ------------------------------------------------------------------------------

    async def acquire(self, name: str, *, ignore_backoff: bool = False) -> Lease:
        """Lease a ready instance of `name`, starting it (and evicting others) if needed.
        Every wait is bounded by the model's queue_timeout, counted from here."""
        if self._closing:
            raise ShuttingDown("corral is shutting down")
        inst = self.instance(name)
        if inst.state is State.READY and not inst.slots_full and inst.spec.replicas_max == 1:
            return await inst.take_slot(inst.spec.queue_timeout)  # the hot path: no waiting
        if inst.spec.replicas_max > 1:
            return await self._acquire_replica(inst, ignore_backoff)
        # Bounded in every state: a cold, starting or draining model queues no more than a
        # ready one would (its free slots plus max_queue).
        if inst.queued >= inst.spec.max_queue + inst.free_slots:
            raise QueueFull(f"{inst.name}: {inst.in_flight} in flight and {inst.queued} queued "
                            f"(max_queue {inst.spec.max_queue}, state {inst.state})")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + inst.spec.queue_timeout
        inst.queued += 1
        try:
            while True:
                current = self.instances.get(inst.model)
                if current is not None and current is not inst:
                    # A reload switched the model to a new child (blue/green) while we
                    # queued: wait for that one instead.
                    inst.queued -= 1
                    inst = current
                    inst.queued += 1
                await self._ensure_ready(inst, deadline, ignore_backoff)
                if not self._configured(inst):
                    continue
                try:
                    lease = await inst.take_slot(max(deadline - loop.time(), 0.001))
                except TimeoutError:
                    raise QueueTimeout(
                        f"{inst.name}: no free slot within {inst.spec.queue_timeout:g}s") from None
                if inst.state is State.READY:
                    return lease
                lease.release()  # it died or began draining while we queued: go round again
        finally:
            inst.queued -= 1

    async def _acquire_replica(self, model: Instance, ignore_backoff: bool) -> Lease:
        """Lease the least busy ready replica of `model`. Loading the model starts
        replicas.min children; while every replica is busy and a request has waited
        `scale_after` seconds, one more starts (up to replicas.max); TTL retires idle ones.
        Requests queue on the model (its first instance counts them), not on one replica:
        whichever replica frees a slot first serves the next."""
        spec = model.spec
        self._keep_min_replicas(model)
        ready = self._least_busy(model)
        if ready is not None:
            return await ready.take_slot(spec.queue_timeout)
        free = sum(r.free_slots for r in self.members(model) if r.state is State.READY)
        if model.queued >= spec.max_queue + free:
            raise QueueFull(f"{model.name}: every replica busy and {model.queued} queued "
                            f"(max_queue {spec.max_queue})")
        loop = asyncio.get_running_loop()
        started_waiting = loop.time()
        deadline = started_waiting + spec.queue_timeout
        model.queued += 1
        try:
            while True:
                if self._closing:
                    raise ShuttingDown("corral is shutting down")
                if self.instances.get(model.name) is not model:
                    raise UnknownModel(model.name, sorted(self.instances))
                self._keep_min_replicas(model)
                ready = self._least_busy(model)
                if ready is not None:
                    return await ready.take_slot(spec.queue_timeout)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise QueueTimeout(f"{model.name}: no replica had a free slot within "
                                       f"{spec.queue_timeout:g}s")
                members = self.members(model)
                up = [r for r in members if r.state in (State.STARTING, State.READY)]
                if not up:
                    # Cold: the first replica starts like any model (room, eviction, back-off)
                    # and the loop below starts the rest of replicas.min.
                    cold = next((r for r in members if r.state in (State.STOPPED, State.FAILED)),
                                model)
                    await self._ensure_ready(cold, deadline, ignore_backoff)
                    continue
                waited = loop.time() - started_waiting
                if waited >= spec.scale_after and len(up) < spec.replicas_max \
                        and not any(r.state is State.STARTING for r in up):
                    self._scale_up(model, 1)
                await self._changed.wait(min(remaining, max(spec.scale_after - waited, 0.05),
                                             1.0))
        finally:
            model.queued -= 1

    def _keep_min_replicas(self, model: Instance) -> None:
        """A loaded model runs at least replicas.min children (one that died is replaced
        here, at the next request)."""
        up = sum(r.state in (State.STARTING, State.READY) for r in self.members(model))
        if 0 < up < model.spec.replicas_min:
            self._scale_up(model, model.spec.replicas_min - up)

    def _least_busy(self, model: Instance) -> Instance | None:
        best: Instance | None = None
        for replica in self.members(model):
            if replica.state is State.READY and not replica.slots_full and (
                    best is None or replica.in_flight < best.in_flight):
                best = replica
        return best

    def _scale_up(self, model: Instance, count: int) -> None:
        """Start up to `count` more replicas where the strategy finds room now; no waiting:
        the requests queued meanwhile are served by whichever replica frees first."""
        victim = self._evicting_for.get(model.name)
        if victim is not None and victim.state is not State.STOPPED:
            return  # room is being made for the last replica: one eviction at a time
        self._evicting_for.pop(model.name, None)
        for replica in self.members(model):
            if count <= 0:
                return
            if replica.state not in (State.STOPPED, State.FAILED) or replica.backoff_left() > 0:
                continue
            try:
                victim, placement = self._try_start(replica, None, ignore_backoff=False)
            except SupervisorError as exc:
                log.warning("daemon.scale_up_refused", model=model.name,
                            replica=replica.replica, error=str(exc))
                return
            if not placement.fits:
                if victim is not None:  # evicted for it: the next round starts it
                    self._evicting_for[model.name] = victim
                return
            log.info("daemon.scaled_up", model=model.name, replica=replica.replica,
                     queued=model.queued)
            count -= 1

    async def _ensure_ready(self, inst: Instance, deadline: float, ignore_backoff: bool) -> None:
        loop = asyncio.get_running_loop()
        victim: Instance | None = None  # evicted on our behalf, still on its way out
        room_deadline: float | None = None  # evict_timeout, from the first wait for room
        while inst.state is not State.READY:
            if self._closing:
                raise ShuttingDown("corral is shutting down")
            if inst.model not in self.instances:  # a reload removed it meanwhile
                raise UnknownModel(inst.model, sorted(self.instances))
            if not self._configured(inst):
                return  # replaced by a new child: the caller goes to that one
            now = loop.time()
            remaining = deadline - now
            if remaining <= 0:
                raise QueueTimeout(f"{inst.name} did not become ready in time "
                                   f"(state {inst.state})")
            if inst.state is State.STARTING:
                await self._wait_started(inst)
            elif inst.state in (State.DRAINING, State.STOPPING):
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

    def _try_start(self, inst: Instance, victim: Instance | None, ignore_backoff: bool,
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
        snap = self._snapshot()
        refusal = self._decide("refuse", None, snap, inst.model)
        if refusal:
            raise NotServed(str(refusal))
        placement = self._decide("place", None, snap, inst.name)
        if placement is None:  # the strategy failed: today's LRU decides
            placement = policy.Generic().place(snap, inst.name)
        if placement.fits:
            self._begin_start(inst, snap, inst.name)
            inst.last_used = time.monotonic()
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

    async def _wait_started(self, inst: Instance) -> None:
        try:
            await inst.wait_ready()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own caller is being cancelled (client gone)
            # The start was called off (unload, eviction): go round; it may start again.

    @contextlib.contextmanager
    def reserve(self, names: Iterable[str]) -> Iterator[Reservation]:
        """Hold models that will be acquired together (a group's members): while held they
        are busy, so neither TTL nor LRU stops one to make room for another.

        All or none, decided at once: when what is held already (by other groups) plus these
        plus the pinned models cannot be loaded together, NoCapacity now, instead of two
        groups each holding what the other needs until evict_timeout."""
        wanted = {self.instance(n).name for n in names}
        held_elsewhere = {i.name for i in self.instances.values() if i.held > 0}
        problem = self._decide("room_for", None, self._snapshot(),
                               frozenset(wanted | held_elsewhere)) if wanted else None
        if problem:
            busy = sorted(held_elsewhere - wanted)
            raise NoCapacity(
                f"{len(wanted)} models ({', '.join(sorted(wanted))}) cannot be held now: "
                f"other groups hold {', '.join(busy) or 'none'}: {problem}; retry when they "
                f"finish")
        reservation = Reservation(self, wanted)
        try:
            yield reservation
        finally:
            reservation.release_all()

    def check_capacity(self, names: Iterable[str], what: str) -> None:
        """Refuse up front what max_loaded can never fit, instead of thrashing."""
        wanted = frozenset(self.resolve(n) or n for n in names)
        snap = self._snapshot()
        for name in sorted(wanted):
            refusal = self._decide("refuse", None, snap, name)
            if refusal:
                raise NotServed(f"{what}: {refusal}")
        problem = self._decide("room_for", None, snap, wanted)
        if problem:
            loaded = sorted(i.name for i in self.instances.values() if i.state in LOADED_STATES)
            raise NoCapacity(f"{what} {problem}; loaded now: "
                             f"{', '.join(loaded) or 'none'}")

    # -- admin actions -------------------------------------------------------------------------

    async def load(self, name: str) -> Instance:
        # An operator asking explicitly is the retry a back-off waits for.
        lease = await self.acquire(name, ignore_backoff=True)
        lease.release()
        return lease.instance

    async def unload(self, name: str, force: bool = False) -> Instance:
        """Drain (unless forced) and stop. The stop belongs to the instance: a caller that
        hangs up stops waiting, the model still ends STOPPED."""
        inst = self.instance(name)
        drain = 0.0 if force else self.loaded.config.shutdown_grace
        reason = "unloaded by admin" + (" (forced)" if force else "")
        await asyncio.gather(*(r.stop(reason, drain=drain, cause="unload")
                               for r in self.members(inst)))
        return inst

    def load_soon(self, name: str) -> Instance:
        """Begin loading `name` as the daemon's own task (the caller does not wait): the
        shape llama.cpp's router and Open WebUI expect of POST /models/load. A failure shows
        in the model's state and last_error, and in the log."""
        inst = self.instance(name)  # an unknown name fails now, not in the background
        self._spawn_task(self._load_quietly(inst.name))
        return inst

    def unload_soon(self, name: str) -> Instance:
        """Begin draining and stopping `name` (the stop is the instance's own task)."""
        inst = self.instance(name)
        drain = self.loaded.config.shutdown_grace
        for replica in self.members(inst):
            replica.begin_stop("unloaded by request", drain=drain, cause="unload")
        return inst

    async def _load_quietly(self, name: str) -> None:
        # Not an operator's retry (load() ignores the back-off): a client asking again and
        # again must not restart a broken model in a loop.
        try:
            lease = await self.acquire(name)
            lease.release()
        except SupervisorError as exc:
            log.warning("daemon.load_failed", model=name, error=str(exc))

    async def rebalance(self, name: str) -> Instance:
        """Deploy a model split over RPC workers again, over every worker reachable now, with
        a new split from what each has free: drain, stop, start."""
        inst = self.instance(name)
        if not inst.spec.rpc_workers:
            raise NotServed(f"{name} is not split over RPC workers: nothing to rebalance")
        await inst.stop("rebalance", drain=self.loaded.config.shutdown_grace, cause="rebalance")
        return await self.load(name)

    async def gguf_info(self, name: str) -> dict[str, Any]:
        """The model file's metadata and tensors (the gguf package's reader, in a thread), the
        bytes per layer, and for a model split over RPC workers the split it runs with."""
        inst = self.instance(name)
        if inst.spec.backend != "llama-server":
            raise NotServed(f"{name} is a {inst.spec.backend} model, not a GGUF file")
        try:
            info = await asyncio.to_thread(describe_gguf, inst.spec.model_path)
        except (OSError, ValueError) as exc:
            raise NotServed(f"{name}: cannot read {inst.spec.model_path}: {exc}") from exc
        spec = inst.started_with
        info["model"] = inst.name
        try:
            facts = await asyncio.to_thread(model_facts, spec.model_path)
            info["layer_need_mib"] = round(layer_need(
                facts, spec.ctx, spec.parallel, spec.cache_type_k, spec.cache_type_v) / MIB, 3)
        except Exception:  # a file llama.cpp reads but our arithmetic does not: say nothing
            info["layer_need_mib"] = None
        rpc = inst.describe()["rpc"]
        info["rpc"] = rpc
        return info

    async def _watch_missing_workers(self) -> None:
        """A model deployed without a worker that was unreachable: once that worker answers
        again and the model is idle, deploy it again over all of them."""
        while True:
            await asyncio.sleep(self._rebalance_interval)
            try:
                await self._rebalance_where_workers_returned()
            except Exception:  # one bad round must not end the watch for good
                log.exception("daemon.worker_watch_failed")

    async def _rebalance_where_workers_returned(self) -> None:
        for inst in list(self.instances.values()):
            deployment = inst.deployment
            if inst.state is not State.READY or deployment is None \
                    or not deployment.missing or inst.busy or inst.queued:
                continue
            back = [p for p in deployment.missing if await self._peer_answers(p)]
            if back and inst.state is State.READY and not inst.busy and not inst.queued:
                log.info("daemon.rebalance", model=inst.name, back=back,
                         reason="a missing worker answers again")
                self._spawn_task(self._rebalance_quietly(inst.name))

    async def _rebalance_quietly(self, name: str) -> None:
        try:
            await self.rebalance(name)
        except SupervisorError as exc:  # the next request tries again
            log.warning("daemon.rebalance_failed", model=name, error=str(exc))

    async def _peer_answers(self, peer_name: str) -> bool:
        peer = self.loaded.config.peers.get(peer_name)
        if peer is None:
            return False
        try:
            async with self._http().get(
                    f"{peer.url.rstrip('/')}/peer/info",
                    headers={"Authorization": f"Bearer {peer.token}"},
                    timeout=aiohttp.ClientTimeout(total=3)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # -- internals -----------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Daemon.start() was not awaited"
        return self._session

    def _snapshot(self, now: float | None = None) -> policy.Snapshot:
        now = time.monotonic() if now is None else now
        views = tuple(self._view(i) for m in self.instances.values() for i in self.members(m)) \
            + tuple(policy.ModelView(
                # Removed by a reload, still draining: it holds its room until it is gone.
                name=f"{i.name} (removed)", loaded=i.state in LOADED_STATES, stoppable=False,
                last_used=i.last_used, ttl=0, footprint=self._footprint(i),
                model=i.model if i.model in self.loaded.models else "",
            ) for i in self._retiring) + tuple(dataclasses.replace(
                # A new child starting beside the old one (blue/green): its own settings.
                # An extra child, not a restart: new-load limits apply to it.
                self._view(i), name=f"{i.name} (new)", stoppable=False, ttl=0,
                kv_changing=False,
            ) for i in self._incoming.values())
        snap = self.loaded.snapshot(views, now)
        return dataclasses.replace(snap, memory=self.memory.view(self._live(), now),
                                   estimate=self._estimate)

    def _live(self) -> list[Instance]:
        return [i for i in self._everyone() if i.pid is not None and i.state in LOADED_STATES]

    def _view(self, i: Instance) -> policy.ModelView:
        spec = i.spec
        ladder = tuple(policy.KvCache(k, v) for k, v in self.memory.ladder(spec)) \
            if spec.kv_ladder else ()
        level = self._kv_level.get(i.model, 0)
        loaded = i.state in LOADED_STATES
        footprint = self._footprint(i)
        if not loaded and i.model in self._kv_restart and i is self.instances.get(i.model):
            # Stopped to restart at another KV step: its room is kept for that start, or a
            # waiting cold start would take it and the restart would fail.
            loaded = True
            footprint = self._estimate(i.name, ladder[min(level, len(ladder) - 1)]
                                       if ladder else None)
        return policy.ModelView(
            name=i.name,
            loaded=loaded,
            stoppable=i.state is State.READY and not i.busy,
            last_used=i.last_used,
            ttl=spec.ttl,
            size_bytes=i.size_bytes,
            cache_type_k=spec.cache_type_k,
            cache_type_v=spec.cache_type_v,
            in_flight=i.in_flight,
            queued=i.queued,
            model=i.model,
            ready=i.state is State.READY,
            footprint=footprint,
            kv_ladder=ladder,
            kv_level=level,
            kv_auto=spec.kv_mode == "auto",
            kv_adaptive=spec.kv_adaptive,
            kv_hold=spec.kv_hold,
            kv_changing=i.model in self._kv_restart or i.model in self._restarting
            or i.model in self._incoming,
        )

    def _footprint(self, inst: Instance) -> Footprint:
        return self.memory.footprint(inst) if inst.state in LOADED_STATES else {}

    def _estimate(self, name: str, kv: policy.KvCache | None) -> Footprint:
        """The snapshot's estimate: what `name` (a model, a replica, "<m> (new)") takes when
        started with `kv` (None: its configured types)."""
        base = name.removesuffix(" (new)")
        inst = self._incoming.get(base) if base != name else self.instances.get(base)
        if inst is None:
            model, sep, number = base.rpartition("#")
            inst = self.instances.get(model) if sep and number.isdigit() else None
        if inst is None:
            return {}
        spec = inst.spec
        return self.memory.need(spec, (kv.type_k or spec.cache_type_k,
                                       kv.type_v or spec.cache_type_v) if kv else
                                (spec.cache_type_k, spec.cache_type_v))

    def _begin_start(self, inst: Instance, snap: policy.Snapshot, view_name: str,
                     reason: str = "demand") -> None:
        """Start `inst` with the KV types the strategy picks for it; it counts at its
        estimate until measured."""
        kv = self._decide("kv_cache", None, snap, view_name)
        inst.begin_start(self._http(), self._on_spawn, (kv.type_k, kv.type_v) if kv else None,
                         tune=self._tune, reason=reason)
        self.memory.started(inst)

    def _tune(self, spec: ModelSpec) -> ModelSpec:
        """The backend's last word on a start's settings, from what it needs per device
        (a vLLM child's share of the GPU)."""
        try:
            need = self.memory.need(spec, (spec.cache_type_k, spec.cache_type_v))
            return BACKENDS[spec.backend].tune(spec, need, self.memory.gpu_totals())
        except Exception:  # odd figures are no reason to refuse a start: as configured
            log.exception("daemon.tune_failed", model=spec.name)
            return spec

    def _decide(self, decision: str, fallback: Any, *args: Any) -> Any:
        """Ask the strategy. A plugin that raises must not take requests down with it: the
        error is logged (once per kind of failure) and `fallback` stands in."""
        try:
            answer = getattr(self.loaded.strategy, decision)(*args)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if self._strategy_failures.get(decision) != message:
                self._strategy_failures[decision] = message
                log.exception("daemon.strategy_failed", decision=decision,
                              strategy=self.loaded.config.policy.strategy)
            return fallback
        self._strategy_failures.pop(decision, None)
        return answer

    def _on_instance_change(self) -> None:
        self._changed.fire()

    def notify_change(self) -> None:
        """Something waiters for room or capacity care about changed (e.g. a hold ended)."""
        self._changed.fire()

    def _on_spawn(self, _inst: Instance) -> None:
        self._persist_children()  # raising here fails the start and stops the child

    def _persist_children(self) -> None:
        self._registry.record([(i.name, i.pid) for i in self._everyone()
                               if i.pid is not None and i.state in LOADED_STATES])

    async def _sweep_ttl(self) -> None:
        while True:
            wait: float | None = 1.0
            try:
                wait = self._expire_idle(time.monotonic())
            except Exception:
                # One bad sweep must not end TTL for good.
                log.exception("daemon.ttl_sweep_failed")
            await asyncio.sleep(min(max(wait or 1.0, 0.05), 1.0))

    def _expire_idle(self, now: float) -> float | None:
        """Stop what has been idle past its TTL; seconds until the next could expire.
        Decision and stop happen in one synchronous step (begin_stop leaves READY at once),
        so a request arriving meanwhile either got its slot first (then the model is busy
        and not expired) or finds the model stopping and starts it again."""
        snap = self._snapshot(now)
        for name in self._decide("expired", [], snap) or []:
            inst = self._loaded_member(name)
            if inst is None or inst.state is not State.READY or inst.busy:
                continue  # a strategy may only expire what is idle
            log.info("daemon.ttl_expired", model=name, pid=inst.pid, ttl=inst.spec.ttl)
            inst.begin_stop(f"idle for {inst.spec.ttl:g}s (ttl)", cause="ttl")
        self._keep_up(snap)
        wait: float | None = self._decide("next_expiry", 1.0, snap)
        return wait

    # -- memory --------------------------------------------------------------------------------

    async def _sample_memory(self) -> None:
        """Read devices and children (in a thread: psutil walks /proc, NVML asks the driver),
        then adopt the sample on the loop."""
        children = self._live()
        sample = await asyncio.to_thread(self.memory.read, [i.pid for i in children
                                                            if i.pid is not None])
        self.memory.take(sample, children)
        for inst in children:
            if inst.state is State.READY and inst.process is not None:
                self.memory.read_log(inst, inst.process.tail(400))

    def inventory(self, name: str) -> dict[str, Any] | None:
        """What a model's GGUF file is, for /v1/models (supervisor/inventory.py): its
        architecture, parameters, quantization, native context_length, size_bytes (all
        shards) and whether it has a projector. From memory only; None while the file has
        not been read yet (just after a start or reload), when it cannot be read, and for a
        model that is not a GGUF file."""
        inst = self.instances.get(name)
        if inst is None or inst.spec.backend != "llama-server":
            return None
        facts = cached_facts(inst.spec.model_path)
        return None if facts is None else {**facts, "mmproj": inst.spec.mmproj is not None}

    async def _read_inventory(self, loaded: LoadedConfig) -> None:
        """Read the headers of models not read yet (or changed on disk), one at a time in a
        thread: what inventory() answers from."""
        for spec in list(loaded.models.values()):
            if spec.backend == "llama-server":
                await asyncio.to_thread(read_facts, spec.model_path)

    async def _prefetch_facts(self, loaded: LoadedConfig) -> None:
        """Read every model file's GGUF header once, in a thread, so the first decision about
        a model does not (the header parse is fast, loading gguf/numpy is not)."""
        for spec in list(loaded.models.values()):
            await asyncio.to_thread(self.memory.warm, spec)

    async def _watch_memory(self) -> None:
        while True:
            try:
                await self._sample_memory()
                self._relieve()
            except Exception:
                log.exception("daemon.memory_watch_failed")  # one bad sample is not the end
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._memory_wake.wait(),
                                       self.loaded.config.memory.interval)
            self._memory_wake.clear()

    def _relieve(self) -> None:
        """Act on what the strategy says about memory pressure (or its end)."""
        if self._closing:
            return
        snap = self._snapshot()
        strategy = self.loaded.strategy
        decide = "relieve" if callable(getattr(strategy, "relieve", None)) else None
        reliefs = self._decide(decide, [], snap) if decide else policy.Generic().relieve(snap)
        for relief in reliefs or []:
            if relief.action == "evict":
                inst = self._loaded_member(relief.model)
                if inst is None or inst.state is not State.READY or inst.busy or inst.pinned:
                    continue  # a strategy may only evict what is idle and not kept
                log.info("daemon.memory_evict", model=inst.name, pid=inst.pid,
                         reason=relief.reason)
                inst.begin_stop(f"evicted: {relief.reason}", cause="memory")
            elif relief.action in ("kv_down", "kv_up"):
                view = snap.view(relief.model)
                model = view.model if view is not None and view.model else relief.model
                if self._kv_configured(model):
                    self._change_kv(model, relief.level, relief.reason)

    def _kv_configured(self, model: str) -> bool:
        inst = self.instances.get(model)
        return inst is not None and bool(inst.spec.kv_ladder)

    def _change_kv(self, model: str, level: int, reason: str) -> None:
        """Run `model` at another step of its KV ladder: the child restarts with it. When the
        strategy finds room for the new child beside the old one, the new one starts first
        (blue/green); otherwise the old one drains (its requests finish, new ones queue) and
        restarts in place. Logged with the reason and counted."""
        inst = self.instances[model]
        ladder = self.memory.ladder(inst.spec)
        level = max(0, min(level, len(ladder) - 1))
        running = (inst.started_with.cache_type_k, inst.started_with.cache_type_v)
        old = ladder.index(running) if running in ladder else self._kv_level.get(model, 0)
        if level == old or inst.state is not State.READY or model in self._restarting \
                or model in self._incoming or model in self._kv_restart:
            return  # one change at a time, on a serving child
        self._kv_level[model] = level
        direction = "down" if level > old else "up"
        self.memory.count_kv_change(model, direction)
        log.warning("daemon.kv_cache_changed", model=model, pid=inst.pid, direction=direction,
                    old="/".join(ladder[old]), new="/".join(ladder[level]), reason=reason)
        # A restart to change the KV cache frees memory: the critical watermark, which
        # refuses new loads, must not refuse it (cleared once it is serving again).
        self._kv_restart.add(model)
        drain = self.loaded.config.shutdown_grace
        change = reloading.ModelChange(model, inst.spec, ("kv_cache",))
        if self._begin_switch_over(inst, change, inst.backend, drain):
            return
        why = f"KV cache {direction} to {'/'.join(ladder[level])}: {reason}"
        stops = []
        for replica in self.members(inst):
            stop = replica.begin_stop(why, drain=drain, cause="kv") \
                if replica.state in LOADED_STATES else None
            if stop is not None:
                stops.append(stop)
        self._restart_after(inst, stops)

    def memory_status(self) -> dict[str, Any]:
        """The read model of GET /admin/memory."""
        now = time.monotonic()
        view = self.memory.view(self._live(), now)
        cfg = self.loaded.config.memory
        devices = []
        for d in (view.devices.values() if view else ()):
            devices.append({
                "name": d.name, "kind": d.kind, "total_mib": _mib(d.total),
                "used_mib": _mib(d.used), "free_mib": _mib(max(0, d.total - d.used)),
                "used_pct": round(d.used_pct, 1), "corral_mib": _mib(d.ours),
                "other_mib": _mib(d.other), "reserved_mib": _mib(d.reserve),
                "budget_mib": _mib(d.budget) if d.budget is not None else None,
                "capacity_mib": _mib(d.capacity),
                "pressure": "critical" if d.used_pct >= cfg.critical_watermark else
                            "low" if d.used_pct >= cfg.low_watermark else "none"})
        models = []
        for inst in [*(r for i in self.instances.values() for r in self.members(i)),
                     *self._incoming.values()]:
            spec = inst.spec
            level = self._kv_level.get(inst.model, 0)
            models.append({
                "name": inst.name, "state": str(inst.state), "pid": inst.pid,
                **self.memory.describe(inst),
                "footprint_mib": {d: _mib(b) for d, b in self._footprint(inst).items()},
                "cache_type_k": inst.started_with.cache_type_k or "f16",
                "cache_type_v": inst.started_with.cache_type_v or "f16",
                "kv_cache": {
                    "mode": spec.kv_mode, "adaptive": spec.kv_adaptive, "hold": spec.kv_hold,
                    "ladder": ["/".join(step) for step in self.memory.ladder(spec)],
                    "level": level, "changes": self.memory.kv_changes.get(
                        inst.model, {"down": 0, "up": 0}),
                } if spec.kv_ladder else None,
            })
        sample = self.memory.sample
        return {
            "devices": devices,
            "watermarks": {"low": cfg.low_watermark, "critical": cfg.critical_watermark},
            "reserve_mb": cfg.reserve_mb, "budget_mb": cfg.budget_mb,
            "budgets_mb": dict(cfg.budgets),
            "calm_for": round(view.calm_for, 1) if view else None,
            "sampled_ago": round(now - sample.at, 2) if sample else None,
            "gpu_reader": cfg.gpu_reader,
            "models": models,
        }

    def _keep_up(self, snap: policy.Snapshot) -> None:
        """What the strategy keeps loaded and crashed comes back (after its start back-off);
        one an operator unloaded stays down until asked for."""
        if self._closing:
            return
        for name in self._decide("keep_loaded", frozenset(), snap) or ():
            inst = self.instances.get(name)
            if inst is not None and inst.state is State.FAILED and inst.backoff_left() <= 0 \
                    and name not in self._restarting and name not in self._preloading:
                log.info("daemon.restart_kept", model=name, error=inst.last_error)
                self._spawn_task(self._preload(name))

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        """Background work the daemon owns: kept referenced, cancelled at close."""
        task = asyncio.create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _everyone(self) -> list[Instance]:
        """Every instance that may hold a child: the configured ones, and those a reload
        removed that are still draining."""
        return [*(r for i in self.instances.values() for r in self.members(i)),
                *self._incoming.values(), *self._retiring]

    def _configured(self, inst: Instance) -> bool:
        """Whether `inst` is still one of the config's (a reload may have removed it)."""
        model = self.instances.get(inst.model)
        return model is not None and (model is inst or inst in self.replicas.get(inst.model, ()))

    def _loaded_member(self, key: str) -> Instance | None:
        """The configured instance (a model or one replica) a strategy named, if any."""
        try:
            return self.member(key)
        except UnknownModel:
            return None

    def _mark_kept(self, kept: Iterable[str]) -> None:
        """What the strategy keeps loaded: the model, and the replicas it loads with."""
        kept = set(kept)
        for inst in self.instances.values():
            for replica in self.members(inst):
                replica.pinned = inst.name in kept and replica.replica <= inst.spec.replicas_min

    def _fit_replicas(self, inst: Instance, drain: float, fresh_start: bool = False) -> None:
        """Give `inst` the replicas its spec asks for: new ones start cold; ones past
        replicas.max drain and stop."""
        extra = self.replicas.get(inst.name, [])
        want = inst.spec.replicas_max - 1
        for replica in extra[want:]:
            stop = replica.begin_stop("replicas lowered by a reload", drain=drain,
                                      cause="scale_down")
            if stop is not None and not stop.done():
                self._retire(replica, stop)
        extra = extra[:want]
        for number in range(len(extra) + 2, want + 2):
            extra.append(self._new_instance(inst.spec, inst.backend,
                                  replica=number))
        for replica in extra:
            if replica.spec is not inst.spec:
                replica.reconfigure(inst.spec, inst.backend, fresh_start=fresh_start)
        if extra:
            self.replicas[inst.name] = extra
        else:
            self.replicas.pop(inst.name, None)

    # -- reload --------------------------------------------------------------------------------

    def reload(self, trigger: str) -> asyncio.Task[reloading.ReloadAttempt]:
        """Read the config again and apply what changed (supervisor/reload.py says what
        applies how). The work is a task the daemon owns: a caller that goes away (an HTTP
        client hanging up) only stops waiting, the reload still completes. Reloads run one
        at a time, in the order asked."""
        task = asyncio.create_task(self._reload(trigger), name=f"reload:{trigger}",
                                   context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def config_status(self) -> dict[str, Any]:
        """The read model of GET /admin/config: the active config and the last attempt."""
        if self._config_view[0] is not self.loaded:  # built once per config, not per poll
            self._config_view = (self.loaded, reloading.config_view(self.loaded))
        return {
            "active": {**self._config_view[1], "since": self._config_since,
                       "generation": self._generation},
            "last_reload": self.last_reload.as_dict() if self.last_reload else None,
            "recent_reloads": [a.as_dict() for a in self._recent_reloads],  # oldest first
        }

    def _load_source(self) -> LoadedConfig:
        if self.loaded.source is None:
            raise ConfigError([ConfigIssue("<config>", None, "", "corral was started without a "
                                           "config file (-c): there is nothing to reload")])
        return load_config(self.loaded.source)

    async def _reload(self, trigger: str) -> reloading.ReloadAttempt:
        async with self._reload_lock:
            started = time.monotonic()
            self.events.publish("reloading", trigger=trigger)
            try:
                new = await self._read_config(trigger)
            except ConfigError as exc:
                return self._note_reload(reloading.ReloadAttempt.failed(
                    trigger, started, exc.issues, exc.files))
            except asyncio.CancelledError:
                # Shutdown, mid-read: a reader that saw `reloading` also sees how it ended.
                issue = ConfigIssue(str(self.loaded.source or "<config>"), None, "",
                                    "cancelled: corral is shutting down; not applied")
                self._note_reload(reloading.ReloadAttempt.failed(
                    trigger, started, [issue], self.loaded.files))
                raise
            except Exception as exc:  # a bug while loading: report it, keep serving
                log.exception("daemon.reload_crashed", trigger=trigger)
                issue = ConfigIssue(str(self.loaded.source or "<config>"), None, "",
                                    f"reload failed: {type(exc).__name__}: {exc}")
                return self._note_reload(reloading.ReloadAttempt.failed(
                    trigger, started, [issue], self.loaded.files))
            if _is_empty(new):
                # Still empty after the grace: not a save caught halfway, yet not a wish to
                # remove every model either; that is written `models: {}`.
                issue = ConfigIssue(str(new.source), None, "",
                                    "the config file is empty; not applied (write `models: {}` "
                                    "to remove every model)")
                return self._note_reload(reloading.ReloadAttempt.failed(
                    trigger, started, [issue], new.files))
            if self._closing:
                issue = ConfigIssue(str(self.loaded.source or "<config>"), None, "",
                                    "corral is shutting down; not applied")
                return self._note_reload(reloading.ReloadAttempt.failed(
                    trigger, started, [issue], new.files))
            plan = reloading.diff(self.loaded, new)
            changed = not plan.empty or new.digest != self.loaded.digest
            self._apply_plan(plan, new)  # synchronous: applied whole, or (cancelled) not at all
            self._spawn_task(self._read_inventory(new))
            if changed:
                self._config_since = time.time()
                self._generation += 1
            return self._note_reload(reloading.ReloadAttempt.applied(trigger, started, plan, new))

    async def _read_config(self, trigger: str) -> LoadedConfig:
        """The config as the files hold it now. A file seen empty just after the watcher saw it
        change is most often a save caught between truncating and writing (an editor writing in
        place): read again for a moment rather than report a failed reload for every save."""
        # In a thread: parsing a large config must not stall the streams being relayed.
        new = await asyncio.to_thread(self._config_loader)
        waited = 0.0
        while trigger == "file" and _is_empty(new) and waited < EMPTY_SAVE_GRACE_S:
            await asyncio.sleep(0.05)
            waited += 0.05
            new = await asyncio.to_thread(self._config_loader)
        return new

    def _note_reload(self, attempt: reloading.ReloadAttempt) -> reloading.ReloadAttempt:
        self.last_reload = attempt
        self._recent_reloads.append(attempt)
        self.events.publish("reload", trigger=attempt.trigger, ok=attempt.ok,
                            ms=attempt.duration_ms, changes=attempt.changes,
                            issues=[str(i) for i in attempt.issues])
        if attempt.ok:
            log.info("daemon.reload", trigger=attempt.trigger, hash=attempt.digest[:12],
                     ms=attempt.duration_ms, **(attempt.changes or {}))
            if attempt.changes and attempt.changes["needs_restart"]:
                log.warning("daemon.reload_needs_restart", keys=attempt.changes["needs_restart"],
                            note="these settings apply when corral is restarted")
        else:
            log.error("daemon.reload_failed", trigger=attempt.trigger,
                      issues=[str(i) for i in attempt.issues],
                      note="the running config stays active")
        return attempt

    def _apply_plan(self, plan: reloading.Plan, new: LoadedConfig) -> None:
        """Apply a reload plan in one synchronous step, so no request sees half of it and no
        cancellation stops it halfway. What takes time (drains, stops, restarts) goes on as
        tasks the instances and the daemon own; every state change is the instance's own."""
        drain = new.config.shutdown_grace
        # Looked up before anything changes: nothing below may fail halfway.
        backends = {c.name: BACKENDS[c.spec.backend] for c in (*plan.replace, *plan.add)}
        pinned = new.kept
        old_memory = self.loaded.config.memory
        self.loaded = new
        reader_changed = (old_memory.gpu_reader, old_memory.gpu_reader_options) != (
            new.config.memory.gpu_reader, new.config.memory.gpu_reader_options)
        self.memory.reconfigure(new.config.memory, new.gpu_reader if reader_changed else None)
        self.deployer.reconfigure(new.config.peers)
        self._memory_wake.set()  # new limits apply at once, not at the next sample
        for name in (*plan.remove, *(c.name for c in plan.replace)):
            self._kv_level.pop(name, None)  # new settings start from the ladder's top
        for change in plan.update:
            inst = self.instances[change.name]
            inst.reconfigure(change.spec)
            self._fit_replicas(inst, drain)
            if change.name in self._incoming:
                self._incoming[change.name].reconfigure(change.spec)
        for change in plan.replace:
            superseded = self._incoming.pop(change.name, None)
            if superseded is not None:  # a newer change overtakes a switch-over under way
                superseded.begin_stop("superseded by a newer config change", cause="reload")
            inst = self.instances[change.name]
            if self._begin_switch_over(inst, change, backends[change.name], drain):
                continue
            inst.reconfigure(change.spec, backends[change.name], fresh_start=True)
            self._fit_replicas(inst, drain, fresh_start=True)
            was_up = False
            stops: list[asyncio.Task[None]] = []
            for replica in self.members(inst):
                was_up |= replica.state in (State.STARTING, State.READY)
                if replica.state in LOADED_STATES:
                    # Leaves READY now: new requests wait in acquire() for the restart;
                    # in-flight ones get `shutdown_grace` to finish.
                    stop = replica.begin_stop("config changed: " + ", ".join(change.fields),
                                              drain=drain, cause="reload")
                    if stop is not None:
                        stops.append(stop)
            # Up before, up after; and a pinned model is kept up (its old settings may be
            # what made it fail).
            if was_up or inst.name in pinned or inst.name in self._restarting:
                self._restart_after(inst, stops)
        for name in plan.remove:
            incoming = self._incoming.pop(name, None)
            if incoming is not None:
                incoming.begin_stop("removed from the config", cause="reload")
            inst = self.instances.pop(name)
            for replica in [inst, *self.replicas.pop(name, [])]:
                stop = replica.begin_stop("removed from the config", drain=drain,
                                          cause="reload")
                if stop is not None and not stop.done():
                    self._retire(replica, stop)
        for change in plan.add:
            inst = self._new_instance(change.spec, backends[change.name])
            self.instances[change.name] = inst
            self._fit_replicas(inst, drain)
        self._mark_kept(pinned)
        snap = self._snapshot()
        for inst in self.instances.values():
            if self._decide("refuse", None, snap, inst.name):
                for replica in self.members(inst):
                    if replica.state in (State.STARTING, State.READY):
                        replica.begin_stop(
                            f"not served under strategy {new.config.policy.strategy}",
                            drain=drain, cause="reload")
        for name in plan.pinned:
            if self.instances[name].state in (State.STOPPED, State.FAILED) \
                    and name not in self._restarting:
                self._spawn_task(self._preload(name))
        self._changed.fire()

    def _begin_switch_over(self, old: Instance, change: reloading.ModelChange,
                           backend: Backend, drain: float) -> bool:
        """Blue/green for a ready model whose child-affecting settings changed: start the new
        child beside the old one (which keeps serving) when the strategy finds room for both
        without evicting anything; once it is ready, it takes the model's name and the old one
        drains. False (the caller restarts in place) for replicas, a model not serving now,
        or no room."""
        if old.spec.replicas_max > 1 or change.spec.replicas_max > 1 \
                or old.state is not State.READY or self._closing:
            return False
        fresh = self._new_instance(change.spec, backend)
        self._incoming[old.name] = fresh  # seen by the strategy, as "<model> (new)"
        snap = self._snapshot()
        placement = self._decide("place", None, snap, f"{old.name} (new)")
        if placement is None or not placement.fits:
            del self._incoming[old.name]
            return False
        fresh.pinned = old.pinned
        self._begin_start(fresh, snap, f"{old.name} (new)",
                          reason="switch-over: " + ", ".join(change.fields))
        log.info("daemon.switch_over_started", model=old.name, old_pid=old.pid,
                 fields=list(change.fields))
        self._spawn_task(self._switch_over(old, fresh, change, drain))
        return True

    async def _switch_over(self, old: Instance, fresh: Instance,
                           change: reloading.ModelChange, drain: float) -> None:
        name = old.name
        try:
            await fresh.wait_ready()
        except (SupervisorError, asyncio.CancelledError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the daemon is closing: close() stops every child
            if self._incoming.get(name) is not fresh:
                return  # superseded or removed: whoever did that took over
            del self._incoming[name]
            self._kv_restart.discard(name)
            fresh.begin_stop("its switch-over failed", cause="reload")
            log.warning("daemon.switch_over_failed", model=name, error=str(exc),
                        old_pid=old.pid, note="the previous child keeps serving")
            if self.instances.get(name) is old:
                # Nothing fails: the old child goes on serving. It takes the new settings, so
                # its next start uses them (and shows their failure); admin shows why now.
                old.reconfigure(fresh.spec, fresh.backend)
                old.last_error = (f"the new settings ({', '.join(change.fields)}) failed to "
                                  f"start: {exc}; the previous child keeps serving")
            return
        if self._incoming.get(name) is not fresh or self.instances.get(name) is not old \
                or self._closing:
            fresh.begin_stop("superseded before it was switched in", cause="reload")
            if self._incoming.get(name) is fresh:
                del self._incoming[name]
            self._kv_restart.discard(name)
            return
        del self._incoming[name]
        self._kv_restart.discard(name)
        fresh.last_used = old.last_used
        fresh.pinned = old.pinned
        self.instances[name] = fresh
        stop = old.begin_stop("replaced by its new child (config changed: "
                              + ", ".join(change.fields) + ")", drain=drain, cause="reload")
        old.wake_waiters()  # requests queued on the old child go to the new one
        if stop is not None and not stop.done():
            self._retire(old, stop)
        log.info("daemon.switched_over", model=name, old_pid=old.pid, pid=fresh.pid)
        self._persist_children()
        self._changed.fire()

    def _retire(self, inst: Instance, stop: asyncio.Task[None]) -> None:
        """Keep a removed model's instance (its child holds memory, its streams run) until
        its stop is done."""
        self._retiring.add(inst)

        def gone(_task: asyncio.Task[None]) -> None:
            self._retiring.discard(inst)
            self._changed.fire()

        stop.add_done_callback(gone)

    def _restart_after(self, inst: Instance, stops: list[asyncio.Task[None]]) -> None:
        """A model that was up when its child-affecting settings changed is up again after:
        once the old child is gone, start it with the new spec. Requests that waited meanwhile
        may start it first; this then shares that start."""
        if inst.name in self._restarting:
            return  # a restart is already waiting for this stop; it reads the newest spec
        self._restarting.add(inst.name)

        async def restart() -> None:
            try:
                if stops:
                    await asyncio.wait(stops)  # never cancels the stops themselves
            finally:
                self._restarting.discard(inst.name)
            try:
                if self.instances.get(inst.name) is inst and not self._closing \
                        and inst.state in (State.STOPPED, State.FAILED):
                    try:
                        await self.load(inst.name)
                    except SupervisorError as exc:
                        # Its next request tries again; /admin/models shows why.
                        log.error("daemon.restart_failed", model=inst.name, error=str(exc))
            finally:
                self._kv_restart.discard(inst.name)
                self._changed.fire()

        self._spawn_task(restart())


def _is_empty(loaded: LoadedConfig) -> bool:
    """A config file with no top-level key at all (the embedded default has no file)."""
    return loaded.source is not None and not any(len(loc) == 1 for loc in loaded.lines)


def _mib(n: int) -> float:
    return round(n / MIB, 1)
