"""The daemon as a relay worker sees it: a snapshot of what routing reads, leases by RPC.

The snapshot (the config, the models' specs, which models have a ready child) comes from the
daemon at the worker's start and after every change of state or config. A stale one costs
nothing but a detour: a model the worker thinks ready that is not is leased through the
daemon all the same (which starts it, or queues the request); one it thinks not ready goes
to the daemon whole (proxy/workers/forward.py)."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from corral.proxy import request_id
from corral.proxy.workers import frames
from corral.supervisor.config import GroupSpec, LoadedConfig, ModelSpec
from corral.supervisor.errors import ShuttingDown, UnknownModel
from corral.supervisor.port import CALLER, Broken, Lease, Restored

log = structlog.get_logger("corral.proxy.worker")


@dataclass
class Snapshot:
    """What the daemon tells a worker of itself (hub.py builds it)."""

    loaded: LoadedConfig | None  # None: unchanged since the last snapshot
    specs: dict[str, ModelSpec]  # the models whose spec changed (all of them at first)
    gone: frozenset[str]  # models no longer configured
    ready: frozenset[str]  # models with a ready child now
    closing: bool = False
    version: int = 0  # acknowledged once applied (`applied`): a reload's answer waits for it


@dataclass
class LeaseGrant:
    """A lease the daemon holds for a worker's request: what the worker needs of it."""

    lease_id: int
    model: str
    instance: str
    pid: int | None
    base_url: str
    headers: dict[str, str]
    first_byte_timeout: float | None
    idle_timeout: float | None
    ready_since: float
    served_name: str | None
    pins: bool  # the prompt cache pins its requests (one more round trip, at the send)
    extra: dict[str, Any] = field(default_factory=dict)


