"""The daemon: composition and task ownership. It owns every instance (as one ReplicaSet per
model), the policy, and the tasks that act on them; each job is a part in its own module:
the door (door.py), group holds (holds.py), the policy's views (views.py), TTL (ttl.py),
the memory loop (memory_loop.py), reloads (plan.py), admin commands (admin.py) and the read
model (read_model.py)."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from corral.supervisor import reload as reloading
from corral.supervisor.backends import BACKENDS
from corral.supervisor.backends.base import Backend
from corral.supervisor.config import LoadedConfig, ModelSpec
from corral.supervisor.daemon import admin as admin_part
from corral.supervisor.daemon import door as door_part
from corral.supervisor.daemon import holds as holds_part
from corral.supervisor.daemon import memory_loop as memory_loop_part
from corral.supervisor.daemon import plan as plan_part
from corral.supervisor.daemon import read_model as read_model_part
from corral.supervisor.daemon import ttl as ttl_part
from corral.supervisor.daemon import views as views_part
from corral.supervisor.daemon.replicas import ReplicaSet
from corral.supervisor.errors import SupervisorError, UnknownModel
from corral.supervisor.events import EventBus
from corral.supervisor.instance import LOADED_STATES, Changed, Instance, State
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.pull import Puller
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.deploy import RpcDeployer
from corral.supervisor.rpc.lender import Lender
from corral.supervisor.rpc.watch import WorkerReturnWatch
from corral.supervisor.runtime import Runtime, build_runtime
from corral.supervisor.statefile import ChildRegistry

log = structlog.get_logger("corral.daemon")


class Daemon:
    def __init__(self, loaded: LoadedConfig, state_file: Path,
                 config_loader: Callable[[], LoadedConfig] | None = None,
                 runtime: Runtime | None = None):
        self.loaded = loaded
        # What the config names, built: the strategy, the GPU reader, what is kept loaded.
        self.runtime = runtime if runtime is not None else build_runtime(loaded)
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
        self._lender = Lender(loaded.config.worker, loaded.binary, self._keeper,
                              self._device_free) if loaded.config.worker.enabled else None
        self._changed = Changed()
        self._registry = ChildRegistry(state_file)
        # llama-server slots saved at each stop, restored on demand. Its dir is read once,
        # like state_dir; its other settings at each use.
        self.prompt_cache = PromptCache(
            loaded.prompt_cache_dir or state_file.parent / "prompt-cache",
            lambda: self.loaded.config.prompt_cache, self.events)
        self._closing = False
        # Every background task the daemon starts: kept referenced, cancelled at close.
        self._tasks: set[asyncio.Task[Any]] = set()
        self.models: dict[str, ReplicaSet] = {}
        for name, spec in loaded.models.items():
            self.models[name] = self._new_set(spec, BACKENDS[spec.backend])
            self.models[name].fit(0.0, self._retire)
        # Instances that left the config (removed, scaled down, replaced) but still drain:
        # their children hold memory and serve streams until their stops end.
        self._retired: set[Instance] = set()
        # Reload: how to read the config again (runs in a thread), one reload at a time.
        self._config_loader = config_loader or self._load_source
        self._reload_lock = asyncio.Lock()
        self.last_reload: reloading.ReloadAttempt | None = None
        self._recent_reloads: collections.deque[reloading.ReloadAttempt] = \
            collections.deque(maxlen=20)
        self._config_since = time.time()
        self._generation = 1
        self._config_view: tuple[LoadedConfig | None, dict[str, Any]] = (None, {})
        self._strategy_failures: dict[str, str] = {}  # decision → last error (logged once)
        self._mark_kept(self.runtime.kept)
        # Memory: the latest sample of devices and children, estimates and measurements.
        self.memory = MemoryTracker(loaded.config.memory, self.runtime.gpu_reader)
        self._memory_wake = asyncio.Event()
        self._workers_back = WorkerReturnWatch(
            lambda: [i for s in self.models.values() for i in s.members],
            lambda: self.loaded.config.peers, self._http, self._rebalance_quietly)

    def _new_instance(self, spec: ModelSpec, backend: Backend, replica: int = 1) -> Instance:
        return Instance(spec, backend, self._changed.fire, replica=replica,
                        keeper=self._keeper, deployer=self.deployer, events=self.events,
                        prompt_cache=self.prompt_cache)

    def _new_set(self, spec: ModelSpec, backend: Backend) -> ReplicaSet:
        return ReplicaSet(self._new_instance(spec, backend), self._new_instance)

    def _device_free(self) -> dict[str, int]:
        return self.memory.device_free()

    @property
    def lender(self) -> Lender | None:
        return self._lender

    # The parts, each in its own module (one job each); functions that take the daemon.
    # door.py
    acquire = door_part.acquire
    _acquire_replica = door_part._acquire_replica
    _keep_min_replicas = door_part._keep_min_replicas
    _scale_up = door_part._scale_up
    _ensure_ready = door_part._ensure_ready
    _try_start = door_part._try_start
    _wait_started = door_part._wait_started
    # holds.py
    reserve = holds_part.reserve
    check_capacity = holds_part.check_capacity
    # views.py
    _snapshot = views_part._snapshot
    _live = views_part._live
    _view = views_part._view
    _footprint = views_part._footprint
    _estimate = views_part._estimate
    _estimate_on = views_part._estimate_on
    _placed = views_part._placed
    _begin_start = views_part._begin_start
    _tune = views_part._tune
    _decide = views_part._decide
    # ttl.py
    _sweep_ttl = ttl_part._sweep_ttl
    _expire_idle = ttl_part._expire_idle
    _keep_up = ttl_part._keep_up
    # memory_loop.py
    _sample_memory = memory_loop_part._sample_memory
    _watch_memory = memory_loop_part._watch_memory
    _relieve = memory_loop_part._relieve
    _kv_configured = memory_loop_part._kv_configured
    _change_kv = memory_loop_part._change_kv
    memory_status = memory_loop_part.memory_status
    # plan.py
    reload = plan_part.reload
    config_status = plan_part.config_status
    _load_source = plan_part._load_source
    _failed = plan_part._failed
    _reload = plan_part._reload
    _read_config = plan_part._read_config
    _note_reload = plan_part._note_reload
    _apply_plan = plan_part._apply_plan
    _begin_switch_over = plan_part._begin_switch_over
    _switch_over = plan_part._switch_over
    _restart_after = plan_part._restart_after
    # admin.py
    load = admin_part.load
    unload = admin_part.unload
    load_soon = admin_part.load_soon
    unload_soon = admin_part.unload_soon
    _load_quietly = admin_part._load_quietly
    rebalance = admin_part.rebalance
    _rebalance_quietly = admin_part._rebalance_quietly
    # read_model.py
    model_names = read_model_part.model_names
    groups = read_model_part.groups
    describe = read_model_part.describe
    describe_one = read_model_part.describe_one
    child_logs = read_model_part.child_logs
    follow_logs = read_model_part.follow_logs
    status = read_model_part.status
    spec = read_model_part.spec
    statuses = read_model_part.statuses
    ready_now = read_model_part.ready_now
    inventory = read_model_part.inventory
    gguf_info = read_model_part.gguf_info
    _read_inventory = read_model_part._read_inventory
    _prefetch_facts = read_model_part._prefetch_facts

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        reaped = self._registry.reap_leftovers()
        if reaped:
            log.warning("daemon.reaped_orphans", pids=reaped)
        self._keeper.start()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self._spawn_task(self._sweep_ttl(), "ttl-sweeper")
        try:
            await self._sample_memory()  # decisions see memory from the first request on
        except Exception:
            log.exception("daemon.memory_watch_failed")  # corral serves without it meanwhile
        self._spawn_task(self._prefetch_facts(self.loaded))
        self._spawn_task(self._read_inventory(self.loaded))
        self._spawn_task(self._watch_memory(), "memory")
        self._spawn_task(self._workers_back.run(), "rpc-workers-back")
        for rs in self.models.values():
            if rs.primary.pinned:
                self._spawn_task(self._preload(rs.primary))
        log.info("daemon.started", models=sorted(self.models))

    def prompt_cache_status(self) -> dict[str, Any]:
        """The read model of GET /admin/prompt-cache."""
        return self.prompt_cache.status()

    async def _preload(self, inst: Instance) -> None:
        inst.intent.preloading = True
        try:
            await self.load(inst.model)
        except SupervisorError as exc:
            log.error("daemon.pinned_load_failed", model=inst.model, error=str(exc))
        finally:
            inst.intent.preloading = False

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
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:  # bounded: a task that will not end must not hang the shutdown
            await asyncio.wait(list(self._tasks), timeout=5)
        await self.pulls.close()  # their parts stay, to be resumed
        # Stops are never cancelled: each ends with its process group gone.
        await asyncio.gather(*(i.stop("daemon shutdown", cause="shutdown")
                               for i in self._everyone() if i.state is not State.STOPPED),
                             return_exceptions=True)
        if self._lender is not None:
            await self._lender.close()
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
        if name in self.models:
            return name
        return self.loaded.aliases.get(name)

    def replica_set(self, name: str) -> ReplicaSet:
        canonical = self.resolve(name)
        if canonical is None:
            raise UnknownModel(name, sorted(self.models))
        return self.models[canonical]

    def instance(self, name: str) -> Instance:
        """The primary instance of a model (by name or alias). Raises UnknownModel."""
        return self.replica_set(name).primary

    def members(self, inst: Instance) -> list[Instance]:
        """A model's replicas, the instance named like it first."""
        rs = self.models.get(inst.model)
        return rs.members if rs is not None and rs.holds(inst) else [inst]

    def member(self, key: str) -> Instance:
        """An instance by its own name: a model (or alias), or one replica ("<model>#<n>")."""
        model, sep, number = key.rpartition("#")
        if sep and number.isdigit() and model in self.models:
            found = self.models[model].member(key)
            if found is not None:
                return found
        return self.instance(key)

    def _loaded_member(self, key: str) -> Instance | None:
        """The configured instance (a model or one replica) a strategy named, if any."""
        try:
            return self.member(key)
        except UnknownModel:
            return None

    def _configured(self, inst: Instance) -> bool:
        """Whether `inst` is still one of the config's (a reload may have removed it)."""
        rs = self.models.get(inst.model)
        return rs is not None and rs.holds(inst)

    def _everyone(self) -> list[Instance]:
        """Every instance that may hold a child: the configured ones, the new children of
        switch-overs, and those that left the config but still drain."""
        return [*(r for rs in self.models.values() for r in rs.members),
                *(rs.incoming for rs in self.models.values() if rs.incoming is not None),
                *self._retired]

    def _mark_kept(self, kept: frozenset[str] | set[str]) -> None:
        for name, rs in self.models.items():
            rs.mark_kept(name in kept)

    # -- task ownership ------------------------------------------------------------------------

    def _spawn_task(self, coro: Coroutine[Any, Any, Any], name: str | None = None,
                    ) -> asyncio.Task[Any]:
        """Background work the daemon owns: kept referenced, cancelled (and awaited) at close,
        run in a fresh context (no request id leaks into it). An exception it ends with is
        logged, never left unretrieved."""
        task = asyncio.create_task(coro, name=name, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("daemon.task_crashed", task=task.get_name(),
                      exc_info=task.exception())

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Daemon.start() was not awaited"
        return self._session

    def notify_change(self) -> None:
        """Something waiters for room or capacity care about changed (e.g. a hold ended)."""
        self._changed.fire()

    def _on_spawn(self, _inst: Instance) -> None:
        self._persist_children()  # raising here fails the start and stops the child

    def _persist_children(self) -> None:
        self._registry.record([(i.name, i.pid) for i in self._everyone()
                               if i.pid is not None and i.state in LOADED_STATES])

    def _retire(self, inst: Instance, why: str) -> None:
        """Keep an instance that left the config (its child holds memory, its streams run)
        until its stop is done."""
        def gone() -> None:
            self._retired.discard(inst)
            self._changed.fire()

        if inst.when_stopped(gone):
            self._retired.add(inst)
            log.info("daemon.retiring", model=inst.model, instance=inst.name, pid=inst.pid,
                     why=why)
