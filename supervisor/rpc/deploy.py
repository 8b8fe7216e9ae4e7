"""Deploying a model over RPC workers: start (or ask peers for) its rpc-servers, plan the layer
split from what each measured free, and tie them to the head llama-server as one process set
that starts, stops and dies together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from corral.supervisor.config.schema.rpc import PeerConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.memory.estimate import model_facts
from corral.supervisor.process import ChildProcess, free_port
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.redaction import without_secrets
from corral.supervisor.rpc.plan import NoFit, SplitPlan, layer_need, plan_split
from corral.supervisor.rpc.workers import (
    LocalWorker,
    PeerWorker,
    RpcError,
    Worker,
    rpc_server_binary,
    rpc_version,
    start_local_rpc_server,
)

log = structlog.get_logger("corral.rpc")

_VERSION = re.compile(r"\d{1,4}\.\d{1,4}\.\d{1,4}")  # what a peer reports: rpc-server's banner

__all__ = ["Deployment", "ProcessSet", "RpcDeployer"]


@dataclass
class Deployment:
    workers: list[Worker]
    plan: SplitPlan
    missing: tuple[str, ...] = ()  # configured workers left out (unreachable at deploy time)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(w.endpoint for w in self.workers)

    async def lost(self) -> str:
        """Returns when the first worker is lost, saying which and why."""
        watches = [asyncio.ensure_future(w.lost()) for w in self.workers]
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for watch in watches:
                watch.cancel()

    async def release(self) -> None:
        await _release_all(self.workers)

    def kill_now(self) -> None:
        for w in self.workers:
            w.kill_now()

    def describe(self) -> list[dict[str, Any]]:
        return [{**w.describe(), "layers": n}
                for w, n in zip(self.workers, self.plan.layers, strict=True)]


class ProcessSet(ChildProcess):
    """The head llama-server with its RPC workers. A worker lost kills the head (the instance
    then fails and its requests end with a clean error); the head gone, by exit or stop,
    releases every worker."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str],
                 deployment: Deployment, keeper: GroupKeeper | None = None):
        super().__init__(name, argv, env, keeper=keeper)
        self.deployment = deployment
        self._watch: asyncio.Task[None] | None = None
        self._lost: str | None = None
        self._release: asyncio.Future[None] | None = None

    async def spawn(self) -> int:
        pid = await super().spawn()
        self._watch = asyncio.create_task(self._watch_workers(), name=f"rpc-watch:{self.name}")
        return pid

    def exit_reason(self) -> str | None:
        """A worker lost: the watch's word, or a local worker found dead (the head may notice
        the broken connection and exit before the watch does)."""
        if self._lost is not None:
            return f"rpc worker lost: {self._lost}"
        for worker in self.deployment.workers:
            if isinstance(worker, LocalWorker) and not worker.process.alive():
                return f"rpc worker lost: {worker.name} (rpc-server pid {worker.process.pid}) " \
                       f"exited"
        return None

    async def _watch_workers(self) -> None:
        reason = await self.deployment.lost()
        self._lost = reason
        self.logs.append(f"corral: rpc worker lost: {reason}")
        self._log.warning("rpc.worker_lost", reason=reason)
        with contextlib.suppress(ProcessLookupError, AssertionError):
            self._signal_group(signal.SIGKILL)  # the exit watch takes it from here

    def sweep_group(self) -> None:
        super().sweep_group()
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
        self.deployment.kill_now()
        if self._release is None:
            self._release = asyncio.ensure_future(self.deployment.release())

    async def stop(self, grace: float) -> int | None:
        code = await super().stop(grace)
        self.sweep_group()  # also when the head had exited before: its workers go now
        assert self._release is not None
        await asyncio.shield(self._release)
        return code


