"""One configured model's instances: replica 1 (named like the model), replicas 2..max, the
new child of a blue/green switch-over, and the per-model facts the daemon decides with."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from corral.supervisor.backends.base import Backend
from corral.supervisor.config import ModelSpec
from corral.supervisor.instance import Instance, State

NewInstance = Callable[[ModelSpec, Backend, int], Instance]
Retire = Callable[[Instance, str], None]


class ReplicaSet:
    def __init__(self, primary: Instance, new_instance: NewInstance):
        self.primary = primary
        self.extra: list[Instance] = []  # replicas 2..max, not routable by name
        # Blue/green: the new child of a model whose settings changed, starting beside the
        # primary that still serves; it becomes the primary once ready.
        self.incoming: Instance | None = None
        self.kv_level = 0  # the KV ladder step the model runs at (0: its best)
        self.evicting_for: Instance | None = None  # the idle one stopped to make room for it
        self._new_instance = new_instance

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

    def state(self) -> State:
        """Over its replicas: ready when any serves, starting while one starts."""
        states = {m.state for m in self.members}
        return State.READY if State.READY in states else \
            State.STARTING if State.STARTING in states else self.primary.state

    def up(self) -> list[Instance]:
        return [r for r in self.members if r.state in (State.STARTING, State.READY)]

    def least_busy(self) -> Instance | None:
        best: Instance | None = None
        for replica in self.members:
            if replica.state is State.READY and not replica.slots_full and (
                    best is None or replica.in_flight < best.in_flight):
                best = replica
        return best

    def fit(self, drain: float, retire: Retire, fresh_start: bool = False) -> None:
        """Give the model the replicas its spec asks for: new ones start cold; ones past
        replicas.max drain and stop (handed to `retire`)."""
        spec, backend = self.primary.spec, self.primary.backend
        want = spec.replicas_max - 1
        for replica in self.extra[want:]:
            replica.begin_stop("replicas lowered by a reload", drain=drain, cause="scale_down")
            retire(replica, "scaled down")
        extra = self.extra[:want]
        for number in range(len(extra) + 2, want + 2):
            extra.append(self._new_instance(spec, backend, number))
        for replica in extra:
            if replica.spec is not spec:
                replica.reconfigure(spec, backend, fresh_start=fresh_start)
        self.extra = extra

    def mark_kept(self, kept: bool) -> None:
        """What the strategy keeps loaded: the model, and the replicas it loads with."""
        for replica in self.members:
            replica.set_pinned(kept and replica.replica <= replica.spec.replicas_min)
