"""Strategies: pure decisions over a snapshot of state (what loads at boot and stays, what may
load on demand, what to evict, what has expired, which KV cache types a start uses).

No I/O and no clocks of their own: the daemon builds a `Snapshot` and acts on the answers, so
every rule here is a plain function call in a unit test.

A strategy is any object with the methods of `Strategy`; `BaseStrategy` implements all of them
with today's on-demand LRU + TTL behaviour over "pools" (sets of models that share a number of
load slots), so a plugin overrides only the decision it changes. Plugins are named in the config
as `plugin:package.module:Class`, `plugin:path/to/file.py:Class` (relative to the config file),
or by the name of an entry point in the group `corral.strategies`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BUILTIN", "BaseStrategy", "FixedAppliance", "Generic", "KvCache", "ModelView",
    "MultiGroup", "PinnedGroup", "Placement", "Pool", "Snapshot", "Strategy", "StrategyError",
    "load_strategy",
]


@dataclass(frozen=True)
class ModelView:
    name: str
    loaded: bool  # holds memory: starting, ready, draining or stopping
    stoppable: bool  # ready and neither in flight, queued nor held by a group
    last_used: float  # monotonic
    ttl: float  # 0 = never expires
    size_bytes: int = 0  # the model file(s) on disk: a first guess at the memory it takes
    cache_type_k: str | None = None  # as configured
    cache_type_v: str | None = None
    in_flight: int = 0
    queued: int = 0
    model: str = ""  # the configured model; a replica's view is named "<model>#<n>"


@dataclass(frozen=True)
class Snapshot:
    """What a strategy sees: every model, the configured groups, the load limit, the time,
    and the strategy's own settings (`policy.options`)."""

    models: tuple[ModelView, ...]
    groups: Mapping[str, tuple[str, ...]]
    max_loaded: int
    now: float
    pinned: frozenset[str] = frozenset()  # members of groups marked `pinned: true`
    options: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def _by_name(self) -> dict[str, ModelView]:
        return {v.name: v for v in self.models}

    def view(self, name: str) -> ModelView | None:
        # By name, built once per snapshot: placement looks up every loaded model's pool.
        return self._by_name.get(name)

    def model_of(self, name: str) -> str:
        """The configured model behind a view's name (itself, unless it is a replica)."""
        found = self.view(name)
        return found.model if found is not None and found.model else name

    @property
    def loaded(self) -> list[ModelView]:
        return [v for v in self.models if v.loaded]


@dataclass(frozen=True)
class Placement:
    """Answer to "may `incoming` start now?"."""

    fits: bool
    evict: str | None = None  # stop this one first, then ask again
    blocked_by: tuple[str, ...] = ()  # loaded models that cannot be evicted right now


@dataclass(frozen=True)
class KvCache:
    """KV cache types for one start; None keeps what the model's config says."""

    type_k: str | None = None
    type_v: str | None = None


@dataclass(frozen=True)
class Pool:
    """Models that share `capacity` load slots; `members` None is everything in no other pool."""

    name: str
    members: frozenset[str] | None
    capacity: int


@runtime_checkable
class Strategy(Protocol):
    """The decisions corral asks a strategy for. Each is called with a fresh snapshot and must
    not block or do I/O: the daemon calls them on its event loop, between a decision and the
    action on it."""

    def keep_loaded(self, snap: Snapshot) -> frozenset[str]:
        """Models that load at boot (and after a reload) and stay: never evicted, never
        expired, restarted when they fail."""
        ...

    def refuse(self, snap: Snapshot, model: str) -> str | None:
        """None when `model` may be loaded on demand; otherwise why not (the client gets a
        503 carrying it)."""
        ...

    def place(self, snap: Snapshot, incoming: str) -> Placement:
        """Whether `incoming` starts now, or which loaded model to stop first."""
        ...

    def room_for(self, snap: Snapshot, models: frozenset[str]) -> str | None:
        """None when every model in `models` can be loaded at the same time (a group's
        members, with what other groups hold); otherwise why not."""
        ...

    def expired(self, snap: Snapshot) -> list[str]:
        """Loaded models to stop now because they idled too long."""
        ...

    def next_expiry(self, snap: Snapshot) -> float | None:
        """Seconds until `expired` could next name a model (None: nothing will)."""
        ...

    def kv_cache(self, snap: Snapshot, model: str) -> KvCache | None:
        """KV cache types for the start of `model` about to happen (None: as configured)."""
        ...


class StrategyError(ValueError):
    """A strategy that cannot be built from the config (the message says why)."""


