"""The relay workers' processes, as the daemon runs them: spawned from an argv (never a
shell), each in its own process group, killed with the daemon (the parent-death signal), a
crashed one spawned again; and the two Unix sockets they reach the daemon by (leases, and
requests the daemon answers)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from pathlib import Path

import structlog
from aiohttp import web

from corral.proxy.accounting import Accounting
from corral.proxy.admin import RELOAD_HOOKS
from corral.proxy.listener import connection_limit
from corral.proxy.workers.hub import Hub
from corral.supervisor import socket_dir
from corral.supervisor.port import Supervisor
from corral.supervisor.process import die_with_parent

log = structlog.get_logger("corral.proxy.workers")

# A worker that exits sooner than this after its start is spawned again after a growing wait.
_STEADY_S = 30.0
_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# At the daemon's start: how long its readiness waits for the workers to serve, at most (a
# worker still starting then joins when it can; the daemon serves meanwhile).
START_WAIT_S = 20.0
# A worker answers a ping every PING_S from its event loop; one that leaves PING_MISSES in a
# row unanswered (its loop stuck, or SIGSTOP) is killed, and spawned again: the kernel keeps
# handing new connections to a stopped worker's socket, and its requests' leases stay held.
PING_S = 2.0
PING_MISSES = 3
# At the daemon's exit: what a worker gets to end after the daemon's drain, then SIGKILL.
_EXIT_S = 3.0


class RelayWorkers:
    def __init__(self, daemon: Supervisor, accounting: Accounting, runner: web.AppRunner,
                 count: int, listen: str, log_level: str, log_format: str) -> None:
        self.hub = Hub(daemon, accounting)
        self._runner = runner
        self.count = count
        self._listen = listen
        self._log_args = ["--log-level", log_level, "--log-format", log_format]
        self._dir: str | None = None
        self._rpc: asyncio.Server | None = None
        self._site: web.UnixSite | None = None
        self._keepers: list[asyncio.Task[None]] = []
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self._closing = asyncio.Event()

    async def start(self, stop: asyncio.Event) -> int:
        """The sockets, then the workers; returns once all serve (START_WAIT_S at most, or
        until `stop` is set): how many serve."""
        self._dir = socket_dir.make("relay")
        rpc_path = str(Path(self._dir) / "rpc.sock")
        http_path = str(Path(self._dir) / "http.sock")
        self._rpc = await asyncio.start_unix_server(self.hub.serve, rpc_path)
        # A reload's answer says it is applied once the workers applied it too.
        self._runner.app[RELOAD_HOOKS].append(self.hub.synced)
        # The daemon's own app, for what a worker forwards (not counted against the client
        # connections' cap: a worker keeps a few connections and reuses them).
        self._site = web.UnixSite(self._runner, http_path)
        await self._site.start()
        argv = [sys.executable, "-m", "corral.proxy.workers.main", "--rpc", rpc_path,
                "--forward", http_path, "--listen", self._listen, *self._log_args]
        self._keepers = [asyncio.create_task(self._keep(index, argv),
                                             name=f"relay-worker-{index}")
                         for index in range(self.count)]
        self._keepers.append(asyncio.create_task(self._watch(), name="relay-workers-watch"))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            async with asyncio.timeout(START_WAIT_S):
                while len(self.hub.ready) < self.count and not stop.is_set():
                    self.hub.ready_changed.clear()
                    changed = asyncio.ensure_future(self.hub.ready_changed.wait())
                    await asyncio.wait([changed, stopped], return_when=asyncio.FIRST_COMPLETED)
                    changed.cancel()
        except TimeoutError:
            pass
        finally:
            stopped.cancel()
        ready = len(self.hub.ready)
        if 0 < ready < self.count:
            log.warning("relay_workers.slow_start", ready=ready, count=self.count,
                        waited_s=START_WAIT_S, note="the others join when they serve")
        return ready

    async def _watch(self) -> None:
        """Ping every serving worker each PING_S; kill one that stopped answering."""
        for seq in itertools.count(1):
            await asyncio.sleep(PING_S)
            for link in self.hub.serving():
                missed = link.ping(seq)
                if missed < PING_MISSES:
                    continue
                process = self.processes.get(link.index) if link.index is not None else None
                if process is None or process.pid != link.pid or process.returncode is not None:
                    continue  # not (or no longer) a process of ours
                log.warning("relay_worker.unresponsive", worker=link.index, pid=link.pid,
                            unanswered_s=missed * PING_S,
                            note="killed, and spawned again; its requests are cut")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)

    async def _keep(self, index: int, argv: list[str]) -> None:
        """Worker `index`, spawned again whenever it exits, until the daemon closes."""
        failures = 0
        while not self._closing.is_set():
            started = time.monotonic()
            # The workers share what the daemon alone would take in client connections: what
            # they forward holds a descriptor of the daemon's each (read at each spawn: a
            # limit raised with prlimit applies to the next).
            own = [*argv, "--index", str(index),
                   "--forward-limit", str(max(1, connection_limit() // self.count))]
            try:
                process = await asyncio.create_subprocess_exec(
                    *own, stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=die_with_parent)
            except OSError as exc:
                log.error("relay_worker.spawn_failed", worker=index, error=str(exc))
                code: int | None = None
            else:
                self.processes[index] = process
                log.info("relay_worker.spawned", worker=index, pid=process.pid, argv=own)
                code = await process.wait()
                self.processes.pop(index, None)
                if self._closing.is_set():
                    return
                log.warning("relay_worker.exited", worker=index, pid=process.pid,
                            returncode=code, note="spawned again")
            failures = 0 if time.monotonic() - started > _STEADY_S else failures + 1
            wait = _BACKOFF_S[min(failures, len(_BACKOFF_S)) - 1] if failures else 0.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), wait)

    def stop_taking(self) -> None:
        """The daemon stops: the workers take no new connections and finish what they serve
        (the daemon's drain waits for their leases as for its own)."""
        self._closing.set()
        self.hub.stop_workers()

    async def close(self) -> None:
        """After the daemon's drain: the workers end (SIGKILL past _EXIT_S), the sockets go."""
        self._closing.set()
        self.hub.stop_workers()
        processes = list(self.processes.values())
        if processes:
            waits = [asyncio.ensure_future(p.wait()) for p in processes]
            _, late = await asyncio.wait(waits, timeout=_EXIT_S)
            for process in processes:
                if process.returncode is None:
                    log.warning("relay_worker.killed", pid=process.pid,
                                note=f"still running {_EXIT_S:g} s after the drain")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
            if late:
                await asyncio.wait(late, timeout=_EXIT_S)
        for keeper in self._keepers:
            keeper.cancel()
        await asyncio.gather(*self._keepers, return_exceptions=True)
        if self._rpc is not None:
            self._rpc.close()
        if self._site is not None:
            await self._site.stop()
        if self._dir is not None:
            with contextlib.suppress(OSError):
                socket_dir.remove(self._dir)