class Link:
    """The worker's end of its Unix socket to the daemon: calls that wait for a reply,
    notes that do not, and the snapshots the daemon pushes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._outbox = frames.Outbox(writer, dropped=self._unsent)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.snapshots: asyncio.Queue[Snapshot] = asyncio.Queue()
        self.stop = asyncio.Event()  # the daemon said stop, or went away
        self.closed = False
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, path: str) -> Link:
        reader, writer = await asyncio.open_unix_connection(path)
        link = cls(reader, writer)
        link._task = asyncio.create_task(link._read(), name="worker-link")
        return link

    def note(self, *message: Any) -> None:
        if not self.closed:
            self._outbox.put(message)

    async def call(self, kind: str, *args: Any) -> Any:
        """Ask the daemon; its answer, or the exception it raised. Cancelled: the daemon is
        told (it drops what it was doing for this call)."""
        if self.closed:
            raise ShuttingDown("corral is shutting down (its daemon is gone)")
        call_id = next(self._ids)
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = waiter
        self._outbox.put((kind, call_id, *args))
        try:
            return await waiter
        except asyncio.CancelledError:
            if not waiter.done() or waiter.cancelled():
                self.note("cancel", call_id)
            elif waiter.exception() is None:
                # Answered in the turn the caller was cancelled (asyncio drops the result and
                # throws the cancellation in): a grant nobody holds goes back.
                self._unclaimed(waiter.result())
            raise
        finally:
            self._waiting.pop(call_id, None)

    async def _read(self) -> None:
        try:
            while True:
                for message in await frames.read(self._reader):
                    kind = message[0]
                    if kind == "reply":
                        self._answered(message[1], message[2], None)
                    elif kind == "raise":
                        self._answered(message[1], None, frames.raised(message[2]))
                    elif kind == "snapshot":
                        self.snapshots.put_nowait(message[1])
                    elif kind == "stop":
                        self.stop.set()
                    elif kind == "ping":  # this loop turns: the daemon's watch (processes.py)
                        self.note("pong", message[1])
        except frames.LinkClosed:
            pass
        finally:
            self.closed = True
            self.stop.set()
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(ShuttingDown("corral is shutting down (its daemon "
                                                      "is gone)"))
            self._writer.close()

    def _answered(self, call_id: int, value: Any, exc: BaseException | None) -> None:
        waiter = self._waiting.get(call_id)
        if waiter is None or waiter.done():
            # Its caller was cancelled while the answer was on its way.
            self._unclaimed(value)
            return
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(value)

    def _unsent(self, message: Any, failure: str) -> None:
        """A call that could not be sent (a pin of a body past a frame's size) fails, rather
        than wait for an answer that will never come."""
        waiter = self._waiting.get(message[1]) if len(message) > 1 else None
        if isinstance(waiter, asyncio.Future) and not waiter.done():
            waiter.set_exception(RuntimeError(f"{message[0]} not sent to the daemon: {failure}"))

    def _unclaimed(self, value: Any) -> None:
        """An answer its caller will never read: a lease it will never use goes back."""
        if isinstance(value, LeaseGrant):
            self.note("release", value.lease_id)

    async def close(self) -> None:
        self.closed = True
        self._writer.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class RemoteDaemon:
    """The part of supervisor.port.Supervisor a relay worker's requests use, answered from the
    daemon's snapshot (reads) and over the link (leases)."""

    def __init__(self, link: Link, first: Snapshot) -> None:
        assert first.loaded is not None, "the first snapshot carries the config"
        self._link = link
        self._loaded: LoadedConfig = first.loaded
        self._specs: dict[str, ModelSpec] = dict(first.specs)
        self._ready = first.ready
        self._closing = first.closing

    def apply(self, snapshot: Snapshot) -> None:
        if snapshot.loaded is not None:
            self._loaded = snapshot.loaded
        for name in snapshot.gone:
            self._specs.pop(name, None)
        self._specs.update(snapshot.specs)
        self._ready = snapshot.ready
        self._closing = snapshot.closing

    async def follow(self) -> None:
        """Apply the daemon's snapshots as they come, until the link ends; each is
        acknowledged once applied."""
        while True:
            snapshot = await self._link.snapshots.get()
            self.apply(snapshot)
            self._link.note("applied", snapshot.version)

    @property
    def closing(self) -> bool:
        return self._closing or self._link.closed

    @property
    def loaded(self) -> LoadedConfig:
        return self._loaded

    def model_names(self) -> list[str]:
        return list(self._specs)

    def groups(self) -> Mapping[str, GroupSpec]:
        return self._loaded.groups

    def resolve(self, name: str) -> str | None:
        if name in self._specs:
            return name
        canonical = self._loaded.aliases.get(name)
        return canonical if canonical in self._specs else None

    def spec(self, name: str) -> ModelSpec:
        canonical = self.resolve(name)
        if canonical is None:
            raise UnknownModel(name, sorted(self._specs))
        return self._specs[canonical]

    def ready_now(self, name: str) -> bool:
        return name in self._ready

    async def acquire(self, name: str, *, ignore_backoff: bool = False) -> Lease:
        grant: LeaseGrant = await self._link.call("acquire", name, ignore_backoff,
                                                  CALLER.get(), request_id.current())
        held = _HeldLease(self._link, grant)
        return Lease(held, model=grant.model, instance=grant.instance, pid=grant.pid,
                     base_url=grant.base_url, headers=grant.headers,
                     first_byte_timeout=grant.first_byte_timeout,
                     idle_timeout=grant.idle_timeout, ready_since=grant.ready_since,
                     prompt_slots=held if grant.pins else None,
                     served_name=grant.served_name)


class _HeldLease:
    """A lease the daemon holds for this worker: the Lease's owner and, with the prompt
    cache, its slots, each call passed on to the daemon's own lease."""

    __slots__ = ("_grant", "_link")

    def __init__(self, link: Link, grant: LeaseGrant) -> None:
        self._link = link
        self._grant = grant

    # LeaseOwner
    def _give_back(self, lease: Lease) -> None:
        self._link.note("release", self._grant.lease_id)

    def _child_alive(self, lease: Lease) -> bool:
        pid = self._grant.pid
        if pid is None:
            return True  # a remote endpoint: never resent to (proxy/forward.py)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    async def _broken(self, lease: Lease, timed_out: bool) -> Broken:
        broken: Broken = await self._link.call("broken", self._grant.lease_id, timed_out,
                                               request_id.current())
        return broken

    # PromptSlots
    async def pin(self, lease: Lease, url: str, body: Any,
                  parsed: dict[str, Any] | None = None, caller: str | None = None) -> Any:
        pinned: tuple[Any, int | None, Restored | None] = await self._link.call(
            "pin", self._grant.lease_id, url, body, caller, request_id.current())
        body, lease.slot, lease.restored = pinned
        return body

    def unpin(self, lease: Lease) -> None:
        pass  # the daemon's lease unpins as it is released (_give_back)

    def verify(self, restored: Restored, cache_n: int | None) -> None:
        self._link.note("reused", self._grant.lease_id, cache_n)

    def refused(self, lease: Lease) -> None:
        self._link.note("refused", self._grant.lease_id)
