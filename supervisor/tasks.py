"""Tasks with an owner: every background task corral starts belongs to one TaskScope, which
keeps it referenced, runs it in a fresh context, logs how it crashed, and cancels and awaits
it when its owner closes.

Not `asyncio.TaskGroup`: a TaskGroup cancels every sibling and its parent task when one of
its tasks fails (one model's refused restart must not take the daemon down), and it lives
inside one `async with` block, while the daemon's and a model's tasks live from a start()
to a close() called by someone else. What it guarantees is what matters here and is kept:
no task outlives its owner, none is left unreferenced, none ends with an exception nobody
retrieved."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger("corral.tasks")


class ScopeClosed(RuntimeError):
    """A task was asked of an owner that has closed: nothing may start after close()."""


class TaskScope:
    def __init__(self, owner: str):
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        # Tasks whose caller waits for them (run()): their outcome is the caller's to handle,
        # logged here only once the caller has gone away.
        self._awaited: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` as a task this scope owns, in a fresh context (started from inside a
        request, it must not carry that request's id into every log line it writes). An
        exception it ends with is logged, never left unretrieved."""
        if self._closed:
            coro.close()
            raise ScopeClosed(f"{self.owner} has closed: {name or 'a task'} was not started")
        task = asyncio.create_task(coro, name=name, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def run(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> T:
        """Run `coro` as this scope's task and wait for it: a caller that is cancelled (an
        HTTP client hanging up) only stops waiting; the work goes on to its end, or to the
        owner's close()."""
        task = self.spawn(coro, name)
        self._awaited.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._awaited.discard(task)  # nobody waits now: a crash is logged
            raise

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task in self._awaited:
            self._awaited.discard(task)
            return  # its caller has the result, or the exception
        if not task.cancelled() and task.exception() is not None:
            log.error("task.crashed", owner=self.owner, task=task.get_name(),
                      exc_info=task.exception())

    def cancel(self) -> None:
        """Cancel every task now (the scope stays open: new tasks may start)."""
        for task in list(self._tasks):
            task.cancel()

    async def close(self, timeout: float = 5.0) -> None:
        """No new task from now on; cancel the running ones and wait for them (bounded: a task
        that will not end must not hang a shutdown)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                log.error("task.did_not_end", owner=self.owner, task=task.get_name(),
                          timeout=timeout)