class BaseStrategy:
    """On demand, LRU + TTL, over pools. Subclasses override `pools` and `keep_loaded` to
    shape placement, or any single decision."""

    name = "generic"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    # -- what subclasses usually change ----------------------------------------------------------

    def pools(self, snap: Snapshot) -> list[Pool]:
        return [Pool("all", None, snap.max_loaded)]

    def keep_loaded(self, snap: Snapshot) -> frozenset[str]:
        return snap.pinned

    def refuse(self, snap: Snapshot, model: str) -> str | None:
        pool = self.pool_of(snap, model)
        if pool.capacity <= 0:
            return f"{model} has no room under strategy {self.name} (pool {pool.name} holds 0)"
        return None

    def kv_cache(self, snap: Snapshot, model: str) -> KvCache | None:
        return None

    # -- derived decisions -------------------------------------------------------------------------

    def pool_of(self, snap: Snapshot, model: str, pools: list[Pool] | None = None) -> Pool:
        model = snap.model_of(model)
        pools = self.pools(snap) if pools is None else pools
        for pool in pools:
            if pool.members is not None and model in pool.members:
                return pool
        rest = next((p for p in pools if p.members is None), None)
        return rest or Pool("rest", None, 0)

    def place(self, snap: Snapshot, incoming: str) -> Placement:
        """LRU by last use among loaded, idle models of the incoming model's pool that are not
        kept loaded; never a model with work in flight."""
        pools = self.pools(snap)  # once: a strategy may build them from the snapshot
        pool = self.pool_of(snap, incoming, pools)
        loaded = [v for v in snap.models if v.loaded and v.name != incoming]
        in_pool = [v for v in loaded if self.pool_of(snap, v.name, pools) == pool]
        if len(in_pool) < pool.capacity and len(loaded) < snap.max_loaded:
            return Placement(fits=True)
        kept = self.kept_views(snap)
        # Over the pool's share: make room inside the pool. Under it but over max_loaded (a
        # removed model still draining, say): anything idle and not kept may go.
        scope = in_pool if len(in_pool) >= pool.capacity else loaded
        candidates = [v for v in scope if v.stoppable and v.name not in kept]
        if candidates:
            victim = min(candidates, key=lambda v: v.last_used)
            return Placement(fits=False, evict=victim.name)
        return Placement(fits=False, blocked_by=tuple(sorted(v.name for v in scope)))

    def kept_views(self, snap: Snapshot) -> frozenset[str]:
        """The views of what is kept loaded: a kept model's replicas are kept too."""
        kept = self.keep_loaded(snap)
        return frozenset(v.name for v in snap.models if (v.model or v.name) in kept)

    def room_for(self, snap: Snapshot, models: frozenset[str]) -> str | None:
        kept = self.keep_loaded(snap)
        together = models | kept
        pools = self.pools(snap)
        if len(pools) > 1:  # the most specific reason first
            for pool in pools:
                members = {m for m in together if self.pool_of(snap, m, pools) == pool}
                if len(members) > pool.capacity:
                    return (f"needs {len(members)} models loaded at once in pool {pool.name} "
                            f"({', '.join(sorted(members))}) but it holds {pool.capacity}")
        if len(together) > snap.max_loaded:
            others = kept - models
            held = f" and {len(others)} kept loaded ({', '.join(sorted(others))})" \
                if others else ""
            return (f"needs {len(models)} models loaded at once ({', '.join(sorted(models))})"
                    f"{held} but max_loaded is {snap.max_loaded}")
        return None

    def expired(self, snap: Snapshot) -> list[str]:
        kept = self.kept_views(snap)
        return [v.name for v in snap.models
                if v.loaded and v.stoppable and v.name not in kept and v.ttl > 0
                and snap.now - v.last_used >= v.ttl]

    def next_expiry(self, snap: Snapshot) -> float | None:
        kept = self.kept_views(snap)
        waits = [v.ttl - (snap.now - v.last_used) for v in snap.models
                 if v.loaded and v.stoppable and v.name not in kept and v.ttl > 0]
        return max(0.0, min(waits)) if waits else None


class Generic(BaseStrategy):
    """On demand, LRU + TTL; groups marked `pinned: true` stay loaded."""

    name = "generic"



class PinnedGroup(BaseStrategy):
    """The groups named in `policy.groups` stay loaded; other models load on demand, LRU + TTL,
    in what is left."""

    name = "pinned-group"

    def keep_loaded(self, snap: Snapshot) -> frozenset[str]:
        return snap.pinned | _members(snap, self.options.get("groups", ()))


