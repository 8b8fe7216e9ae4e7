"""The TTL sweeper: idle models past their TTL stop; what the policy keeps loaded and crashed
comes back (after its start back-off)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog

from corral.supervisor import policy
from corral.supervisor.instance import State

if TYPE_CHECKING:
    from corral.supervisor.daemon.core import Daemon

log = structlog.get_logger("corral.daemon")


async def _sweep_ttl(self: Daemon) -> None:
    while True:
        wait: float | None = 1.0
        try:
            wait = self._expire_idle(time.monotonic())
        except Exception:
            # One bad sweep must not end TTL for good.
            log.exception("daemon.ttl_sweep_failed")
        await asyncio.sleep(min(max(wait or 1.0, 0.05), 1.0))

def _expire_idle(self: Daemon, now: float) -> float | None:
    """Stop what has been idle past its TTL; seconds until the next could expire.
    Decision and stop happen in one synchronous step (begin_stop leaves READY at once),
    so a request arriving meanwhile either got its slot first (then the model is busy
    and not expired) or finds the model stopping and starts it again once stopped."""
    snap = self._snapshot(now)
    for name in self._decide("expired", [], snap) or []:
        inst = self._loaded_member(name)
        if inst is None or inst.state is not State.READY or inst.busy:
            continue  # a strategy may only expire what is idle
        log.info("daemon.ttl_expired", model=name, pid=inst.pid, ttl=inst.spec.ttl)
        inst.begin_stop(f"idle for {inst.spec.ttl:g}s (ttl)", cause="ttl")
    self._keep_up(snap)
    wait: float | None = self._decide("next_expiry", 1.0, snap)
    return wait

def _keep_up(self: Daemon, snap: policy.Snapshot) -> None:
    """What the strategy keeps loaded and crashed comes back (after its start back-off);
    one an operator unloaded stays down until asked for."""
    if self._closing:
        return
    for name in self._decide("keep_loaded", frozenset(), snap) or ():
        rs = self.models.get(name)
        if rs is None:
            continue
        inst = rs.primary
        if inst.state is State.FAILED and inst.can_start and inst.backoff_left() <= 0 \
                and not inst.intent.restart_after_stop and not inst.intent.preloading:
            log.info("daemon.restart_kept", model=name, error=inst.last_error)
            self._spawn_task(self._preload(inst))
