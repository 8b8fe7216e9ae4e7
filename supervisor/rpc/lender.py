"""The worker side: a corral that lends its devices runs rpc-servers for heads that ask, each on
a lease the head renews; a head that goes silent loses its servers after `lease` seconds."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from corral.supervisor.config.schema.rpc import WorkerConfig
from corral.supervisor.process import ChildProcess
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.workers import rpc_server_binary, rpc_version, start_local_rpc_server
from corral.supervisor.tasks import TaskScope

log = structlog.get_logger("corral.rpc")

__all__ = ["Lender", "Loan", "TooManyLoans"]


class TooManyLoans(Exception):
    """worker.max_loans rpc-servers are lent (or starting) already."""


@dataclass
class Loan:
    id: str
    model: str
    process: ChildProcess
    port: int
    device: str
    free: int
    expires: float  # monotonic

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "pid": self.process.pid, "port": self.port,
                "device": self.device, "free_mib": round(self.free / 2**20, 1)}


class Lender:
    def __init__(self, config: WorkerConfig, binary: str | None, keeper: GroupKeeper | None,
                 device_free: Callable[[], dict[str, int]]):
        self.config = config
        self._binary = binary
        self.keeper = keeper
        self._device_free = device_free
        self.loans: dict[str, Loan] = {}
        self._starting = 0  # lends between their check of the cap and their loan in `loans`
        self._expiry: asyncio.Task[None] | None = None
        # Lends, ends and the expiry: the lender's tasks, cancelled and awaited at close (a
        # head hanging up only stops waiting).
        self._tasks = TaskScope("rpc lender")
        if config.bind not in ("127.0.0.1", "::1", "localhost"):
            log.warning("rpc.bind_not_loopback", bind=config.bind,
                        note="rpc-server has no authentication: anyone who reaches this "
                             "address can use its devices while a loan runs")

    async def info(self) -> dict[str, Any]:
        # Loans and devices are read here, on the loop that changes them; only the binary's
        # version (found on disk, and run once) is asked in a thread.
        loans = [loan.describe() for loan in self.loans.values()]
        devices = {n: round(f / 2**20, 1) for n, f in self._device_free().items()}
        version = await asyncio.to_thread(self._version)
        return {"rpc_version": version, "bind": self.config.bind, "devices": devices,
                "loans": loans, "max_loans": self.config.max_loans}

    def _version(self) -> str:
        return rpc_version(rpc_server_binary(self._binary))

    async def lend(self, model: str) -> tuple[Loan, str]:
        """An rpc-server on the device with the most free memory not already lent, and the
        RPC protocol version it speaks. TooManyLoans past worker.max_loans (those still
        starting count). The lender's task: a caller that goes away only stops waiting."""
        return await self._tasks.run(self._lend_counted(model), f"lend:{model}")

    async def _lend_counted(self, model: str) -> tuple[Loan, str]:
        if len(self.loans) + self._starting >= self.config.max_loans:
            log.warning("rpc.too_many_loans", model=model, max_loans=self.config.max_loans)
            raise TooManyLoans(f"this worker lends at most {self.config.max_loans} rpc-servers "
                               f"at once (worker.max_loans), and all are in use")
        self._starting += 1
        try:
            return await self._lend(model)
        finally:
            self._starting -= 1

    async def _lend(self, model: str) -> tuple[Loan, str]:
        binary = rpc_server_binary(self._binary)
        version = await asyncio.to_thread(rpc_version, binary)
        free = self._device_free()
        taken = {loan.device for loan in self.loans.values() if loan.device != "cpu"}
        gpus = {d: f for d, f in free.items() if d != "cpu" and d not in taken}
        if gpus:
            device = max(gpus, key=lambda d: gpus[d])
            env = {"CUDA_VISIBLE_DEVICES": device.removeprefix("gpu")}
        else:
            device, env = "cpu", {}
        loan_id = secrets.token_hex(8)
        process, port = await start_local_rpc_server(
            f"{model}/lent#{loan_id}", binary, self.config.bind, 1, env, self.keeper, 30)
        loan = Loan(loan_id, model, process, port, device, free.get(device, 0),
                    time.monotonic() + self.config.lease)
        self.loans[loan_id] = loan
        self._ensure_expiry()
        log.info("rpc.lent", model=model, id=loan_id, pid=process.pid, port=port,
                 device=device)
        return loan, version

    def renew(self, loan_id: str) -> bool:
        loan = self.loans.get(loan_id)
        if loan is None or not loan.process.alive():
            return False
        loan.expires = time.monotonic() + self.config.lease
        return True

    async def end(self, loan_id: str, why: str) -> bool:
        loan = self.loans.pop(loan_id, None)
        if loan is None:
            return False
        log.info("rpc.loan_ended", model=loan.model, id=loan_id, pid=loan.process.pid, why=why)
        if self._tasks.closed:  # the close itself: stopped here, no task of its own
            await loan.process.stop(2.0)
        else:
            await self._tasks.run(loan.process.stop(2.0), f"end-loan:{loan_id}")
        return True

    def _ensure_expiry(self) -> None:
        if self._tasks.closed:
            return  # closing: the loans end with it, no new expiry watch
        if self._expiry is None or self._expiry.done():
            self._expiry = self._tasks.spawn(self._expire(), "rpc-leases")

    async def _expire(self) -> None:
        while self.loans:
            await asyncio.sleep(min(1.0, self.config.lease / 4))
            now = time.monotonic()
            for loan in list(self.loans.values()):
                if not loan.process.alive():
                    await self.end(loan.id, "its rpc-server exited")
                elif loan.expires < now:
                    await self.end(loan.id, f"no renewal from the head in {self.config.lease:g}s")

    async def close(self) -> None:
        await self._tasks.close()
        for loan_id in list(self.loans):
            with contextlib.suppress(Exception):
                await self.end(loan_id, "worker shutdown")
