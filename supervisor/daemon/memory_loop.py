"""The memory loop: sample devices and children, act on what the strategy says about
pressure (evict, step a model's KV cache down or up), and the read model of /admin/memory."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from corral.supervisor import policy
from corral.supervisor import reload as reloading
from corral.supervisor.instance import LOADED_STATES, State
from corral.supervisor.instance.view import gpus_of
from corral.supervisor.memory.view import MIB

if TYPE_CHECKING:
    from corral.supervisor.daemon.core import Daemon

log = structlog.get_logger("corral.daemon")


async def _sample_memory(self: Daemon) -> None:
    """Read devices and children (in a thread: psutil walks /proc, NVML asks the driver),
    then adopt the sample on the loop."""
    children = self._live()
    sample = await asyncio.to_thread(self.memory.read, [i.pid for i in children
                                                        if i.pid is not None])
    self.memory.take(sample, children)
    for inst in children:
        if inst.state is State.READY and inst.process is not None:
            self.memory.read_log(inst, inst.process.tail(400))

async def _watch_memory(self: Daemon) -> None:
    while True:
        try:
            await self._sample_memory()
            self._relieve()
        except Exception:
            log.exception("daemon.memory_watch_failed")  # one bad sample is not the end
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._memory_wake.wait(),
                                   self.loaded.config.memory.interval)
        self._memory_wake.clear()

def _relieve(self: Daemon) -> None:
    """Act on what the strategy says about memory pressure (or its end)."""
    if self._closing:
        return
    snap = self._snapshot()
    strategy = self.runtime.strategy
    decide = "relieve" if callable(getattr(strategy, "relieve", None)) else None
    reliefs = self._decide(decide, [], snap) if decide else policy.Generic().relieve(snap)
    for relief in reliefs or []:
        if relief.action == "evict":
            inst = self._loaded_member(relief.model)
            if inst is None or inst.state is not State.READY or inst.busy or inst.pinned:
                continue  # a strategy may only evict what is idle and not kept
            log.info("daemon.memory_evict", model=inst.name, pid=inst.pid,
                     reason=relief.reason)
            inst.begin_stop(f"evicted: {relief.reason}", cause="memory")
        elif relief.action in ("kv_down", "kv_up"):
            view = snap.view(relief.model)
            model = view.model if view is not None and view.model else relief.model
            if self._kv_configured(model):
                self._change_kv(model, relief.level, relief.reason)

def _kv_configured(self: Daemon, model: str) -> bool:
    rs = self.models.get(model)
    return rs is not None and bool(rs.spec.kv_ladder)

def _change_kv(self: Daemon, model: str, level: int, reason: str) -> None:
    """Run `model` at another step of its KV ladder: the child restarts with it. When the
    strategy finds room for the new child beside the old one, the new one starts first
    (blue/green); otherwise the old one drains (its requests finish, new ones queue) and
    restarts in place. Logged with the reason and counted."""
    rs = self.models[model]
    inst = rs.primary
    ladder = self.memory.ladder(inst.spec)
    level = max(0, min(level, len(ladder) - 1))
    running = (inst.started_with.cache_type_k, inst.started_with.cache_type_v)
    old = ladder.index(running) if running in ladder else rs.kv_level
    if level == old or inst.state is not State.READY or inst.intent.restart_after_stop \
            or rs.incoming is not None or inst.intent.for_kv:
        return  # one change at a time, on a serving child
    rs.kv_level = level
    direction = "down" if level > old else "up"
    self.memory.count_kv_change(model, direction)
    log.warning("daemon.kv_cache_changed", model=model, pid=inst.pid, direction=direction,
                old="/".join(ladder[old]), new="/".join(ladder[level]), reason=reason)
    # A restart to change the KV cache frees memory: the critical watermark, which
    # refuses new loads, must not refuse it (cleared once it is serving again).
    inst.intent.for_kv = True
    drain = self.loaded.config.shutdown_grace
    change = reloading.ModelChange(model, inst.spec, ("kv_cache",))
    if self._begin_switch_over(rs, change, inst.backend, drain):
        return
    why = f"KV cache {direction} to {'/'.join(ladder[level])}: {reason}"
    for replica in rs.members:
        if replica.state in LOADED_STATES:
            replica.begin_stop(why, drain=drain, cause="kv")
    self._restart_after(rs)

def memory_status(self: Daemon) -> dict[str, Any]:
    """The read model of GET /admin/memory."""
    now = time.monotonic()
    view = self.memory.view(self._live(), now)
    cfg = self.loaded.config.memory
    devices = []
    for d in (view.devices.values() if view else ()):
        devices.append({
            "name": d.name, "kind": d.kind, "total_mib": _mib(d.total),
            "used_mib": _mib(d.used), "free_mib": _mib(max(0, d.total - d.used)),
            "used_pct": round(d.used_pct, 1), "corral_mib": _mib(d.ours),
            "other_mib": _mib(d.other), "reserved_mib": _mib(d.reserve),
            "budget_mib": _mib(d.budget) if d.budget is not None else None,
            "capacity_mib": _mib(d.capacity),
            "pressure": "critical" if d.used_pct >= cfg.critical_watermark else
                        "low" if d.used_pct >= cfg.low_watermark else "none"})
    models = []
    for rs in self.models.values():
        for inst in [*rs.members, *([rs.incoming] if rs.incoming is not None else [])]:
            spec = inst.spec
            models.append({
                "name": inst.name, "state": str(inst.state), "pid": inst.pid,
                "gpus": gpus_of(inst),
                **self.memory.describe(inst),
                "footprint_mib": {d: _mib(b) for d, b in self._footprint(inst).items()},
                "cache_type_k": inst.started_with.cache_type_k or "f16",
                "cache_type_v": inst.started_with.cache_type_v or "f16",
                "kv_cache": {
                    "mode": spec.kv_mode, "adaptive": spec.kv_adaptive,
                    "hold": spec.kv_hold,
                    "ladder": ["/".join(step) for step in self.memory.ladder(spec)],
                    "level": rs.kv_level, "changes": self.memory.kv_changes.get(
                        inst.model, {"down": 0, "up": 0}),
                } if spec.kv_ladder else None,
            })
    sample = self.memory.sample
    return {
        "devices": devices,
        "watermarks": {"low": cfg.low_watermark, "critical": cfg.critical_watermark},
        "reserve_mb": cfg.reserve_mb, "budget_mb": cfg.budget_mb,
        "budgets_mb": dict(cfg.budgets),
        "calm_for": round(view.calm_for, 1) if view else None,
        "sampled_ago": round(now - sample.at, 2) if sample else None,
        "gpu_reader": cfg.gpu_reader, "gpu_placement": cfg.gpu_placement,
        "models": models,
    }


def _mib(n: int) -> float:
    return round(n / MIB, 1)