class RpcDeployer:
    """Owned by the daemon: starts a model's workers and plans its split."""

    def __init__(self, peers: Mapping[str, PeerConfig], keeper: GroupKeeper | None,
                 session: Callable[[], aiohttp.ClientSession],
                 device_free: Callable[[], dict[str, int]]):
        self.peers = dict(peers)
        self.keeper = keeper
        self._session = session
        # Free bytes per device now ("cpu", "gpu0", ...), from the memory tracker.
        self._device_free = device_free

    def reconfigure(self, peers: Mapping[str, PeerConfig]) -> None:
        self.peers = dict(peers)

    async def deploy(self, spec: ModelSpec, timeout: float,
                     avoid_ports: Collection[int] = ()) -> Deployment:
        facts = await asyncio.to_thread(model_facts, spec.model_path)
        binary = rpc_server_binary(spec.binary)
        version = await asyncio.to_thread(rpc_version, binary)
        free_now = self._device_free()
        gpus = sorted(d for d in free_now if d != "cpu")
        local_cpu = sum(1 for i, w in enumerate(spec.rpc_workers) if w == "local"
                        and self._local_index(spec, i) >= len(gpus))
        # Distinct ports for workers that start together (and none the head's).
        taken = set(avoid_ports)
        ports = {}
        for i, entry in enumerate(spec.rpc_workers):
            if entry == "local":
                ports[i] = free_port(taken)
                taken.add(ports[i])

        async def start(i: int, entry: str) -> Worker | None:
            if entry == "local":
                return await self._start_local(spec, i, binary, gpus, free_now,
                                               max(1, local_cpu), timeout, ports[i], taken)
            try:
                return await self._ask_peer(spec, entry, version, timeout)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("rpc.peer_unreachable", model=spec.name, peer=entry,
                            error=str(exc) or type(exc).__name__)
                return None

        workers, missing = await _start_all(
            [start(i, e) for i, e in enumerate(spec.rpc_workers)], spec.rpc_workers)
        try:
            if spec.rpc_split is not None and missing:
                raise RpcError(f"{spec.name}: the explicit split needs every worker; "
                               f"unreachable: {', '.join(missing)}")
            need = layer_need(facts, spec.ctx, spec.parallel, spec.cache_type_k,
                              spec.cache_type_v)
            try:
                plan = plan_split(facts.n_layer, need, [w.free for w in workers],
                                  list(spec.rpc_split) if spec.rpc_split else None)
            except NoFit as exc:
                lost = f" without {', '.join(missing)} (unreachable)" if missing else ""
                raise RpcError(f"{spec.name} does not fit its workers{lost}: {exc}") from exc
        except BaseException:
            await _release_all(workers)
            raise
        deployment = Deployment(workers, plan, tuple(missing))
        log.info("rpc.deployed", model=spec.name, workers=deployment.describe(),
                 missing=list(missing))
        return deployment

    @staticmethod
    def _local_index(spec: ModelSpec, position: int) -> int:
        """The n-th `local` entry takes the n-th GPU."""
        return sum(1 for w in spec.rpc_workers[:position] if w == "local")

    async def _start_local(self, spec: ModelSpec, position: int, binary: str,
                           gpus: list[str], free_now: dict[str, int], cpu_sharers: int,
                           timeout: float, port: int, taken: set[int]) -> LocalWorker:
        index = self._local_index(spec, position)
        name = f"{spec.name}/rpc#{position}"
        if index < len(gpus):
            device = gpus[index]
            env = {"CUDA_VISIBLE_DEVICES": device.removeprefix("gpu")}
            free = free_now.get(device, 0)
        else:
            device, env = "cpu", {}
            free = free_now.get("cpu", 0) // cpu_sharers  # local CPU workers share the RAM
        process, port = await start_local_rpc_server(name, binary, "127.0.0.1",
                                                     spec.rpc_threads, env, self.keeper,
                                                     min(timeout, 30), port, taken)
        return LocalWorker(name, process, "127.0.0.1", port, free, device)

    async def _ask_peer(self, spec: ModelSpec, peer_name: str, version: str,
                        timeout: float) -> PeerWorker:
        peer = self.peers[peer_name]
        url = peer.url.rstrip("/")
        headers = {"Authorization": f"Bearer {peer.token.get_secret_value()}"}
        async with self._session().post(
                f"{url}/peer/rpc-servers", headers=headers, json={"model": spec.name},
                timeout=aiohttp.ClientTimeout(total=min(timeout, 30))) as resp:
            status, text = resp.status, await resp.text(errors="replace")
        # A peer (or a proxy before it) may quote the token it was sent: never into the log,
        # last_error or the admin API.
        text = without_secrets(text.encode(), headers).decode(errors="replace")
        # The peer's answer stays with the operators (log, last_error): clients get the
        # peer's name and the HTTP status.
        answer = _peer_answer(text)
        if status != 200:
            said = _peer_message(answer) or text[:500]
            log.warning("rpc.peer_refused", model=spec.name, peer=peer_name, status=status,
                        answer=said)
            raise RpcError(f"peer {peer_name} refused an rpc-server: HTTP {status} (its "
                           f"answer is in corral's log)", [said])
        body: dict[str, Any] = answer if isinstance(answer, dict) else {}
        try:
            worker = PeerWorker(peer_name, url, peer.token, str(body["id"]), str(body["host"]),
                                int(body["port"]), int(body["free"]), str(body["device"]),
                                self._session(), interval=min(2.0, spec.health_interval),
                                failures_allowed=spec.health_failures)
        except (KeyError, TypeError, ValueError):
            # (A loan it made all the same ends with its lease: nobody renews it.)
            log.warning("rpc.peer_answer_unreadable", model=spec.name, peer=peer_name,
                        answer=text[:500])
            raise RpcError(f"peer {peer_name} answered HTTP 200 without an rpc-server's "
                           f"address (its answer is in corral's log)", [text[:500]]) from None
        theirs = body.get("rpc_version")
        if theirs != version:
            await worker.release()
            shown = f"v{theirs}" if isinstance(theirs, str) and _VERSION.fullmatch(theirs) \
                else "an unknown version"
            raise RpcError(f"peer {peer_name} runs RPC protocol {shown}, this head "
                           f"v{version}: install the same llama.cpp build on both",
                           [f"rpc_version: {theirs!r}"[:200]])
        return worker


