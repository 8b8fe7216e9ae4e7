"""Admin commands: load, unload (drained, or forced), rebalance a split model. An operator's
command goes through the same door and state machine as a request."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from corral.supervisor.errors import InUse, NotAllowed, NotServed, SupervisorError, Unloaded
from corral.supervisor.port import ModelStatus

if TYPE_CHECKING:
    from corral.supervisor.daemon.core import Daemon

log = structlog.get_logger("corral.daemon")


async def load(self: Daemon, name: str) -> ModelStatus:
    # An operator asking explicitly is the retry a back-off waits for.
    lease = await self.acquire(name, ignore_backoff=True)
    lease.release()
    return self.status(name)

async def unload(self: Daemon, name: str, force: bool = False) -> ModelStatus:
    """Drain (unless forced) and stop; the model ends STOPPED (requests that queued for it
    are told, not served). The stop belongs to the instance: a caller that hangs up stops
    waiting, the model still ends STOPPED."""
    rs = self.replica_set(name)
    drain = 0.0 if force else self.loaded.config.shutdown_grace
    reason = "unloaded by admin" + (" (forced)" if force else "")
    await asyncio.gather(*(r.stop(reason, drain=drain, cause="unload") for r in rs.members))
    return self.status(name)

def load_soon(self: Daemon, name: str) -> ModelStatus:
    """Begin loading `name` as the daemon's own task (the caller does not wait): the
    shape llama.cpp's router and Open WebUI expect of POST /models/load. A failure shows
    in the model's state and last_error, and in the log."""
    rs = self.replica_set(name)  # an unknown name fails now, not in the background
    self._spawn_task(self._load_quietly(rs.name))
    return self.status(rs.name)

def unload_soon(self: Daemon, name: str, *, admin: bool) -> ModelStatus:
    """Begin draining and stopping `name` (the stop is the instance's own task). A caller
    without an admin key may not stop what the operator keeps loaded, nor cut off the
    requests others have in flight: it may unload an idle model it could load again."""
    rs = self.replica_set(name)
    if not admin:
        if any(r.pinned for r in rs.members):
            raise NotAllowed(f"{rs.name} is kept loaded by the operator's policy; only an "
                             f"admin key may unload it")
        if any(r.busy for r in rs.members):
            raise InUse(f"{rs.name} is serving requests now; only an admin key may unload "
                        f"a busy model")
    drain = self.loaded.config.shutdown_grace
    for replica in rs.members:
        replica.begin_stop("unloaded by request", drain=drain, cause="unload")
    return self.status(rs.name)

async def _load_quietly(self: Daemon, name: str) -> None:
    # Not an operator's retry (load() ignores the back-off): a client asking again and
    # again must not restart a broken model in a loop.
    try:
        lease = await self.acquire(name)
        lease.release()
    except Unloaded as exc:  # an unload asked after this load wins: not a failure
        log.info("daemon.load_called_off", model=name, reason=str(exc))
    except SupervisorError as exc:
        log.warning("daemon.load_failed", model=name, error=str(exc))

async def rebalance(self: Daemon, name: str) -> ModelStatus:
    """Deploy a model split over RPC workers again, over every worker reachable now, with
    a new split from what each has free: drain, stop, start."""
    inst = self.instance(name)
    if not inst.spec.rpc_workers:
        raise NotServed(f"{name} is not split over RPC workers: nothing to rebalance")
    await inst.stop("rebalance", drain=self.loaded.config.shutdown_grace, cause="rebalance")
    return await self.load(name)

async def _rebalance_quietly(self: Daemon, name: str) -> None:
    try:
        await self.rebalance(name)
    except SupervisorError as exc:  # the next request tries again
        log.warning("daemon.rebalance_failed", model=name, error=str(exc))
