"""What happens in the daemon, as a stream of events: state changes, loads (with progress),
stops and their causes, reloads, group outcomes, requests.

One bus per daemon. Listeners of two kinds:
- synchronous callbacks (metrics, the systemd notifier): called in publish order, on the loop;
  one that raises is logged and skipped, never the publisher's problem;
- subscriptions (GET /admin/events): a bounded queue each, fed without awaiting, so a slow
  reader never slows the daemon. A reader that falls a whole queue behind is cut off, told
  so, and may come back with the last id it saw (history replays what it missed).

Ids count 1, 2, 3, ... from the daemon's start: small enough to read (`id: 7`), and in the
order events happened. An id above the last one given out was given by an earlier daemon (a
reader reconnecting across a restart): that reader gets the whole history."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("corral.events")

# Events a reader may fall behind before it is cut off.
MAX_BEHIND = 1000

# Why a child was stopped: bounded, so it can label a metric.
STOP_CAUSES = ("ttl", "lru", "memory", "kv", "unload", "reload", "scale_down", "rebalance",
               "shutdown", "other")


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    time: float  # wall clock
    kind: str
    data: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.time, "kind": self.kind, **self.data}


@dataclass(eq=False)
class Subscription:
    """One reader's queue. It ends when the reader fell too far behind (`lagged` is then
    True) or the bus closed."""

    bus: EventBus
    kinds: frozenset[str] | None
    # One place more than MAX_BEHIND: the end marker always fits, and no event is dropped to
    # make room for it (the reader resumes after the last one it got).
    queue: asyncio.Queue[Event | None] = field(
        default_factory=lambda: asyncio.Queue(MAX_BEHIND + 1))
    lagged: bool = False
    ended: bool = False

    def offer(self, event: Event) -> None:
        if self.ended or (self.kinds is not None and event.kind not in self.kinds):
            return
        if self.queue.qsize() >= MAX_BEHIND:
            self.lagged = True
            self.bus.unsubscribe(self)
            self._end()
            return
        self.queue.put_nowait(event)

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(None)

    def pending(self) -> list[Event]:
        """The events queued now, without waiting (the end marker stays queued)."""
        events: list[Event] = []
        while not self.queue.empty():
            event = self.queue.get_nowait()
            if event is None:
                self.queue.put_nowait(None)
                break
            events.append(event)
        return events

    async def next(self, timeout: float) -> Event | None:
        """The next event, or None after `timeout` seconds of quiet. Raises StopAsyncIteration
        once the subscription ended."""
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None
        if event is None:
            raise StopAsyncIteration
        return event


class EventBus:
    def __init__(self, history: int = 500) -> None:
        self._ids = itertools.count(1)
        self._last_id = 0
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._listeners: list[Callable[[Event], None]] = []
        self._failing: set[int] = set()  # listeners whose failure was logged (once each)
        self._subscriptions: set[Subscription] = set()

    def publish(self, kind: str, history: bool = True, **data: Any) -> Event:
        """`history=False`: frequent events (each request) that should not push the rarer
        ones (state, loads, reloads) out of what a reconnecting reader can replay."""
        event = Event(next(self._ids), time.time(), kind, data)
        self._last_id = event.id
        if history:
            self._history.append(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                if id(listener) not in self._failing:  # a bug, not a flood of log lines
                    self._failing.add(id(listener))
                    log.exception("events.listener_failed", kind=kind,
                                  listener=getattr(listener, "__qualname__", repr(listener)))
        for sub in list(self._subscriptions):
            sub.offer(event)
        return event

    def listen(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def subscribe(self, after: int | None = None, kinds: frozenset[str] | None = None,
                  last: int = 0) -> Subscription:
        """A new reader. With `after` (an id it saw), the events since that id still in
        history come first; an `after` this bus never reached came from an earlier daemon,
        so all of history comes first. Without `after`, the `last` most recent events of
        history (of the `kinds` wanted) come first."""
        sub = Subscription(self, kinds)
        if after is not None:
            since = after if after <= self._last_id else 0
            replay = [e for e in self._history if e.id > since]
        else:
            replay = self.recent(last, kinds) if last > 0 else []
        for event in replay:
            sub.offer(event)
        if not sub.ended:
            self._subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)

    def recent(self, limit: int = 100, kinds: frozenset[str] | None = None) -> list[Event]:
        events = [e for e in self._history if kinds is None or e.kind in kinds]
        return events[-limit:]

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def close(self) -> None:
        for sub in list(self._subscriptions):
            self.unsubscribe(sub)
            sub._end()