def _peer_answer(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _peer_message(answer: Any) -> str | None:
    """The message of an answer in the OpenAI error shape, if it is one."""
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message[:500] if isinstance(message, str) else None


async def _start_all(starts: Sequence[Coroutine[Any, Any, Worker | None]],
                     entries: Sequence[str]) -> tuple[list[Worker], list[str]]:
    """Run every start at once; (the workers started, in order; the entries that answered
    None, i.e. unreachable). On a failure or a cancellation none is left running."""
    tasks = [asyncio.ensure_future(start) for start in starts]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        # One task for the whole cleanup: a second cancel only stops this wait for it, and
        # the workers that started are still released.
        await asyncio.shield(asyncio.ensure_future(_cancel_and_release(tasks)))
        raise
    failures = [t.exception() for t in tasks if t.exception() is not None]
    workers = [w for t in tasks if t.exception() is None and (w := t.result()) is not None]
    if failures:
        await _release_all(workers)
        raise failures[0]  # type: ignore[misc]
    missing = [e for t, e in zip(tasks, entries, strict=True) if t.result() is None]
    return workers, missing


async def _cancel_and_release(tasks: Sequence[asyncio.Future[Worker | None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    await _release_all([w for t in tasks if not t.cancelled() and t.exception() is None
                        and (w := t.result()) is not None])


async def _release_all(workers: Sequence[Worker]) -> None:
    await asyncio.shield(asyncio.gather(*(w.release() for w in workers),
                                        return_exceptions=True))
