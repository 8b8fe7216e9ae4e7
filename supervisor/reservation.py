"""A group's hold on its members: held models count as busy, so neither TTL nor LRU stops one
to make room for another member of the same group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from corral.supervisor.daemon import Daemon


class Reservation:
    def __init__(self, daemon: Daemon, names: Iterable[str]):
        self._daemon = daemon
        self._held: set[str] = set()
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
        canonical = self._daemon.instance(name).name
        if canonical in self._held:
            self._held.discard(canonical)
            self._daemon.instances[canonical].held -= 1
            self._daemon.notify_change()

    def release_all(self) -> None:
        for name in list(self._held):
            self.release(name)

    def _hold(self, name: str) -> None:
        inst = self._daemon.instance(name)
        if inst.name not in self._held:
            self._held.add(inst.name)
            inst.held += 1
