"""acquire → use → release: the one way a handler talks to a child."""

from __future__ import annotations

from collections.abc import Awaitable
from types import TracebackType

import structlog

from corral.proxy.errors import UpstreamFailed, UpstreamRejected, UpstreamTimeout
from corral.supervisor.errors import StartFailed
from corral.supervisor.port import Lease, Supervisor

log = structlog.get_logger("corral.proxy")


def leased(daemon: Supervisor, model: str, acquire: Awaitable[Lease] | None = None) -> _Leased:
    """A lease on `model` for the block, released however the block ends. `acquire`: how the
    lease is got, when not plainly (daemon.acquire with loading progress around it).

    UpstreamFailed raised in the block is the child's doing: unless the child answered (an
    HTTP error from a live child), it is checked at once, so a dead one is marked failed and
    the next request starts a fresh one instead of leasing a dead port. Anything else (a
    client that hung up, a cancellation) says nothing about the child."""
    return _Leased(daemon, model, acquire)


class _Leased:
    """leased()'s block. A class, not contextlib.asynccontextmanager: every request enters
    one, and the generator's machinery (an async generator, asend and athrow) cost a few µs
    of each request's CPU."""

    __slots__ = ("_acquire", "_daemon", "_lease", "_model")

    def __init__(self, daemon: Supervisor, model: str, acquire: Awaitable[Lease] | None) -> None:
        self._daemon = daemon
        self._model = model
        self._acquire = acquire
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        acquire, self._acquire = self._acquire, None
        try:
            lease = await (acquire if acquire is not None else self._daemon.acquire(self._model))
        except StartFailed as exc:
            # The child's last lines go to the daemon log, under this request's id; the client
            # gets the message only (and the admin API keeps the lines).
            log.warning("proxy.start_failed", model=self._model, error=str(exc),
                        tail=exc.tail[-10:])
            raise
        self._lease = lease
        return lease

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        lease, model = self._lease, self._model
        assert lease is not None
        try:
            if isinstance(exc, UpstreamRejected):
                log.info("proxy.upstream_rejected", model=model, error=str(exc))
            elif isinstance(exc, UpstreamFailed):
                await self._broken(lease, exc)
        finally:
            lease.release()

    async def _broken(self, lease: Lease, exc: UpstreamFailed) -> None:
        model = self._model
        # A silent child is probed at once (and killed when it does not answer), so the
        # next request gets a fresh one instead of the same wait.
        broken = await lease.report_broken(timed_out=isinstance(exc, UpstreamTimeout))
        if broken.unresponsive and not isinstance(exc, UpstreamTimeout):
            # Its connection was reset by the kill, but what the client waited on was a
            # child that had stopped answering: a gateway timeout, said plainly.
            log.warning("proxy.upstream_unresponsive", model=model, pid=lease.pid)
            raise UpstreamTimeout(f"{model} stopped answering and the health watchdog killed it; "
                                  f"the next request starts it again") from exc
        # The child's own words (the detail may quote its log) stay here, in the daemon log.
        log.warning("proxy.upstream_failed", model=model, pid=lease.pid,
                    error=str(exc), detail=broken.detail, unresponsive=broken.unresponsive)
