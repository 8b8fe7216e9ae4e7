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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from corral.supervisor.memory.auto_kv import choose_step
from corral.supervisor.memory.placement import GpuChoice, GpuPlacement
from corral.supervisor.memory.view import Footprint, MemoryView, mib
from corral.supervisor.plugins import PluginError, load_object

__all__ = [
    "BUILTIN", "BaseStrategy", "FixedAppliance", "Generic", "KvCache", "ModelView",
    "MultiGroup", "PinnedGroup", "Placement", "Pool", "Relief", "Snapshot", "Strategy",
    "StrategyError", "load_strategy",
]


@dataclass(frozen=True)
class KvCache:
    """KV cache types for one start; None keeps what the model's config says."""

    type_k: str | None = None
    type_v: str | None = None


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
    ready: bool = False  # serving (READY)
    # Memory it holds now, per device: measured, or the estimate while it starts.
    footprint: Footprint = field(default_factory=dict)
    # KV cache modes (memory issue): the ladder of types it may run, best first; the step it
    # runs at (adaptive downgrade moves it); whether `auto` picks the step that fits.
    kv_ladder: tuple[KvCache, ...] = ()
    kv_level: int = 0
    kv_auto: bool = False
    kv_adaptive: bool = False
    kv_hold: float = 0.0  # seconds of calm before stepping back up
    kv_changing: bool = False  # a restart for a KV change is under way
    # GPUs it may run on (pinned; empty: any) and how many it takes: exactly that many (a
    # vLLM model's tensor × pipeline parallel), 0 the fewest that fit, -1 not placed.
    gpus: tuple[str, ...] = ()
    gpu_count: int = 0


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
    # Devices, limits and watermarks (None: memory is not taken into account).
    memory: MemoryView | None = None
    # What a model would take if it started now with these KV types (a pure lookup: the
    # estimate from its file, or what the same settings measured before).
    estimate: Callable[[str, KvCache | None], Footprint] | None = None
    # The same, on the GPUs of a choice (multi-GPU placement, memory/placement.py).
    estimate_on: Callable[[str, KvCache | None, GpuChoice], Footprint] | None = None

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
    shrink: str | None = None  # step this model's KV cache down the ladder, then ask again
    reason: str | None = None  # why it does not fit, for the 503 (memory: what is missing)
    retry: bool = True  # False: waiting cannot help (too big, critical watermark): 503 now


@dataclass(frozen=True)
class Relief:
    """One thing to do about memory pressure (or its end)."""

    action: Literal["evict", "kv_down", "kv_up"]
    model: str
    reason: str
    level: int = 0  # kv_down / kv_up: the ladder step to run at


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

    # Optional (a plugin without them gets BaseStrategy's): relieve(snap) -> list[Relief],
    # what to do about memory pressure now; gpus_for (memory/placement.py).


class StrategyError(ValueError):
    """A strategy that cannot be built from the config (the message says why)."""


