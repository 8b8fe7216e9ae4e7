"""The models' host: what a model's state machine asks of the daemon (new instances, room for a
child beside the one that serves, the door, retiring a child), and the KV step, a model
transition the memory loop and the door ask for."""

from __future__ import annotations

import structlog

from corral.supervisor.backends import BACKENDS
from corral.supervisor.backends.base import Backend
from corral.supervisor.config import ModelSpec
from corral.supervisor.daemon.door import Door
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.holds import Holds
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.events import EventBus
from corral.supervisor.instance import Instance, State
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.model import Model, ModelState
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.deploy import RpcDeployer

log = structlog.get_logger("corral.daemon")


class Lifecycle:
    def __init__(self, herd: Herd, planner: Planner, memory: MemoryTracker, *,
                 keeper: GroupKeeper, deployer: RpcDeployer, events: EventBus,
                 prompt_cache: PromptCache, holds: Holds):
        self._herd = herd
        self._holds = holds  # groups' holds on members: they follow a switch-over
        self._planner = planner
        self._memory = memory
        self._keeper = keeper
        self._deployer = deployer
        self._events = events
        self._prompt_cache = prompt_cache
        self.door = Door(herd, planner, self.step_kv)

    def new_model(self, spec: ModelSpec) -> Model:
        return Model(spec, BACKENDS[spec.backend], self)

    # -- the Host a model asks -----------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._herd.closing

    def drain_seconds(self) -> float:
        return self._herd.drain_seconds()

    def configured(self, model: Model) -> bool:
        return self._herd.models.get(model.name) is model

    def new_instance(self, spec: ModelSpec, backend: Backend, replica: int) -> Instance:
        return Instance(spec, backend, self._herd.changed.fire, replica=replica,
                        keeper=self._keeper, deployer=self._deployer, events=self._events,
                        prompt_cache=self._prompt_cache)

    def retire(self, inst: Instance, why: str) -> None:
        self._herd.retire(inst, why)

    def start_beside(self, model: Model, fresh: Instance, reason: str) -> bool:
        """Start `fresh` (the model's `incoming`) when the strategy finds room for it beside
        the child that serves, without evicting anything."""
        snap = self._planner.snapshot()
        view = f"{model.name} (new)"
        placement = self._planner.decide("place", None, snap, view)
        if placement is None or not placement.fits:
            return False
        self._planner.begin_start(fresh, snap, view, reason=reason)
        return True

    async def bring_up(self, model: Model, ignore_backoff: bool) -> None:
        await self.door.bring_up(model, ignore_backoff)

    async def start_member(self, model: Model, inst: Instance) -> None:
        await self.door.start_member(model, inst)

    def switched(self, model: Model) -> None:
        self._holds.switched(model.name)
        self._herd.persist_children()
        self._herd.changed.fire()

    # -- KV steps ------------------------------------------------------------------------------

    def step_kv(self, name: str, level: int, reason: str) -> None:
        """Run `name` at another step of its KV ladder: the child restarts with it. When the
        strategy finds room for the new child beside the old one, the new one starts first
        (blue/green); otherwise the old one drains (its requests finish, new ones queue) and
        restarts in place. One change at a time, on a serving child, never over a reload's
        restart or switch-over. Logged with the reason and counted."""
        model = self._herd.models.get(name)
        if model is None or not model.spec.kv_ladder:
            return
        inst = model.primary
        ladder = self._memory.ladder(inst.spec)
        level = max(0, min(level, len(ladder) - 1))
        running = (inst.started_with.cache_type_k, inst.started_with.cache_type_v)
        old = ladder.index(running) if running in ladder else model.kv_level
        if level == old or inst.state is not State.READY or model.operation is not None \
                or model.down:
            return
        model.kv_level = level
        direction = "down" if level > old else "up"
        self._memory.count_kv_change(name, direction)
        log.warning("daemon.kv_cache_changed", model=name, pid=inst.pid, direction=direction,
                    old="/".join(ladder[old]), new="/".join(ladder[level]), reason=reason)
        if model.switch_over(inst.spec, inst.backend, ("kv_cache",),
                             kind=ModelState.STEPPING_KV):
            return
        model.restart(f"KV cache {direction} to {'/'.join(ladder[level])}: {reason}",
                      cause="kv", kind=ModelState.STEPPING_KV)
