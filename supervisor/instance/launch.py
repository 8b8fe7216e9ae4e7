"""One launch of a child process: RPC workers deployed (for a split model), the child spawned
in its own group, its readiness awaited, one retry when someone took its port first. It
returns a healthy child or raises StartFailed having stopped everything it started; a
cancelled launch stops its child too. The state around it is the instance's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import signal
import time
from collections.abc import Awaitable, Callable

import aiohttp
import structlog

from corral.supervisor.backends.base import Backend, BinaryNotFound
from corral.supervisor.config import ModelSpec
from corral.supervisor.errors import StartFailed, StartTimedOut, WorkersUnavailable
from corral.supervisor.events import EventBus
from corral.supervisor.listener import held_by_stranger, says_it_listens
from corral.supervisor.memory.estimate import EstimateError
from corral.supervisor.process import (
    ChildExited,
    ChildProcess,
    ChildStartTimeout,
    free_port,
    port_open,
    probe_health,
    probe_lists_model,
)
from corral.supervisor.prompt_cache.identity import Setup
from corral.supervisor.reaper import GroupKeeper
from corral.supervisor.rpc.deploy import Deployment, ProcessSet, RpcDeployer
from corral.supervisor.rpc.workers import RpcError

# Hashing a model's header and asking its binary `--version` (10 s of its own): past this,
# the child starts without a prompt cache rather than late.
SETUP_TIMEOUT = 30.0


@dataclasses.dataclass(frozen=True)
class Attached:
    """Where a launched child listens and how to reach it (set on the instance at spawn)."""

    process: ChildProcess
    port: int
    base_url: str
    headers: dict[str, str]
    spec: ModelSpec  # what it was started with (a split model: its workers and split)


class Launch:
    def __init__(self, name: str, spec: ModelSpec, backend: Backend, *, model: str,
                 start_timeout: float, session: aiohttp.ClientSession,
                 keeper: GroupKeeper | None, deployer: RpcDeployer | None, events: EventBus,
                 attach: Callable[[Attached], None], on_spawn: Callable[[], None],
                 log: structlog.typing.FilteringBoundLogger,
                 identify: Callable[[ModelSpec, str], Awaitable[Setup]] | None = None):
        self._name = name
        self.spec = spec  # the spec it starts with (KV choice, placement and all)
        self._backend = backend
        self._model = model
        self._start_timeout = start_timeout
        self._session = session
        self._keeper = keeper
        self._deployer = deployer
        self._events = events
        self._attach = attach  # the instance takes the child's address (its pid shows now)
        self._on_spawn = on_spawn  # the daemon records it (raising fails the start)
        self._log = log
        self.process: ChildProcess | None = None
        self.port: int | None = None
        # The prompt cache's setup key (spec, binary → Setup), taken before the process
        # starts: the files it maps as they are then, not after a replacement mid-start.
        self._identify = identify
        self.setup: Setup | None = None

    async def run(self, starting: Callable[[], bool]) -> ChildProcess:
        """The healthy child. StartFailed (its child stopped first) for any failure: a model
        file that cannot be read or parsed, a peer's odd answer are said plainly; any other
        error is a bug in corral, logged with its traceback."""
        began = time.monotonic()
        progress = asyncio.create_task(self._report_progress(began, starting),
                                       name=f"load:{self._name}")
        try:
            process = await self._spawn_and_wait(last_try=False)
            if process is None:  # someone took its port before the child bound it
                process = await self._spawn_and_wait(last_try=True)
            assert process is not None  # the last try returns a child or raises
            return process
        except (StartFailed, asyncio.CancelledError):
            raise
        except Exception as exc:
            if isinstance(exc, (OSError, ValueError, EstimateError)):
                self._log.warning("instance.start_error", pid=self._pid,
                                  error=f"{type(exc).__name__}: {exc}")
            else:
                self._log.exception("instance.start_crashed", pid=self._pid)
            if self.process is not None and self.process.pid is not None:
                await stop_uncancellable(self.process)
            # What failed, in words a client may see; the path and the exception's text are
            # the operator's (the log, /admin/models' last_error).
            raise StartFailed(f"{self._name}: start failed ({type(exc).__name__}; the admin "
                              f"view and the log say why)",
                              for_operators=f"{self._name}: start failed: "
                                            f"{type(exc).__name__}: {exc}") from exc
        finally:
            progress.cancel()

    @property
    def _pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def _report_progress(self, began: float, starting: Callable[[], bool],
                               every: float = 1.0) -> None:
        """While the child loads: what corral can honestly know of its progress, each
        second: the time it has taken so far and the last line of the child's log."""
        while starting():
            await asyncio.sleep(every)
            if not starting():
                return
            tail = self.process.tail(1) if self.process is not None else []
            self._events.publish("load_progress", model=self._model, instance=self._name,
                                 pid=self._pid, elapsed=round(time.monotonic() - began, 1),
                                 log=tail[-1][-300:] if tail else None)

    async def _spawn_and_wait(self, last_try: bool) -> ChildProcess | None:
        """One start attempt: the healthy child, or None when it lost its port (retry)."""
        self.port = port = free_port()
        api_key = secrets.token_urlsafe(24)
        deployment = await self._deploy(port) if self.spec.rpc_workers else None
        try:
            # In a thread: a backend may ask its binary (llama-server's --help says which
            # draft flags it speaks), and a slow binary must not stall the daemon.
            argv = await asyncio.to_thread(self._backend.argv, self.spec, port)
            self.setup = await self._setup(argv[0])
        except BaseException as exc:  # cancelled while the thread ran, too: workers go
            if deployment is not None:
                await asyncio.shield(deployment.release())
            if isinstance(exc, BinaryNotFound):
                # Its message is written for people: how to install the server (the backend's).
                raise StartFailed(str(exc)) from exc
            raise
        env = {**self._backend.env(self.spec), **self._backend.auth_env(api_key)}
        process = ChildProcess(self._name, argv, env, keeper=self._keeper,
                               stop_signal=signal.Signals[self.spec.stop_signal],
                               # vLLM's: a backend without one has no such attribute
                               sockets=getattr(self._backend, "sockets", None)) \
            if deployment is None else \
            ProcessSet(self._name, argv, env, deployment, keeper=self._keeper)
        self.process = process
        # A reader following the model's log (GET /admin/models/<m>/logs?follow=1) moves on
        # to this child's lines as it starts, not once it is ready.
        headers = {"Authorization": f"Bearer {api_key}"}
        self._attach(Attached(process, port, f"http://127.0.0.1:{port}", headers, self.spec))
        # Shielded: a stop arriving mid-spawn must find a child it can stop, not an exec
        # that finished after its caller gave up on it.
        spawning = asyncio.ensure_future(process.spawn())
        try:
            await asyncio.shield(spawning)
        except OSError as exc:
            if deployment is not None:  # its workers must not outlive a head that never ran
                await asyncio.shield(deployment.release())
            raise StartFailed(f"{self._name}: its server could not be executed",
                              for_operators=f"cannot execute {argv[0]}: "
                                            f"{exc.strerror or exc}") from exc
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait([spawning])
            await stop_uncancellable(process)
            raise
        try:
            self._on_spawn()
            await process.wait_healthy(self._readiness(port, headers, process),
                                       self._start_timeout,
                                       self._backend.ready_lines,
                                       health_path(self.spec, self._backend))
        except ChildExited as exc:
            await stop_uncancellable(process)
            if not last_try and self._backend.lost_port_race(exc.tail):
                self._log.warning("instance.port_taken", port=port, pid=process.pid)
                return None
            raise StartFailed(str(exc), exc.tail, for_operators=str(exc)) from exc
        except ChildStartTimeout as exc:
            # Killed first, failed after: a request in between must not find the model
            # FAILED (and restart it at once, beside a child still running).
            await stop_uncancellable(process)
            raise StartTimedOut(f"{exc}; stopped it", exc.tail) from exc
        except asyncio.CancelledError:
            # Stopped (unload, eviction, shutdown) mid-start: the child must not outlive it.
            await stop_uncancellable(process)
            raise
        except Exception as exc:
            # Bookkeeping around the child failed (e.g. the state file): a child nobody
            # tracks must not keep running.
            self._log.exception("instance.start_bookkeeping_failed", pid=process.pid)
            await stop_uncancellable(process)
            raise StartFailed(f"{self._name}: start aborted: {type(exc).__name__}: "
                              f"{exc}") from exc
        return process

    async def _setup(self, binary: str) -> Setup | None:
        """The child's prompt-cache setup, None (the child saves and restores nothing) when
        it cannot be known: a file or binary that cannot be read fails the start itself."""
        if self._identify is None:
            return None
        began = time.monotonic()
        try:
            async with asyncio.timeout(SETUP_TIMEOUT):
                setup = await self._identify(self.spec, binary)
        except Exception as exc:  # OSError, TimeoutError, a binary's odd --version
            self._log.warning("prompt_cache.setup_unknown", error=f"{type(exc).__name__}: {exc}")
            return None
        self._log.debug("prompt_cache.setup", key=setup.key,
                        ms=round((time.monotonic() - began) * 1000, 1))
        return setup

    def current_setup(self) -> Setup | None:
        """The setup taken at the spawn, if the child's files are still the ones it hashed
        (one stat each; the child has opened them by the time it is ready). A file renamed
        into place between the hash and the child's open would otherwise file this child's
        KV, of the new weights, under the old file's key, which a rollback of the file (its
        inode back, with its size and mtime) would restore: no prompt cache for this child."""
        setup = self.setup
        if setup is None:
            return None
        changed = setup.replaced()
        if changed is not None:
            self._log.warning("prompt_cache.model_replaced_at_start", file=changed.path)
            return None
        return setup

    async def _deploy(self, port: int) -> Deployment:
        """Start the model's RPC workers and plan its split; the head's argv takes both.
        On any failure (cancellation included) no worker is left running."""
        if self._deployer is None:
            raise StartFailed(f"{self._name}: no RPC deployer (models split over workers need "
                              f"the daemon)")
        try:
            deployment = await self._deployer.deploy(self.spec, self._start_timeout,
                                                     avoid_ports={port})
        except RpcError as exc:
            # The worker's output and the peer's answer: for the admin view, not the client.
            raise WorkersUnavailable(str(exc), exc.tail,
                                     for_operators=exc.for_operators()) from exc
        except BinaryNotFound as exc:
            raise WorkersUnavailable(str(exc)) from exc
        self.spec = dataclasses.replace(self.spec, rpc_servers=deployment.endpoints,
                                        tensor_split=deployment.plan.layers)
        return deployment

    def _readiness(self, port: int, headers: dict[str, str], process: ChildProcess,
                   ) -> Callable[[float], Awaitable[bool]]:
        """The start's readiness probe: /health answers 200 and, for a backend that answers
        it early (vLLM), /v1/models lists the model's name. A command child polls its own
        `health` path, or with `health: none` waits for its port to accept connections.
        Whoever answered must not be a stranger that took the port before the child bound
        it (supervisor/listener.py): the child's bind failure then ends the try."""
        base = f"http://127.0.0.1:{port}"
        path = health_path(self.spec, self._backend)
        health, lists_models = base + (path or ""), self._backend.lists_models
        session, model, log = self._session, self._model, self._log
        binds_itself = self._backend.binds_itself
        warned = False

        async def answers(timeout: float) -> bool:
            if path is None:
                return await port_open(port, timeout)
            if await probe_health(session, health, timeout) is not None:
                return False
            return not lists_models or await probe_lists_model(
                session, base + "/v1/models", model, headers, timeout)

        async def ready(timeout: float) -> bool:
            nonlocal warned
            if not await answers(timeout):
                return False
            pid = process.pid
            if pid is None or says_it_listens(process.logs, port) or \
                    not await asyncio.to_thread(held_by_stranger, pid, port, binds_itself):
                return True
            if not warned:
                warned = True
                log.warning("instance.port_held_by_another", port=port, pid=pid,
                            note="another process answers on the child's port")
            return False

        return ready


def health_path(spec: ModelSpec, backend: Backend) -> str | None:
    """The child's health path (None: its port accepting connections is its health)."""
    return spec.health_path if backend.kind == "command" else backend.health_path


async def stop_uncancellable(process: ChildProcess) -> None:
    """Stop `process` even though the calling task is being cancelled."""
    task = asyncio.ensure_future(process.stop(0))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        process.sweep_group()
        raise
