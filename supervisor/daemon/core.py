"""The daemon: composition only. It builds the parts as objects, each with its dependencies
passed in and its own fields, owns the tasks they run (one TaskScope), and answers the port
(supervisor/port.py) by asking the part whose job the question is:

    herd        the config in force, the models, retired children, `changed`  (herd.py)
    planner     the strategy's snapshot and decisions, a start's settings     (planner.py)
    lifecycle   what a model's state machine asks of the daemon; KV steps     (lifecycle.py)
    door        acquire: a lease, a cold start, room made                     (door.py)
    holds       a group's all-or-none holds                                   (holds.py)
    reloader    config diff → model transitions                               (reloader.py)
    memory loop samples, pressure, /admin/memory                              (memory_loop.py)
    ttl         idle models stopped, pinned ones kept up                      (ttl.py)
    admin       load, unload, rebalance                                       (admin.py)
    read model  what the proxy and the admin API read                         (read_model.py)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from corral.supervisor import reload as reloading
from corral.supervisor import socket_dir
from corral.supervisor.config import GroupSpec, LoadedConfig, ModelSpec
from corral.supervisor.daemon.admin import Admin
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.holds import Holds
from corral.supervisor.daemon.lifecycle import Lifecycle
from corral.supervisor.daemon.memory_loop import MemoryLoop
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.daemon.read_model import ReadModel
from corral.supervisor.daemon.reloader import Reloader
from corral.supervisor.daemon.shutdown import TASKS_S, ShutdownBudget
from corral.supervisor.daemon.ttl import TtlSweeper
from corral.supervisor.events import EventBus
from corral.supervisor.instance import State
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.model import Model
from corral.supervisor.port import Lease, ModelStatus, RequestsNow, Reservation
from corral.supervisor.process import KILL_WAIT_S
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.pull import Puller
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.deploy import RpcDeployer
from corral.supervisor.rpc.lender import Lender
from corral.supervisor.rpc.watch import WorkerReturnWatch
from corral.supervisor.runtime import Runtime, build_runtime
from corral.supervisor.statefile import ChildRegistry
from corral.supervisor.tasks import TaskScope

log = structlog.get_logger("corral.daemon")


class Daemon:
    def __init__(self, loaded: LoadedConfig, state_file: Path,
                 config_loader: Callable[[], LoadedConfig] | None = None,
                 runtime: Runtime | None = None):
        # What happens here, for /admin/events, metrics and the service manager.
        self.events = EventBus()
        self.tasks = TaskScope("daemon")  # every background task of the daemon's parts
        self._registry = ChildRegistry(state_file)
        self.herd = Herd(loaded, runtime if runtime is not None else build_runtime(loaded),
                         self.events, self._registry)
        # Models being downloaded into models_dir (POST /admin/pull): tasks of their own.
        self.pulls = Puller(self.events, lambda: self.herd.loaded)
        # Kills the children's process groups if this daemon dies without stopping them.
        self._keeper = GroupKeeper()
        self._session: aiohttp.ClientSession | None = None
        # Memory: the latest sample of devices and children, estimates and measurements.
        self.memory = MemoryTracker(loaded.config.memory, self.herd.runtime.gpu_reader)
        # Models split over RPC workers: their rpc-servers, local or a peer's.
        self.deployer = RpcDeployer(loaded.config.peers, self._keeper, self._http,
                                    self.memory.device_free)
        # Worker mode: rpc-servers this corral lends to other heads.
        self._lender = Lender(loaded.config.worker, loaded.binary, self._keeper,
                              self.memory.device_free) if loaded.config.worker.enabled else None
        # llama-server slots saved at each stop, restored on demand. Its dir is read once,
        # like state_dir; its other settings at each use.
        self.prompt_cache = PromptCache(
            loaded.prompt_cache_dir or state_file.parent / "prompt-cache",
            lambda: self.herd.loaded.config.prompt_cache, self.events)
        self.planner = Planner(self.herd, self.memory, self._http)
        self.holds = Holds(self.herd, self.planner)
        self.lifecycle = Lifecycle(self.herd, self.planner, self.memory, keeper=self._keeper,
                                   deployer=self.deployer, events=self.events,
                                   prompt_cache=self.prompt_cache, holds=self.holds)
        self.door = self.lifecycle.door
        self.memory_loop = MemoryLoop(self.herd, self.planner, self.memory,
                                      self.lifecycle.step_kv)
        self.ttl = TtlSweeper(self.herd, self.planner)
        self.admin = Admin(self.herd, self.door, self.tasks)
        self.read_model = ReadModel(self.herd, self.planner, self.memory)
        self.reloader = Reloader(self.herd, self.planner, self.lifecycle, self.memory,
                                 self.deployer, self.events, self.tasks, self._adopted,
                                 config_loader)
        for name, spec in loaded.models.items():
            model = self.lifecycle.new_model(spec)
            self.herd.models[name] = model
            model.fit(0.0)
        self.herd.mark_kept(self.herd.runtime.kept)
        self._workers_back = WorkerReturnWatch(
            lambda: [i for m in self.herd.models.values() for i in m.members],
            lambda: self.herd.loaded.config.peers, self._http, self.admin.rebalance_quietly)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        reaped = self._registry.reap_leftovers()
        if reaped:
            log.warning("daemon.reaped_orphans", pids=reaped)
        # After the orphans: the socket dirs of a daemon killed before it could remove them.
        socket_dir.sweep_leftovers()
        self._keeper.start()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        try:
            await self.memory_loop.sample()  # decisions see memory from the first request on
        except TimeoutError as exc:  # a driver that hangs: corral starts without it
            log.warning("daemon.memory_read_slow", error=str(exc))
        except Exception:
            log.exception("daemon.memory_watch_failed")  # corral serves without it meanwhile
        # After the first sample: its first sweep starts what is kept loaded, which must be
        # estimated and placed on the GPUs that sample found (before it, none: CPU only).
        self.tasks.spawn(self.ttl.run(), "ttl-sweeper")
        self.tasks.spawn(self.read_model.prefetch_facts(self.herd.loaded), "prefetch-facts")
        self.tasks.spawn(self.read_model.read_inventory(self.herd.loaded), "inventory")
        self.tasks.spawn(self.memory_loop.run(), "memory")
        self.tasks.spawn(self._workers_back.run(), "rpc-workers-back")
        for model in self.herd.models.values():
            model.keep_up()  # what the policy keeps loaded loads now
        log.info("daemon.started", models=sorted(self.herd.models))

    def _adopted(self, loaded: LoadedConfig) -> None:
        """A reload applied `loaded`: new memory limits and the prompt cache's disk budget at
        once, its model files read."""
        self.memory_loop.wake()
        self.prompt_cache.store.fit_budget()
        self.tasks.spawn(self.read_model.read_inventory(loaded), "inventory")

    async def close(self, grace: float, budget: ShutdownBudget | None = None) -> None:
        """Stop taking work, let in-flight requests finish (bounded), save and stop every
        child, all within `budget` when given (shutdown.py says the order and the bounds)."""
        herd = self.herd
        herd.closing = True
        self.events.publish("stopping", in_flight=sum(i.in_flight for i in herd.everyone()))
        herd.changed.fire()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        kill_by: float | None = None
        if budget is not None:
            # What the children's stops may take after the drain: the longest save and
            # stop_grace of those running (they stop all at once).
            settings = self.prompt_cache.settings()
            save = settings.save_timeout if settings.enabled else 0.0
            stops = max((i.spec.stop_grace + (save if i.prompt_slots is not None else 0.0)
                         for i in herd.everyone() if i.state is not State.STOPPED), default=0.0)
            deadline = budget.drain_until(grace, stops)
            kill_by = budget.kill_by
            log.info("daemon.shutdown_budget", total=budget.total,
                     drain=round(max(0.0, deadline - loop.time()), 3),
                     save_timeout=save, stops=stops,
                     kill_by=round(budget.kill_by - budget.began, 3))
        while any(i.in_flight for i in herd.everyone()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.warning("daemon.drain_expired", in_flight={
                    i.name: i.in_flight for i in herd.everyone() if i.in_flight})
                break
            await herd.changed.wait(remaining)  # every lease given back fires it
        # The models' operations first (none may start a child after this), then the
        # daemon's own tasks and the pulls: TASKS_S for all of them (each ends at its next
        # await; one that does not is logged and left).
        tasks_end = loop.time() + TASKS_S
        await asyncio.gather(*(m.tasks.close(TASKS_S) for m in herd.models.values()))
        left = max(0.1, tasks_end - loop.time())
        await asyncio.gather(self.tasks.close(left), self._end_pulls(left))
        # Stops are never cancelled: each ends with its process group gone. All at once, so
        # every child's saves run side by side, each before its child's SIGTERM.
        await asyncio.gather(*(i.stop("daemon shutdown", cause="shutdown", kill_by=kill_by)
                               for i in herd.everyone() if i.state is not State.STOPPED),
                             return_exceptions=True)
        if self._lender is not None:
            try:
                # Its rpc-servers, one after the other: within the budget, or the keeper
                # (closed below) kills what is left of them.
                async with asyncio.timeout_at(None if kill_by is None
                                              else kill_by + KILL_WAIT_S):
                    await self._lender.close()
            except TimeoutError:
                log.warning("daemon.loans_cut_short", note="the keeper kills their groups")
        self._registry.clear()
        self._keeper.close()
        if self._session:
            await self._session.close()
        self.events.publish("stopped")
        self.events.close()
        log.info("daemon.stopped")

    async def _end_pulls(self, timeout: float) -> None:
        try:
            # Cancelled pulls close their files at once; their parts stay, to be resumed.
            await asyncio.wait_for(self.pulls.close(), timeout)
        except TimeoutError:
            log.warning("daemon.pulls_slow_to_end", timeout=round(timeout, 3))

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Daemon.start() was not awaited"
        return self._session

    # -- the port: what the proxy may ask -------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self.herd.closing

    @property
    def loaded(self) -> LoadedConfig:
        return self.herd.loaded

    @property
    def models(self) -> Mapping[str, Model]:
        return self.herd.models

    @property
    def lender(self) -> Lender | None:
        return self._lender

    @property
    def last_reload(self) -> reloading.ReloadAttempt | None:
        return self.reloader.last_reload

    def resolve(self, name: str) -> str | None:
        return self.herd.resolve(name)

    async def acquire(self, name: str, *, ignore_backoff: bool = False) -> Lease:
        return await self.door.acquire(name, ignore_backoff=ignore_backoff)

    def reserve(self, names: Iterable[str]) -> AbstractContextManager[Reservation]:
        return self.holds.reserve(names)

    def check_capacity(self, names: Iterable[str], what: str) -> None:
        self.holds.check_capacity(names, what)

    def notify_change(self) -> None:
        """Something waiters for room or capacity care about changed (e.g. a hold ended)."""
        self.herd.changed.fire()

    def model_names(self) -> list[str]:
        return self.read_model.model_names()

    def groups(self) -> Mapping[str, GroupSpec]:
        return self.read_model.groups()

    def status(self, name: str) -> ModelStatus:
        return self.read_model.status(name)

    def spec(self, name: str) -> ModelSpec:
        return self.read_model.spec(name)

    def statuses(self) -> list[ModelStatus]:
        return self.read_model.statuses()

    def ready_now(self, name: str) -> bool:
        return self.read_model.ready_now(name)

    def describe(self) -> list[dict[str, Any]]:
        return self.read_model.describe()

    def describe_one(self, name: str) -> dict[str, Any]:
        return self.read_model.describe_one(name)

    def requests_now(self, names: Iterable[str]) -> RequestsNow:
        return self.read_model.requests_now(names)

    def child_logs(self, key: str, lines: int) -> dict[str, Any]:
        return self.read_model.child_logs(key, lines)

    def follow_logs(self, key: str, lines: int,
                    idle: float) -> AsyncGenerator[dict[str, Any], None]:
        return self.read_model.follow_logs(key, lines, idle)

    def inventory(self, name: str) -> dict[str, Any] | None:
        return self.read_model.inventory(name)

    async def gguf_info(self, name: str) -> dict[str, Any]:
        return await self.read_model.gguf_info(name)

    def memory_status(self) -> dict[str, Any]:
        return self.memory_loop.status()

    def prompt_cache_status(self) -> dict[str, Any]:
        return self.prompt_cache.status()

    def config_status(self) -> dict[str, Any]:
        return self.reloader.config_status()

    def reload(self, trigger: str) -> asyncio.Task[reloading.ReloadAttempt]:
        return self.reloader.reload(trigger)

    async def load(self, name: str, overrides: Mapping[str, Any] | None = None,
                   restart: bool = False) -> ModelStatus:
        return self.status(await self.admin.load(name, overrides, restart))

    async def unload(self, name: str, force: bool = False) -> ModelStatus:
        return self.status(await self.admin.unload(name, force))

    def load_soon(self, name: str) -> ModelStatus:
        return self.status(self.admin.load_soon(name))

    def unload_soon(self, name: str, *, admin: bool) -> ModelStatus:
        return self.status(self.admin.unload_soon(name, admin=admin))

    async def rebalance(self, name: str) -> ModelStatus:
        return self.status(await self.admin.rebalance(name))
