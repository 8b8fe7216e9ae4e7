"""Views for the policy: the snapshot a strategy decides over (pure data), asking it, and
acting on a start it allows."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import structlog

from corral.supervisor import policy
from corral.supervisor.backends import BACKENDS
from corral.supervisor.config import ModelSpec
from corral.supervisor.instance import LOADED_STATES, Instance, State
from corral.supervisor.memory.view import Footprint

if TYPE_CHECKING:
    from corral.supervisor.daemon.core import Daemon

log = structlog.get_logger("corral.daemon")


def _snapshot(self: Daemon, now: float | None = None) -> policy.Snapshot:
    now = time.monotonic() if now is None else now
    views = tuple(self._view(i) for rs in self.models.values() for i in rs.members) \
        + tuple(policy.ModelView(
            # Left the config, still draining: it holds its room until it is gone.
            name=f"{i.name} (removed)", loaded=i.state in LOADED_STATES, stoppable=False,
            last_used=i.last_used, ttl=0, footprint=self._footprint(i),
            model=i.model if i.model in self.loaded.models else "",
        ) for i in self._retired) + tuple(dataclasses.replace(
            # A new child starting beside the old one (blue/green): its own settings.
            # An extra child, not a restart: new-load limits apply to it.
            self._view(rs.incoming), name=f"{rs.name} (new)", stoppable=False, ttl=0,
            kv_changing=False,
        ) for rs in self.models.values() if rs.incoming is not None)
    snap = self.loaded.snapshot(views, now)
    return dataclasses.replace(snap, memory=self.memory.view(self._live(), now),
                               estimate=self._estimate)

def _live(self: Daemon) -> list[Instance]:
    return [i for i in self._everyone() if i.pid is not None and i.state in LOADED_STATES]

def _view(self: Daemon, i: Instance) -> policy.ModelView:
    spec = i.spec
    rs = self.models.get(i.model)
    ladder = tuple(policy.KvCache(k, v) for k, v in self.memory.ladder(spec)) \
        if spec.kv_ladder else ()
    level = rs.kv_level if rs is not None else 0
    # A remote holds no memory and no room here: never counted against max_loaded, never
    # evicted (its state is its own business: door.py starts it without asking the policy).
    loaded = i.state in LOADED_STATES and i.backend.spawns
    footprint = self._footprint(i)
    primary = rs.primary if rs is not None else None
    restarting = primary is not None and primary.intent.restart_after_stop
    for_kv = primary is not None and primary.intent.for_kv
    if not loaded and for_kv and i is primary:
        # Stopped to restart at another KV step: its room is kept for that start, or a
        # waiting cold start would take it and the restart would fail.
        loaded = True
        footprint = self._estimate(i.name, ladder[min(level, len(ladder) - 1)]
                                   if ladder else None)
    return policy.ModelView(
        name=i.name,
        loaded=loaded,
        stoppable=i.state is State.READY and not i.busy and i.backend.spawns,
        last_used=i.last_used,
        ttl=spec.ttl,
        size_bytes=i.size_bytes,
        cache_type_k=spec.cache_type_k,
        cache_type_v=spec.cache_type_v,
        in_flight=i.in_flight,
        queued=i.queued,
        model=i.model,
        ready=i.state is State.READY,
        footprint=footprint,
        kv_ladder=ladder,
        kv_level=level,
        kv_auto=spec.kv_mode == "auto",
        kv_adaptive=spec.kv_adaptive,
        kv_hold=spec.kv_hold,
        kv_changing=for_kv or restarting or (rs is not None and rs.incoming is not None),
    )

def _footprint(self: Daemon, inst: Instance) -> Footprint:
    return self.memory.footprint(inst) if inst.state in LOADED_STATES else {}

def _estimate(self: Daemon, name: str, kv: policy.KvCache | None) -> Footprint:
    """The snapshot's estimate: what `name` (a model, a replica, "<m> (new)") takes when
    started with `kv` (None: its configured types)."""
    base = name.removesuffix(" (new)")
    inst: Instance | None
    if base != name:
        rs = self.models.get(base)
        inst = rs.incoming if rs is not None else None
    else:
        inst = self._loaded_member(base)
    if inst is None:
        return {}
    spec = inst.spec
    return self.memory.need(spec, (kv.type_k or spec.cache_type_k,
                                   kv.type_v or spec.cache_type_v) if kv else
                            (spec.cache_type_k, spec.cache_type_v))

def _begin_start(self: Daemon, inst: Instance, snap: policy.Snapshot, view_name: str,
                 reason: str = "demand") -> None:
    """Start `inst` with the KV types the strategy picks for it; it counts at its
    estimate until measured."""
    kv = self._decide("kv_cache", None, snap, view_name)
    inst.begin_start(self._http(), self._on_spawn, (kv.type_k, kv.type_v) if kv else None,
                     tune=self._tune, reason=reason)
    self.memory.started(inst)

def _tune(self: Daemon, spec: ModelSpec) -> ModelSpec:
    """The backend's last word on a start's settings, from what it needs per device
    (a vLLM child's share of the GPU)."""
    try:
        need = self.memory.need(spec, (spec.cache_type_k, spec.cache_type_v))
        return BACKENDS[spec.backend].tune(spec, need, self.memory.gpu_totals())
    except Exception:  # odd figures are no reason to refuse a start: as configured
        log.exception("daemon.tune_failed", model=spec.name)
        return spec

def _decide(self: Daemon, decision: str, fallback: Any, *args: Any) -> Any:
    """Ask the strategy. A plugin that raises must not take requests down with it: the
    error is logged (once per kind of failure) and `fallback` stands in."""
    try:
        answer = getattr(self.runtime.strategy, decision)(*args)
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        if self._strategy_failures.get(decision) != message:
            self._strategy_failures[decision] = message
            log.exception("daemon.strategy_failed", decision=decision,
                          strategy=self.loaded.config.policy.strategy)
        return fallback
    self._strategy_failures.pop(decision, None)
    return answer
