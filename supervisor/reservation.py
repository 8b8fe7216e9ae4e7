"""A group's hold on its members: held models count as busy, so neither TTL nor LRU stops one
to make room for another member of the same group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.supervisor.daemon import Daemon
    from corral.supervisor.instance import Instance


class Reservation:
    def __init__(self, daemon: Daemon, names: Iterable[str]):
        self._daemon = daemon
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
        self._hold(backup)

    def release(self, name: str) -> None:
        # The held name itself first: after a reload it may be an alias of another model.
        key = name if name in self._held else self._daemon.resolve(name) or name
        inst = self._held.pop(key, None)
        if inst is not None:
            inst.held -= 1
            self._daemon.notify_change()

    def release_all(self) -> None:
        for name in list(self._held):
            self.release(name)

    def _hold(self, name: str) -> None:
        inst = self._daemon.instance(name)
        if inst.name not in self._held:
            self._held[inst.name] = inst
            inst.held += 1
