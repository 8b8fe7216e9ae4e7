"""The TTL sweeper: idle models past their TTL stop; what the policy keeps loaded and is down
comes back (its model's keeper waits out a failed child's back-off and a refused start)."""

from __future__ import annotations

import asyncio
import time

import structlog

from corral.supervisor import policy
from corral.supervisor.daemon.herd import Herd
from corral.supervisor.daemon.planner import Planner
from corral.supervisor.instance import State

log = structlog.get_logger("corral.daemon")


class TtlSweeper:
    def __init__(self, herd: Herd, planner: Planner):
        self._herd = herd
        self._planner = planner

    async def run(self) -> None:
        while True:
            wait: float | None = 1.0
            try:
                wait = self.expire_idle(time.monotonic())
            except Exception:
                # One bad sweep must not end TTL for good.
                log.exception("daemon.ttl_sweep_failed")
            # A deadline, not a poll: the strategy says when the next model could expire.
            await asyncio.sleep(min(max(wait or 1.0, 0.05), 1.0))

    def expire_idle(self, now: float) -> float | None:
        """Stop what has been idle past its TTL; seconds until the next could expire.
        Decision and stop happen in one synchronous step (begin_stop leaves READY at once),
        so a request arriving meanwhile either got its slot first (then the model is busy
        and not expired) or finds the model stopping and starts it again once stopped."""
        snap = self._planner.snapshot(now)
        for name in self._planner.decide("expired", [], snap) or []:
            inst = self._herd.loaded_member(name)
            if inst is None or inst.state is not State.READY or inst.busy:
                continue  # a strategy may only expire what is idle
            log.info("daemon.ttl_expired", model=name, pid=inst.pid, ttl=inst.spec.ttl)
            inst.begin_stop(f"idle for {inst.spec.ttl:g}s (ttl)", cause="ttl")
        self.keep_up(snap)
        wait: float | None = self._planner.decide("next_expiry", 1.0, snap)
        return wait

    def keep_up(self, snap: policy.Snapshot) -> None:
        """What the strategy keeps loaded and is down (crashed, or its restart refused)
        comes back; one an operator unloaded stays down until asked for."""
        if self._herd.closing:
            return
        for name in self._planner.decide("keep_loaded", frozenset(), snap) or ():
            model = self._herd.models.get(name)
            if model is not None:
                model.keep_up()
