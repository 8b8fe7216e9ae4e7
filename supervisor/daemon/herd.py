"""The herd: the config in force, every configured model (by name), the instances that left
the config but still drain, and the one 'something changed' every waiter awaits. The one
place these live; every part of the daemon reads them here, and only the reloader replaces
the config and the models."""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from corral.supervisor.config import LoadedConfig
from corral.supervisor.errors import UnknownModel
from corral.supervisor.events import EventBus
from corral.supervisor.instance import LOADED_STATES, Changed, Instance
from corral.supervisor.model import Model
from corral.supervisor.runtime import Runtime
from corral.supervisor.statefile import ChildRegistry

log = structlog.get_logger("corral.daemon")


class Herd:
    def __init__(self, loaded: LoadedConfig, runtime: Runtime, events: EventBus,
                 registry: ChildRegistry):
        self.loaded = loaded  # the config in force (the reloader replaces it)
        self.runtime = runtime  # what the config names, built: strategy, GPU reader, kept
        self.events = events
        self.models: dict[str, Model] = {}
        # Instances that left the config (removed, scaled down, replaced) but still drain:
        # their children hold memory and serve streams until their stops end.
        self.retired: set[Instance] = set()
        self.changed = Changed()
        self.closing = False
        self._registry = registry

    # -- lookups -------------------------------------------------------------------------------

    def resolve(self, name: str) -> str | None:
        """Canonical model name for a name or alias, or None."""
        if name in self.models:
            return name
        return self.loaded.aliases.get(name)

    def model(self, name: str) -> Model:
        canonical = self.resolve(name)
        if canonical is None:
            raise UnknownModel(name, sorted(self.models))
        return self.models[canonical]

    def instance(self, name: str) -> Instance:
        """The primary instance of a model (by name or alias). Raises UnknownModel."""
        return self.model(name).primary

    def member(self, key: str) -> Instance:
        """An instance by its own name: a model (or alias), or one replica ("<model>#<n>")."""
        model, sep, number = key.rpartition("#")
        if sep and number.isdigit() and model in self.models:
            found = self.models[model].member(key)
            if found is not None:
                return found
        return self.instance(key)

    def loaded_member(self, key: str) -> Instance | None:
        """The configured instance (a model or one replica) a strategy named, if any."""
        try:
            return self.member(key)
        except UnknownModel:
            return None

    def configured(self, inst: Instance) -> bool:
        """Whether `inst` is still one of the config's (a reload may have removed it)."""
        model = self.models.get(inst.model)
        return model is not None and model.holds(inst)

    def everyone(self) -> list[Instance]:
        """Every instance that may hold a child: the configured ones, the new children of
        switch-overs, and those that left the config but still drain."""
        return [*(i for m in self.models.values() for i in m.everyone()), *self.retired]

    def live(self) -> list[Instance]:
        return [i for i in self.everyone() if i.pid is not None and i.state in LOADED_STATES]

    def mark_kept(self, kept: Iterable[str]) -> None:
        names = frozenset(kept)
        for name, model in self.models.items():
            model.mark_kept(name in names)

    def drain_seconds(self) -> float:
        return self.loaded.config.shutdown_grace

    # -- children ------------------------------------------------------------------------------

    def persist_children(self) -> None:
        self._registry.record([(i.name, i.pid) for i in self.everyone()
                               if i.pid is not None and i.state in LOADED_STATES])

    def on_spawn(self, _inst: Instance) -> None:
        self.persist_children()  # raising here fails the start and stops the child

    def retire(self, inst: Instance, why: str) -> None:
        """Keep an instance that left the config (its child holds memory, its streams run)
        until its stop is done."""
        def gone() -> None:
            self.retired.discard(inst)
            self.changed.fire()

        if inst.when_stopped(gone):
            self.retired.add(inst)
            log.info("daemon.retiring", model=inst.model, instance=inst.name, pid=inst.pid,
                     why=why)
