"""Loading progress in a chat stream: a request that has to wait for a cold model can see the
load before the answer, instead of silence. Sent as `reasoning_content` deltas, which Open WebUI
(and other clients of reasoning models) show as the model's thinking, apart from the answer.

Honest about what corral knows: the state and the time so far; no made-up percentages. Never
the child's own log lines: what a child prints as it starts (paths, ports, a generated key)
stays in the logs and /admin."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from corral.proxy import client_io, request_id
from corral.proxy.sse import DONE, error_event, frame, sse_headers
from corral.supervisor.errors import UnknownModel
from corral.supervisor.events import Event, Subscription
from corral.supervisor.port import Lease, Supervisor

HEADER = "X-Corral-Progress"
_PROGRESS_KINDS = frozenset({"load", "load_progress", "loaded", "load_failed", "stop"})
_YES = ("1", "true", "yes", "on")


def wanted(request: web.Request, body: dict[str, Any], by_default: bool) -> bool:
    """A streamed chat request, opted in by its header or its model's `loading_progress`."""
    if body.get("stream") is not True or request.path != "/v1/chat/completions":
        return False
    asked = request.headers.get(HEADER)
    return asked.strip().lower() in _YES if asked is not None else by_default


class ProgressStream:
    """The client's event stream, opened before the model is ready."""

    def __init__(self, request: web.Request, model: str) -> None:
        self.request = request
        self.model = model
        self.response = web.StreamResponse(status=200, headers=sse_headers())
        # Every write has the client's deadline: a client that stops reading while the model
        # loads is cut off (ClientStalled), and its wait with it.
        self.out = client_io.writer(request, self.response, model)
        self._id = f"chatcmpl-corral-load-{request_id.current() or int(time.time())}"

    async def open(self) -> web.StreamResponse:
        await self.out.prepare()
        return self.response

    def _chunk(self, text: str) -> bytes:
        return frame({"id": self._id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": self.model,
                      "choices": [{"index": 0, "finish_reason": None,
                                   "delta": {"role": "assistant", "reasoning_content": text}}]})

    async def say(self, text: str) -> None:
        await self.out.write(self._chunk(text))

    @property
    def opened(self) -> bool:
        return self.response.prepared

    async def acquire(self, daemon: Supervisor, every: float = 1.0, grace: float = 0.5) -> Lease:
        """daemon.acquire(model), telling the client what happens while it waits. The stream
        opens only once the wait has lasted `grace` seconds: a quick answer, or a quick
        refusal (queue full, back-off: a 429 or 503 with Retry-After), comes as it would
        without progress. A client that hangs up cancels the wait."""
        began = time.monotonic()
        sub = daemon.events.subscribe(kinds=_PROGRESS_KINDS)
        task = asyncio.ensure_future(daemon.acquire(self.model))
        try:
            await asyncio.wait([task], timeout=grace)
            if not task.done():
                await self._report(daemon, task, sub, began, every)
            lease = task.result()
        except BaseException:
            if not task.done():
                task.cancel()
            # The acquire may still come back with a lease (a slot granted at the very moment
            # of the cancel): whenever it ends, a lease nobody took goes back.
            task.add_done_callback(_give_back)
            raise
        finally:
            daemon.events.unsubscribe(sub)
        if self.opened:
            try:
                await self.say(f"{self.model} ready after {time.monotonic() - began:.1f} s.\n\n")
            except BaseException:
                lease.release()
                raise
        return lease

    async def _report(self, daemon: Supervisor, task: asyncio.Future[Lease], sub: Subscription,
                      began: float, every: float) -> None:
        """Open the stream and write a line a second until `task` is done: the state and the
        time so far (on the loader's own ticks)."""
        await self.open()
        await self.say(f"Loading {self.model}…\n")
        last_write = time.monotonic()
        while not task.done():
            waiter = asyncio.ensure_future(
                sub.next(max(0.0, every - (time.monotonic() - last_write))))
            try:
                either: list[asyncio.Future[Any]] = [task, waiter]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            finally:
                _drop(waiter)
            if task.done():
                return
            try:
                event = waiter.result()
            except StopAsyncIteration:  # the bus closed: corral is stopping
                await asyncio.wait([task])
                return
            ours = event is not None and event.data.get("model") == self.model \
                and event.kind == "load_progress"
            if not ours and time.monotonic() - last_write < every:
                continue  # another model's event: the next line is due later
            try:
                state = str(daemon.status(self.model).state)
            except UnknownModel:  # removed by a reload meanwhile
                state = "waiting"
            # The stage and the time, never the child's own log line: what a child prints as
            # it starts (paths, ports, a generated key) stays in the logs and /admin.
            await self.say(f"{state} {time.monotonic() - began:.0f} s\n")
            last_write = time.monotonic()

    async def fail(self, message: str, code: str) -> web.StreamResponse:
        """The stream is open, so the error goes in it (the status line is gone)."""
        await self.out.write(error_event(message, code=code))
        await self.out.write(DONE)
        await self.out.finish()
        return self.response


def _give_back(task: asyncio.Future[Lease]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().release()


def _drop(waiter: asyncio.Future[Event | None]) -> None:
    """Cancel a wait that lost the race, or read what it ended with (so asyncio does not log
    an exception nobody retrieved)."""
    if not waiter.done():
        waiter.cancel()
    elif not waiter.cancelled():
        waiter.exception()
