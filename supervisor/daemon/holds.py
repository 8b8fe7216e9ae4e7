"""Holds for groups: the members a group runs are held (busy) all together or not at all, so
neither TTL nor LRU stops one to make room for another of the same group."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.errors import NoCapacity, NotServed, UnknownModel
from corral.supervisor.instance import LOADED_STATES, Instance


class Hold:
    """A group's hold on its members (the port's Reservation)."""

    def __init__(self, find: Callable[[str], Instance], resolve: Callable[[str], str | None],
                 changed: Callable[[], None], names: Iterable[str]):
        self._find = find
        self._resolve = resolve
        self._changed = changed
        # The instances themselves: a reload may remove a held model from the config before
        # the group ends, and its hold must still be given back.
        self._held: dict[str, Instance] = {}
        for name in names:
            self._hold(name)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._held)

    def swap(self, failed: str, backup: str) -> None:
        """A member failed and a backup stands in: stop holding the failed one (so the backup
        can take its place under max_loaded) and hold the backup instead."""
        self.release(failed)
        with contextlib.suppress(UnknownModel):  # a reload removed it: its call says so
            self._hold(backup)

    def release(self, name: str) -> None:
        # The held name itself first: after a reload it may be an alias of another model.
        key = name if name in self._held else self._resolve(name) or name
        inst = self._held.pop(key, None)
        if inst is not None:
            inst.unhold()
            self._changed()

    def release_all(self) -> None:
        for name in list(self._held):
            self.release(name)

    def follow(self, name: str, now: Instance) -> None:
        """`name` switched over to a new child (blue/green): hold that one instead. The old
        child drains and stops; held, the new one is never stopped for another model's
        start while the group still runs."""
        inst = self._held.get(name)
        if inst is not None and inst is not now:
            self._held[name] = now
            now.hold()
            inst.unhold()

    def _hold(self, name: str) -> None:
        inst = self._find(name)
        if inst.name not in self._held:
            self._held[inst.name] = inst
            inst.hold()


class Holds:
    """The door for groups: all-or-none holds on members, and the up-front capacity check."""

    def __init__(self, herd: Herd, planner: Planner):
        self._herd = herd
        self._planner = planner
        self._live: set[Hold] = set()  # the holds of the groups running now

    def switched(self, name: str) -> None:
        """A model's new child took over from the old one: every group's hold follows it."""
        model = self._herd.models.get(name)
        if model is not None:
            for hold in self._live:
                hold.follow(name, model.primary)

    @contextlib.contextmanager
    def reserve(self, names: Iterable[str]) -> Iterator[Hold]:
        """Hold models that will be acquired together (a group's members). All or none,
        decided at once: when what is held already (by other groups) plus these plus the
        pinned models cannot be loaded together, NoCapacity now, instead of two groups each
        holding what the other needs until evict_timeout."""
        herd = self._herd
        wanted = {herd.instance(n).name for n in names}
        held_elsewhere = {m.name for m in herd.models.values() if m.primary.held > 0}
        # Remote members take no room: the policy's question is about the ones that do.
        room = {n for n in wanted | held_elsewhere if herd.instance(n).backend.spawns}
        problem = self._planner.decide("room_for", None, self._planner.snapshot(),
                                       frozenset(room)) if room else None
        if problem:
            busy = sorted(held_elsewhere - wanted)
            raise NoCapacity(
                f"{len(wanted)} models ({', '.join(sorted(wanted))}) cannot be held now: "
                f"other groups hold {', '.join(busy) or 'none'}: {problem}; retry when they "
                f"finish")
        hold = Hold(herd.instance, herd.resolve, herd.changed.fire, wanted)
        self._live.add(hold)
        try:
            yield hold
        finally:
            self._live.discard(hold)
            hold.release_all()

    def check_capacity(self, names: Iterable[str], what: str) -> None:
        """Refuse up front what max_loaded can never fit, instead of thrashing."""
        herd, planner = self._herd, self._planner
        wanted = frozenset(herd.resolve(n) or n for n in names)
        # Remote members take no room (an unknown name stays: the policy says it is unknown).
        wanted = frozenset(n for n in wanted if n not in herd.models
                           or herd.models[n].primary.backend.spawns)
        snap = planner.snapshot()
        for name in sorted(wanted):
            refusal = planner.decide("refuse", None, snap, name)
            if refusal:
                raise NotServed(f"{what}: {refusal}")
        problem = planner.decide("room_for", None, snap, wanted)
        if problem:
            loaded = sorted(m.name for m in herd.models.values()
                            if m.primary.state in LOADED_STATES)
            raise NoCapacity(f"{what} {problem}; loaded now: "
                             f"{', '.join(loaded) or 'none'}")
