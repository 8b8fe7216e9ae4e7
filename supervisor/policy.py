"""Pure decisions over a snapshot of instance state: what to evict, what has expired.

No I/O and no clocks of its own: the daemon passes a snapshot and `now`, so every rule here is
a plain function call in a unit test.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelView:
    name: str
    loaded: bool  # holds memory: starting, ready, draining or stopping
    stoppable: bool  # ready and neither in flight nor queued
    last_used: float  # monotonic
    ttl: float  # 0 = never expires
    pinned: bool = False


@dataclass(frozen=True)
class Placement:
    """Answer to "may `incoming` start now?"."""

    fits: bool
    evict: str | None = None  # stop this one first, then ask again
    blocked_by: tuple[str, ...] = ()  # loaded models that cannot be evicted right now


def place(views: Iterable[ModelView], incoming: str, max_loaded: int) -> Placement:
    """LRU by last use among loaded, idle, unpinned models; never a model with work in flight."""
    loaded = [v for v in views if v.loaded and v.name != incoming]
    if len(loaded) < max_loaded:
        return Placement(fits=True)
    candidates = [v for v in loaded if v.stoppable and not v.pinned]
    if candidates:
        victim = min(candidates, key=lambda v: v.last_used)
        return Placement(fits=False, evict=victim.name)
    return Placement(fits=False, blocked_by=tuple(sorted(v.name for v in loaded)))


def expired(views: Iterable[ModelView], now: float) -> list[str]:
    """Models idle for at least their TTL. Pinned and in-use models never expire."""
    return [v.name for v in views
            if v.stoppable and not v.pinned and v.ttl > 0 and now - v.last_used >= v.ttl]


def next_expiry(views: Iterable[ModelView], now: float) -> float | None:
    """Seconds until the next TTL could fire, so the sweeper sleeps exactly that long."""
    waits = [v.ttl - (now - v.last_used) for v in views
             if v.stoppable and not v.pinned and v.ttl > 0]
    return max(0.0, min(waits)) if waits else None