class BaseStrategy(GpuPlacement):
    """On demand, LRU + TTL, over pools. Subclasses override `pools` and `keep_loaded` to
    shape placement, or any single decision (`gpus_for`: which GPUs a start uses)."""

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
        """The model's step on its KV ladder: where adaptive downgrade put it, and no better
        than `auto` finds fits its budget. None without a ladder (as configured)."""
        view = snap.view(model)
        if view is None or not view.kv_ladder:
            return None
        return view.kv_ladder[self.kv_step(snap, view)]

    def kv_step(self, snap: Snapshot, view: ModelView) -> int:
        """The ladder step `view` runs at (or would start at): where adaptive downgrade put
        it, and no better than `auto` finds fits."""
        level = max(view.kv_level, self.auto_level(snap, view) if view.kv_auto else 0)
        return min(level, len(view.kv_ladder) - 1)

    def auto_level(self, snap: Snapshot, view: ModelView) -> int:
        return self.auto_choice(snap, view)[0]

    def auto_choice(self, snap: Snapshot, view: ModelView) -> tuple[int, str]:
        """`kv_cache.mode: auto`'s step, and why (memory/auto_kv.py): the best that fits the
        model's budget beside what is kept loaded there, else the best that fits it whole."""
        mem = snap.memory
        if mem is None or snap.estimate is None:
            return 0, "no memory reading yet: the ladder's top"
        pool = mem.pool_of(snap.groups, snap.model_of(view.name))
        kept = self.kept_views(snap)
        beside = {v.name: v.footprint for v in snap.loaded if v.name in kept
                  and v.name != view.name and mem.pool_of(snap.groups, snap.model_of(v.name))
                  == pool}
        labels = [f"{kv.type_k}/{kv.type_v}" for kv in view.kv_ladder]
        needs = [self.need(snap, view.name, kv) for kv in view.kv_ladder]
        return choose_step(mem, pool, labels, needs, beside)

    def need(self, snap: Snapshot, model: str, kv: KvCache | None = None,
             extra: Mapping[str, int] | None = None) -> Footprint:
        """Memory `model` takes if it starts now (with `kv`, else the KV types it would
        get), on the GPUs it would get (`extra`: see gpus_for)."""
        if snap.estimate is None:
            return {}
        kv = kv or self.kv_cache(snap, model)
        choice = self.gpus_for(snap, model, kv, extra)
        if choice is not None and snap.estimate_on is not None:
            return snap.estimate_on(model, kv, choice)
        return snap.estimate(model, kv)

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
        kept = self.kept_views(snap)
        if len(in_pool) < pool.capacity and len(loaded) < snap.max_loaded:
            return self.place_memory(snap, incoming, kept)
        # Over the pool's share: make room inside the pool. Under it but over max_loaded (a
        # removed model still draining, say): anything idle and not kept may go.
        scope = in_pool if len(in_pool) >= pool.capacity else loaded
        candidates = _evictable(snap, incoming, scope, kept)
        if candidates:
            victim = min(candidates, key=lambda v: v.last_used)
            return Placement(fits=False, evict=victim.name)
        return Placement(fits=False, blocked_by=tuple(sorted(v.name for v in scope)))

    def place_memory(self, snap: Snapshot, incoming: str, kept: frozenset[str]) -> Placement:
        """Whether `incoming`'s memory fits on every device it uses, inside its budget (its
        group's, or what the groups leave); if not, the least recently used idle model that
        holds memory there (never one with work in flight, never a kept one), else an
        adaptive model's KV step down, else what is in the way and how much is missing."""
        mem = snap.memory
        need = self.need(snap, incoming)
        if mem is None or not need:
            return Placement(fits=True)
        model = snap.model_of(incoming)
        pool = mem.pool_of(snap.groups, model)
        where = f"group {pool}'s budget" if pool else "the shared budget"
        others = [v for v in snap.loaded if v.name != incoming
                  and mem.pool_of(snap.groups, snap.model_of(v.name)) == pool]
        short: dict[str, int] = {}
        wanted: dict[str, tuple[int, int]] = {}  # device → (needed, free)
        incoming_view = snap.view(incoming)
        # A restart at another KV step frees memory rather than taking more: neither the
        # critical watermark nor the low-watermark ceiling of new loads holds it back.
        restarting = incoming_view is not None and incoming_view.kv_changing
        for device_name, bytes_needed in need.items():
            device = mem.devices.get(device_name)
            if device is None or bytes_needed <= 0:
                continue
            if device.used_pct >= mem.critical_watermark and not restarting:
                return Placement(fits=False, retry=False, reason=(
                    f"{device_name} is {device.used_pct:.0f}% used, at or above the critical "
                    f"watermark ({mem.critical_watermark:g}%): new loads are refused until "
                    f"idle models are evicted or memory is freed"))
            capacity = mem.pool_capacity(device, pool, ceiling=not restarting)
            if bytes_needed > capacity:
                return Placement(fits=False, retry=False, reason=(
                    f"{model} needs {mib(bytes_needed)} on {device_name} but {where} there "
                    f"is {mib(capacity)} with nothing else loaded (device "
                    f"{mib(device.total)}, reserve {mib(device.reserve)}, others "
                    f"{mib(device.other)}"
                    f"{f', budget {mib(device.budget)}' if device.budget is not None else ''})"))
            held = sum(v.footprint.get(device_name, 0) for v in others)
            if held + bytes_needed > capacity:
                short[device_name] = held + bytes_needed - capacity
                wanted[device_name] = (bytes_needed, max(0, capacity - held))
        if not short:
            return Placement(fits=True)
        on_short = [v for v in others if any(v.footprint.get(d, 0) > 0 for d in short)]
        idle = _evictable(snap, incoming, on_short, kept)
        if idle:
            return Placement(fits=False, evict=min(idle, key=lambda v: v.last_used).name)
        shrink = self._shrinkable(snap, on_short, short)
        if shrink is not None:
            return Placement(fits=False, shrink=shrink)
        missing = ", ".join(f"{mib(wanted[d][0])} on {d} where {where} has {mib(wanted[d][1])} "
                            f"free ({mib(n)} missing)" for d, n in short.items())

        def why(v: ModelView) -> str:
            return "kept loaded" if v.name in kept else \
                f"{v.in_flight} in flight" if v.in_flight else "busy"

        holders = ", ".join(f"{v.name} ({mib(sum(v.footprint.get(d, 0) for d in short))}, "
                            f"{why(v)})" for v in sorted(on_short, key=lambda v: v.name))
        return Placement(fits=False, blocked_by=tuple(sorted(v.name for v in on_short)),
                         reason=f"{model} needs {missing}; "
                                f"in the way: {holders or 'nothing corral can stop'}")

    def _shrinkable(self, snap: Snapshot, views: list[ModelView],
                    short: Mapping[str, int]) -> str | None:
        """An adaptive model whose next KV step down frees memory where it is short (the one
        freeing most), or None."""
        best: tuple[int, str] | None = None
        missing = sum(short.values())
        for view in views:
            saving = self._kv_saving(snap, view, short)
            # Only a step that makes the load fit: a restart that frees too little is a
            # disruption for nothing.
            if saving >= missing and (best is None or saving > best[0]):
                best = (saving, view.name)
        return best[1] if best else None

    def _kv_saving(self, snap: Snapshot, view: ModelView, devices: Iterable[str]) -> int:
        """Bytes one KV step down would free on `devices` (0: it cannot step down now)."""
        if not (view.kv_adaptive and view.ready and not view.kv_changing) \
                or snap.estimate is None:
            return 0
        step = self.kv_step(snap, view)
        if step + 1 >= len(view.kv_ladder):
            return 0
        now = snap.estimate(view.name, view.kv_ladder[step])
        lower = snap.estimate(view.name, view.kv_ladder[step + 1])
        return sum(max(0, now.get(d, 0) - lower.get(d, 0)) for d in devices)

    @staticmethod
    def _lives_on(mem: MemoryView, view: ModelView, device: str) -> bool:
        """Whether evicting `view` relieves `device`: it holds memory there, and for RAM, it
        is not a GPU model (whose host memory is small beside what stopping it costs)."""
        if view.footprint.get(device, 0) <= 0:
            return False
        if device == "cpu" and mem.budget_kind == "gpu":
            return not any(view.footprint.get(d, 0) > 0 for d, dev in mem.devices.items()
                           if dev.kind == "gpu")
        return True

    def relieve(self, snap: Snapshot) -> list[Relief]:
        """What to do about memory now. Above the low watermark: evict the least recently
        used idle model on that device (above the critical one: as many as it takes), and
        with none idle, step an adaptive model's KV cache down. After `kv_hold` seconds
        below it everywhere: step one adaptive model back up, if that keeps the device
        below the low watermark."""
        mem = snap.memory
        if mem is None:
            return []
        kept = self.kept_views(snap)
        out: list[Relief] = []
        changing = any(v.kv_changing for v in snap.models)
        for device in mem.devices.values():
            if device.used_pct < mem.low_watermark:
                continue
            critical = device.used_pct >= mem.critical_watermark
            level = f"{device.name} at {device.used_pct:.0f}% used (" + (
                f"critical watermark {mem.critical_watermark:g}%)" if critical
                else f"low watermark {mem.low_watermark:g}%)")
            excess = device.used - mem.line(device, mem.low_watermark)
            idle = sorted((v for v in snap.loaded if v.stoppable and v.name not in kept
                           and self._lives_on(mem, v, device.name)
                           and not any(r.model == v.name for r in out)),
                          key=lambda v: v.last_used)
            for view in idle:
                out.append(Relief("evict", view.name, f"memory pressure: {level}"))
                excess -= view.footprint.get(device.name, 0)
                if not critical or excess <= 0:
                    break
            if idle or changing:
                continue
            savings = [(self._kv_saving(snap, v, (device.name,)), v) for v in snap.loaded]
            best = max(savings, key=lambda c: c[0], default=None)
            if best is not None and best[0] > 0:
                out.append(Relief("kv_down", best[1].name, f"memory pressure: {level}",
                                  self.kv_step(snap, best[1]) + 1))
                changing = True
        if out or changing or snap.estimate is None:
            return out
        for view in sorted(snap.loaded, key=lambda v: -v.last_used):
            if not view.kv_ladder:
                continue
            floor = self.auto_level(snap, view) if view.kv_auto else 0
            step = self.kv_step(snap, view)
            if not (view.kv_adaptive and view.ready and step > floor
                    and mem.calm_for >= view.kv_hold):
                continue
            now = snap.estimate(view.name, view.kv_ladder[step])
            better = snap.estimate(view.name, view.kv_ladder[step - 1])
            fits = all(device.used + better.get(d, 0) - now.get(d, 0)
                       < mem.line(device, mem.low_watermark)
                       for d, device in mem.devices.items())
            if fits:
                return [Relief("kv_up", view.name,
                               f"no memory pressure for {mem.calm_for:.0f}s "
                               f"(hold {view.kv_hold:g}s)", step - 1)]
        return out

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
        return self.memory_room_for(snap, together)

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
        try:
            cls = load_object(spec, base_dir)
        except PluginError as exc:
            raise StrategyError(str(exc)) from exc
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


def _members(snap: Snapshot, groups: Iterable[str]) -> frozenset[str]:
    return frozenset(m for g in groups for m in snap.groups.get(g, ()))


def _evictable(snap: Snapshot, incoming: str, views: Sequence[ModelView],
               kept: frozenset[str]) -> list[ModelView]:
    """What may be stopped to make room for `incoming`: idle, not kept loaded, and not one of
    its own model's replicas (stopping a sibling to start a replica grows nothing)."""
    own = snap.view(incoming)
    model = own.model if own is not None and own.model else None
    return [v for v in views if v.stoppable and v.name not in kept
            and (model is None or v.model != model)]