class MultiGroup(BaseStrategy):
    """Several groups, each with its own share of load slots (`policy.shares`); a group's
    members load, stay and swap only inside its share, so loading for one group never evicts
    another's. Models in no group share what max_loaded leaves."""

    name = "multi-group"

    def _shares(self) -> dict[str, int]:
        return dict(self.options.get("shares", {}))

    def pools(self, snap: Snapshot) -> list[Pool]:
        shares = self._shares()
        pools = [Pool(g, frozenset(snap.groups.get(g, ())), n) for g, n in shares.items()]
        return [*pools, Pool("rest", None, max(0, snap.max_loaded - sum(shares.values())))]

    def keep_loaded(self, snap: Snapshot) -> frozenset[str]:
        # A share as big as its group keeps every member up; a smaller one swaps within
        # itself, so its members load on demand.
        return snap.pinned | frozenset(
            m for g, n in self._shares().items()
            if len(snap.groups.get(g, ())) <= n for m in snap.groups.get(g, ()))


class FixedAppliance(BaseStrategy):
    """Everything listed (`policy.models`, default every model) loads at boot and stays; no
    TTL; nothing else is ever loaded."""

    name = "fixed-appliance"

    def _fixed(self, snap: Snapshot) -> frozenset[str]:
        listed = self.options.get("models")
        return frozenset(listed) if listed else frozenset(
            v.model or v.name for v in snap.models if not v.name.endswith(" (removed)"))

    def keep_loaded(self, snap: Snapshot) -> frozenset[str]:
        return self._fixed(snap)

    def refuse(self, snap: Snapshot, model: str) -> str | None:
        fixed = self._fixed(snap)
        if model in fixed:
            return None
        return (f"this appliance serves a fixed set of models ({', '.join(sorted(fixed))}); "
                f"{model} is not loaded on demand")

    def expired(self, snap: Snapshot) -> list[str]:
        return []

    def next_expiry(self, snap: Snapshot) -> float | None:
        return None


BUILTIN: dict[str, type[BaseStrategy]] = {
    cls.name: cls for cls in (Generic, PinnedGroup, MultiGroup, FixedAppliance)}

ENTRY_POINT_GROUP = "corral.strategies"
_REQUIRED = ("keep_loaded", "refuse", "place", "room_for", "expired", "next_expiry",
             "kv_cache")


def load_strategy(spec: str, options: Mapping[str, Any], base_dir: Path) -> Strategy:
    """Build the strategy `spec` names: a built-in name, `plugin:module:Class`,
    `plugin:file.py:Class` or an entry point name. StrategyError says what went wrong."""
    if spec in BUILTIN:
        return BUILTIN[spec](options)
    if spec.startswith("plugin:"):
        target, sep, attr = spec.removeprefix("plugin:").rpartition(":")
        if not sep or not target or not attr:
            raise StrategyError(f"expected plugin:package.module:Class or plugin:file.py:Class, "
                                f"got {spec!r}")
        cls = getattr(_import(target, base_dir), attr, None)
        if cls is None:
            raise StrategyError(f"{target} has no attribute {attr!r}")
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            known = sorted({*BUILTIN, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
            raise StrategyError(f"unknown strategy {spec!r}; known: {', '.join(known)}, or "
                                f"plugin:package.module:Class")
        try:
            cls = found[0].load()
        except Exception as exc:
            raise StrategyError(f"entry point {spec!r} failed to load: {exc}") from exc
    try:
        strategy = cls(options)
    except Exception as exc:
        raise StrategyError(f"{spec}: building the strategy failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    missing = [m for m in _REQUIRED if not callable(getattr(strategy, m, None))]
    if missing:
        raise StrategyError(f"{spec} is not a strategy: it lacks {', '.join(missing)} "
                            f"(subclass corral.supervisor.policy.BaseStrategy)")
    return strategy  # type: ignore[no-any-return]


def _import(target: str, base_dir: Path) -> Any:
    if target.endswith(".py"):
        path = Path(target).expanduser()
        path = path if path.is_absolute() else (base_dir / path).resolve()
        if not path.is_file():
            raise StrategyError(f"plugin file {path} does not exist")
        # A name of its own per file, so two plugin files never share a module.
        module_name = f"corral_plugin_{abs(hash(str(path)))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise StrategyError(f"cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise StrategyError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise StrategyError(f"cannot import {target}: {type(exc).__name__}: {exc}") from exc


def _members(snap: Snapshot, groups: Iterable[str]) -> frozenset[str]:
    return frozenset(m for g in groups for m in snap.groups.get(g, ()))
