"""The memory loop: sample devices and children, act on what the strategy says about
pressure (evict, step a model's KV cache down or up), and the read model of /admin/memory."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog

from corral.supervisor import policy
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.instance import State
from corral.supervisor.instance.view import gpus_of
from corral.supervisor.memory.tracker import MemoryTracker
from corral.supervisor.memory.view import MIB

log = structlog.get_logger("corral.daemon")

StepKv = Callable[[str, int, str], None]
# How long one read of the devices may take before the loop goes on without it: a driver that
# hangs (NVML, amdsmi, a plugin's reader) must not stop start-up or every later sample.
SAMPLE_TIMEOUT_S = 10.0


class MemoryLoop:
    def __init__(self, herd: Herd, planner: Planner, memory: MemoryTracker, step_kv: StepKv):
        self._herd = herd
        self._planner = planner
        self._memory = memory
        self._step_kv = step_kv
        self._wake = asyncio.Event()
        self._reading: asyncio.Future[Any] | None = None

    def wake(self) -> None:
        """New limits apply at once, not at the next sample."""
        self._wake.set()

    async def sample(self) -> None:
        """Read devices and children (in a thread: psutil walks /proc, NVML asks the driver),
        then adopt the sample on the loop. Room may have come or gone: waiters look again."""
        children = self._herd.live()
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(asyncio.to_thread(
                self._memory.read, [i.pid for i in children if i.pid is not None]))
            # A read that ends after its waiter gave up is nobody's: its error is dropped here.
            self._reading.add_done_callback(
                lambda done: done.cancelled() or done.exception())
        # One read at a time: a hung one is waited on again, never joined by a second thread.
        try:
            async with asyncio.timeout(SAMPLE_TIMEOUT_S):
                sample = await asyncio.shield(self._reading)
        except TimeoutError:
            raise TimeoutError(f"reading memory took over {SAMPLE_TIMEOUT_S:g}s (a device "
                               "driver not answering); corral goes on with the last "
                               "sample") from None
        self._memory.take(sample, children)
        for inst in children:
            if inst.state is State.READY and inst.process is not None:
                self._memory.read_log(inst, inst.process.tail(400))
        self._herd.changed.fire()

    async def run(self) -> None:
        while True:
            try:
                await self.sample()
                self.relieve()
            except TimeoutError as exc:
                log.warning("daemon.memory_read_slow", error=str(exc))
            except Exception:
                log.exception("daemon.memory_watch_failed")  # one bad sample is not the end
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._herd.loaded.config.memory.interval):
                    await self._wake.wait()
            self._wake.clear()

    def relieve(self) -> None:
        """Act on what the strategy says about memory pressure (or its end)."""
        herd, planner = self._herd, self._planner
        if herd.closing:
            return
        sample = self._memory.sample
        if sample is not None and sample.stale:
            # A GPU the reader could not read is at figures that may be long gone: evicting
            # or stepping KV on them would act on memory since freed (as while it hangs).
            return
        snap = planner.snapshot()
        strategy = herd.runtime.strategy
        decide = "relieve" if callable(getattr(strategy, "relieve", None)) else None
        reliefs = planner.decide(decide, [], snap) if decide else policy.Generic().relieve(snap)
        for relief in reliefs or []:
            if relief.action == "evict":
                inst = herd.loaded_member(relief.model)
                if inst is None or inst.state is not State.READY or inst.busy or inst.pinned:
                    continue  # a strategy may only evict what is idle and not kept
                log.info("daemon.memory_evict", model=inst.name, pid=inst.pid,
                         reason=relief.reason)
                inst.begin_stop(f"evicted: {relief.reason}", cause="memory")
            elif relief.action in ("kv_down", "kv_up"):
                view = snap.view(relief.model)
                model = view.model if view is not None and view.model else relief.model
                self._step_kv(model, relief.level, relief.reason)

    def status(self) -> dict[str, Any]:
        """The read model of GET /admin/memory."""
        now = time.monotonic()
        memory = self._memory
        view = memory.view(self._herd.live(), now)
        cfg = self._herd.loaded.config.memory
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
        for model in self._herd.models.values():
            for inst in model.everyone():
                spec = inst.spec
                models.append({
                    "name": inst.name, "state": str(inst.state), "pid": inst.pid,
                    "gpus": gpus_of(inst),
                    **memory.describe(inst),
                    "footprint_mib": {d: _mib(b)
                                      for d, b in self._planner.footprint(inst).items()},
                    "cache_type_k": inst.started_with.cache_type_k or "f16",
                    "cache_type_v": inst.started_with.cache_type_v or "f16",
                    "kv_cache": {
                        "mode": spec.kv_mode, "adaptive": spec.kv_adaptive,
                        "hold": spec.kv_hold,
                        "ladder": ["/".join(step) for step in memory.ladder(spec)],
                        "level": model.kv_level, "changes": memory.kv_changes.get(
                            inst.model, {"down": 0, "up": 0}),
                    } if spec.kv_ladder else None,
                })
        sample = memory.sample
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
