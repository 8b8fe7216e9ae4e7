"""The worker-return watch: a model deployed without a worker that was unreachable is
deployed again over all of them once that worker answers and the model is idle."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog

from corral.supervisor.port import State
from corral.supervisor.tasks import TaskScope

if TYPE_CHECKING:
    from corral.supervisor.config.schema.rpc import PeerConfig
    from corral.supervisor.instance import Instance

log = structlog.get_logger("corral.rpc")


class WorkerReturnWatch:
    def __init__(self, instances: Callable[[], list[Instance]],
                 peers: Callable[[], Mapping[str, PeerConfig]],
                 session: Callable[[], aiohttp.ClientSession],
                 rebalance: Callable[[str], Coroutine[Any, Any, None]],
                 interval: float = 2.0):
        self._instances = instances
        self._peers = peers
        self._session = session
        self._rebalance = rebalance
        self._interval = interval
        self._rebalancing = TaskScope("rpc worker watch")  # rebalances it began

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval)
                try:
                    await self._round()
                except Exception:  # one bad round must not end the watch for good
                    log.exception("daemon.worker_watch_failed")
        finally:
            await self._rebalancing.close()

    async def _round(self) -> None:
        for inst in self._instances():
            deployment = inst.deployment
            if inst.state is not State.READY or deployment is None \
                    or not deployment.missing or inst.busy:
                continue
            back = [p for p in deployment.missing if await self._answers(p)]
            if back and inst.state is State.READY and not inst.busy:
                log.info("daemon.rebalance", model=inst.name, back=back,
                         reason="a missing worker answers again")
                self._rebalancing.spawn(self._rebalance(inst.name), f"rebalance:{inst.name}")

    async def _answers(self, peer_name: str) -> bool:
        peer = self._peers().get(peer_name)
        if peer is None:
            return False
        try:
            async with self._session().get(
                    f"{peer.url.rstrip('/')}/peer/info",
                    headers={"Authorization": f"Bearer {peer.token.get_secret_value()}"},
                    timeout=aiohttp.ClientTimeout(total=3)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
