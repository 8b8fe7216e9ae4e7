"""The instance's closed state machine: states, the transitions allowed, its start back-off,
its health record."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from corral.supervisor.port import State

TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.READY, State.FAILED, State.STOPPING}),
    State.READY: frozenset({State.DRAINING, State.STOPPING, State.FAILED}),
    # A child that dies while draining for a stop does not fail: the stop owns the ending.
    State.DRAINING: frozenset({State.STOPPING}),
    # A stop, once begun, always ends in STOPPED (its task owns the ending).
    State.STOPPING: frozenset({State.STOPPED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPING}),
}

# States in which a child holds (or is about to hold, or still holds) memory.
LOADED_STATES = frozenset({State.STARTING, State.READY, State.DRAINING, State.STOPPING})
# States a start may begin from (and only while no stop is pending).
STARTABLE = frozenset({State.STOPPED, State.FAILED})


class IllegalTransition(RuntimeError):
    """A transition the table does not allow, or one from a state the caller did not expect
    (compare-and-swap failed): the caller's picture of the instance is out of date."""


@dataclass
class Backoff:
    """Consecutive failed starts and when the next may begin (exponential, capped)."""

    failures: int = 0
    retry_at: float | None = None  # monotonic; no new start before it

    def left(self, now: float) -> float:
        return 0.0 if self.retry_at is None else max(0.0, self.retry_at - now)

    def failed(self, base: float, cap: float, now: float) -> float | None:
        """Count one more failure; the delay before the next try (None: none)."""
        self.failures += 1
        if base <= 0:
            self.retry_at = None
            return None
        delay = float(min(base * 2.0 ** (self.failures - 1), cap))
        self.retry_at = now + delay
        return delay

    def reset(self) -> None:
        self.failures, self.retry_at = 0, None


class Changed:
    """A broadcast 'something changed' that any number of tasks can await with a timeout."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()  # re-armed for the next change

    async def wait(self, timeout: float | None) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
        # arrives as the event fires (the waiter then goes on as if nobody had cancelled it:
        # an unload's cancelled replica start went on to start the replica).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._event.wait()


@dataclass
class Health:
    """What the watchdog saw of a ready child's /health."""

    last_probe: float | None = None  # wall clock
    last_ok: float | None = None
    failures: int = 0  # consecutive
    last_error: str | None = None

    # A remote has no /health corral probes: its requests are its probes.
    def answered(self, now: float) -> Health:
        return Health(last_probe=now, last_ok=now)

    def failed(self, now: float, error: str) -> Health:
        return Health(last_probe=now, last_ok=self.last_ok, failures=self.failures + 1,
                      last_error=error)

    def as_dict(self) -> dict[str, Any]:
        return {"last_probe": self.last_probe, "last_ok": self.last_ok,
                "failures": self.failures, "last_error": self.last_error}
