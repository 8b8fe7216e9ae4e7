"""The daemon's end of its relay workers' links: leases held for them, their records booked,
snapshots of the daemon pushed to them after every change (proxy/workers/remote.py is the
worker's end).

A worker's request holds a real lease here from its acquire to its release, so the daemon's
view (slots, the queue, TTL, drains, evictions) counts it exactly as one of its own. A worker
that goes away (killed, crashed) has every lease it held given back at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from corral.proxy import request_id
from corral.proxy.accounting import Accounting
from corral.proxy.timing import RequestRecord
from corral.proxy.workers import frames
from corral.proxy.workers.remote import LeaseGrant, Snapshot
from corral.supervisor.config import LoadedConfig, ModelSpec
from corral.supervisor.events import Event
from corral.supervisor.port import CALLER, Broken, Lease, Supervisor

log = structlog.get_logger("corral.proxy.workers")

# How long a reload's answer waits for the workers to apply it, at most.
SYNC_S = 2.0
# The events after which a worker's picture of the daemon may be out of date.
_CHANGES = frozenset({"state", "reload", "loaded", "stopping", "stopped", "load_failed"})


@dataclass(frozen=True)
class _Now:
    loaded: LoadedConfig
    specs: dict[str, ModelSpec]
    ready: frozenset[str]
    closing: bool


class Hub:
    """Serves the workers' links on a Unix socket (`serve`), and pushes snapshots."""

    def __init__(self, daemon: Supervisor, accounting: Accounting) -> None:
        self.daemon = daemon
        self.accounting = accounting
        self._links: set[_WorkerLink] = set()
        self._lease_ids = itertools.count(1)
        self._push_soon: asyncio.Handle | None = None
        self.ready: dict[int, int] = {}  # a worker's index → its pid, once it serves
        # The daemon's lines about a worker's request carry its id, as the worker's own do.
        self.ids = request_id.Ids()
        self.ready_changed = asyncio.Event()
        self.version = 0  # of the last snapshot pushed
        self.applied_changed = asyncio.Event()
        daemon.events.listen(self._on_event)

    def _on_event(self, event: Event) -> None:
        if event.kind in _CHANGES and self._links and self._push_soon is None:
            # Coalesced: a reload's dozen events make one snapshot, on the loop's next turn.
            self._push_soon = asyncio.get_running_loop().call_soon(self._push)

    def _push(self) -> None:
        self._push_soon = None
        self.version += 1
        if self._links:
            now = self.now()  # once for every worker
            for link in list(self._links):
                link.send_snapshot(now, full=False, version=self.version)

    def now(self) -> _Now:
        """What a snapshot tells of the daemon as it is now."""
        daemon = self.daemon
        names = daemon.model_names()
        return _Now(daemon.loaded, {name: daemon.spec(name) for name in names},
                    frozenset(name for name in names if daemon.ready_now(name)),
                    daemon.closing)

    async def synced(self, within: float = SYNC_S) -> None:
        """Once every serving worker applied the daemon as it is now (a snapshot pushed at
        once), or `within` seconds: a stuck worker is the watch's to kill, not a reason to
        hold the reload's answer."""
        if self._push_soon is not None:
            self._push_soon.cancel()
        self._push()
        version = self.version
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while any(link.applied < version for link in self.serving()):
                    self.applied_changed.clear()
                    await self.applied_changed.wait()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's link, until it ends (asyncio.start_unix_server's callback)."""
        link = _WorkerLink(self, reader, writer)
        self._links.add(link)
        try:
            await link.run()
        finally:
            self._links.discard(link)
            if link.index is not None and self.ready.get(link.index) == link.pid:
                del self.ready[link.index]
                self.ready_changed.set()
            link.close()

    def serving(self) -> list[_WorkerLink]:
        """The links of workers that said they serve."""
        return [link for link in self._links if link.pid is not None]

    def stop_workers(self) -> None:
        """Every worker stops taking connections and finishes what it serves."""
        for link in self._links:
            link.send(("stop",))

    def next_lease_id(self) -> int:
        return next(self._lease_ids)


class _WorkerLink:
    def __init__(self, hub: Hub, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.hub = hub
        self._reader = reader
        self._writer = writer
        self._outbox = frames.Outbox(writer)
        self.leases: dict[int, Lease] = {}
        self._calls: dict[int, asyncio.Task[Any]] = {}
        # A lease's pin still running (a restore into its slot), by lease id: the lease goes
        # back once it ended (_give_back).
        self._pinning: dict[int, asyncio.Task[Any]] = {}
        self._sent_loaded: LoadedConfig | None = None
        self._sent_specs: dict[str, ModelSpec] = {}
        self.index: int | None = None
        self.pid: int | None = None
        self.closed = False
        # The daemon's watch (processes.py): the last ping sent, the last answered, and how
        # many in a row went unanswered.
        self.pinged = self.ponged = 0
        self.unanswered = 0
        self.applied = 0  # the last snapshot's version the worker applied

    def send(self, message: Any) -> None:
        self._outbox.put(message)

    def send_snapshot(self, now: _Now, full: bool, version: int = 0) -> None:
        """`now` as this worker has yet to hear it (`full`: all of it)."""
        sent, specs, loaded = self._sent_specs, now.specs, now.loaded
        snapshot = Snapshot(
            loaded=loaded if full or loaded is not self._sent_loaded else None,
            specs=specs if full else {n: s for n, s in specs.items() if sent.get(n) is not s},
            gone=frozenset(sent) - specs.keys(), ready=now.ready, closing=now.closing,
            version=version)
        self._sent_loaded, self._sent_specs = loaded, specs
        self.send(("snapshot", snapshot))

    async def run(self) -> None:
        self.send_snapshot(self.hub.now(), full=True, version=self.hub.version)
        handlers: dict[str, Callable[..., None]] = {
            "acquire": self._acquire, "pin": self._pin, "broken": self._broken,
            "cancel": self._cancel, "release": self._release, "refused": self._refused,
            "reused": self._reused, "records": self._records, "stalled": self._stalled,
            "ready": self._ready, "pong": self._pong, "applied": self._applied,
        }
        while True:
            try:
                messages = await frames.read(self._reader)
            except frames.LinkClosed:
                return
            for message in messages:
                handler = handlers.get(message[0])
                if handler is None:
                    log.warning("relay_worker.unknown_message", kind=str(message[0])[:40],
                                worker=self.index)
                    continue
                try:
                    handler(*message[1:])
                except Exception:
                    # A bug in one message's handling (booking a record, say) must not end
                    # the link: every request of that worker would be cut with it.
                    log.exception("relay_worker.message_failed", kind=message[0],
                                  worker=self.index)

    def close(self) -> None:
        """The worker is gone: what it waited for is dropped, what it held given back."""
        self.closed = True
        for task in self._calls.values():
            task.cancel()
        self._calls.clear()
        leases, self.leases = self.leases, {}
        if leases:
            log.warning("relay_worker.leases_returned", worker=self.index, pid=self.pid,
                        leases=len(leases),
                        note="the worker went away with requests under way")
        for lease_id, lease in leases.items():
            self._give_back(lease_id, lease)
        self._writer.close()

    def _give_back(self, lease_id: int, lease: Lease) -> None:
        """`lease` released, after its pin if one still runs. The worker's cancel and release
        of a request (or its death) come in one frame: released first, a pin cancelled in a
        restore unwound after it, and its slot was taken again by nobody (Slots._ready marks
        it unsure with Choice.take, which leases it) and stayed leased until the child's end.
        The daemon's own requests unwind in this order by construction."""
        pinning = self._pinning.pop(lease_id, None)
        if pinning is not None and not pinning.done():
            pinning.add_done_callback(lambda _: lease.release())
        else:
            lease.release()

    # -- calls: answered with ("reply", id, value) or ("raise", id, error) --------------------

    def _start(self, call_id: int, work: Coroutine[Any, Any, Any], caller: str | None = None,
               done: Callable[[Any], Any] | None = None, rid: str | None = None) -> None:
        async def call() -> Any:
            # This task's own context: the lease pins in the caller's space, the log lines
            # carry the request's id.
            CALLER.set(caller)
            if rid is not None:
                self.hub.ids.bind(rid)
            value = await work
            return done(value) if done is not None else value

        task = asyncio.get_running_loop().create_task(call())
        self._calls[call_id] = task
        task.add_done_callback(lambda t: self._answer(call_id, t, work))

    def _answer(self, call_id: int, task: asyncio.Task[Any],
                work: Coroutine[Any, Any, Any]) -> None:
        self._calls.pop(call_id, None)
        if task.cancelled():
            # The worker cancelled the call, or went away; maybe before the task began (a
            # cancel in the frame after the call's, read in the same turn): its work, never
            # awaited then, is closed (else a RuntimeWarning in the log).
            work.close()
            return
        exc = task.exception()
        if exc is not None:
            self.send(("raise", call_id, frames.error_of(exc)))
        else:
            self.send(("reply", call_id, task.result()))

    def _acquire(self, call_id: int, name: str, ignore_backoff: bool,
                 caller: str | None, rid: str | None) -> None:
        self._start(call_id, self.hub.daemon.acquire(name, ignore_backoff=ignore_backoff),
                    caller, self._granted, rid)

    def _granted(self, lease: Lease) -> LeaseGrant:
        if self.closed:  # granted as the worker went away
            lease.release()
            raise asyncio.CancelledError
        lease_id = self.hub.next_lease_id()
        self.leases[lease_id] = lease
        return LeaseGrant(
            lease_id=lease_id, model=lease.model, instance=lease.instance, pid=lease.pid,
            base_url=lease.base_url, headers=dict(lease.headers),
            first_byte_timeout=lease.first_byte_timeout, idle_timeout=lease.idle_timeout,
            ready_since=lease.ready_since, served_name=lease.served_name,
            pins=lease.pins_requests())

    def _pin(self, call_id: int, lease_id: int, url: str, body: Any,
             caller: str | None, rid: str | None) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            self.send(("reply", call_id, (body, None, None)))
            return

        async def pin() -> tuple[Any, int | None, Any]:
            pinned = await lease.pin(url, body)
            return pinned, lease.slot, lease.restored

        self._start(call_id, pin(), caller, rid=rid)
        task = self._calls[call_id]
        self._pinning[lease_id] = task
        task.add_done_callback(
            lambda t: self._pinning.pop(lease_id, None) if self._pinning.get(lease_id) is t
            else None)

    def _broken(self, call_id: int, lease_id: int, timed_out: bool, rid: str | None) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:  # given back already: nothing left to check
            self.send(("reply", call_id, Broken(unresponsive=False, detail=None)))
            return
        self._start(call_id, lease.report_broken(timed_out=timed_out), rid=rid)

    def _cancel(self, call_id: int) -> None:
        task = self._calls.get(call_id)
        if task is not None:
            task.cancel()

    # -- notes: no answer --------------------------------------------------------------------

    def _release(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self._give_back(lease_id, lease)

    def _refused(self, lease_id: int) -> None:
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.refused()

    def _reused(self, lease_id: int, cache_n: int | None) -> None:
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.reused(cache_n)

    def _records(self, records: list[tuple[RequestRecord, bool]]) -> None:
        book = self.hub.accounting.book
        for record, refused in records:
            book(record, refused, logged=True)  # the worker wrote its line, with its id

    def _stalled(self, model: str | None) -> None:
        self.hub.accounting.metrics.client_stalled(model)

    def _applied(self, version: int) -> None:
        self.applied = max(self.applied, version)
        self.hub.applied_changed.set()

    def _pong(self, seq: int) -> None:
        self.ponged = max(self.ponged, seq)

    def ping(self, seq: int) -> int:
        """Whether the last ping was answered is counted, then `seq` sent: how many pings in
        a row this worker left unanswered (one after a stall of the daemon's own loop, whose
        reader had not read the answer yet; never three)."""
        self.unanswered = 0 if self.ponged >= self.pinged else self.unanswered + 1
        self.pinged = seq
        self.send(("ping", seq))
        return self.unanswered

    def _ready(self, index: int, pid: int) -> None:
        self.index, self.pid = index, pid
        self.hub.ready[index] = pid
        self.hub.ready_changed.set()
        log.info("relay_worker.ready", worker=index, pid=pid)
