"""Loading progress in a chat stream: a request that has to wait for a cold model can see the
load before the answer, instead of silence. Sent as `reasoning_content` deltas, which Open WebUI
(and other clients of reasoning models) show as the model's thinking, apart from the answer.

Honest about what corral knows: the state, the time so far, and the last line of the child's
log; no made-up percentages."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from corral.proxy import request_id
from corral.proxy.sse import DONE, error_event, frame, sse_headers
from corral.supervisor.daemon import Daemon
from corral.supervisor.instance import Lease

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
        self._id = f"chatcmpl-corral-load-{request_id.current() or int(time.time())}"

    async def open(self) -> web.StreamResponse:
        await self.response.prepare(self.request)
        return self.response

    def _chunk(self, text: str) -> bytes:
        return frame({"id": self._id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": self.model,
                      "choices": [{"index": 0, "finish_reason": None,
                                   "delta": {"role": "assistant", "reasoning_content": text}}]})

    async def say(self, text: str) -> None:
        await self.response.write(self._chunk(text))

    async def acquire(self, daemon: Daemon, every: float = 1.0) -> Lease:
        """daemon.acquire(model), telling the client what happens while it waits. A client
        that hangs up cancels the wait; a lease got at that very moment is given back."""
        began = time.monotonic()
        sub = daemon.events.subscribe(kinds=_PROGRESS_KINDS)
        task = asyncio.ensure_future(daemon.acquire(self.model))
        try:
            await self.say(f"Loading {self.model}…\n")
            last_line: str | None = None
            while not task.done():
                # The loader's own ticks (a second apart, with the child's last log line)
                # set the pace; a wait that is no load (a queue, room) still ticks each second.
                waiter = asyncio.ensure_future(sub.next(every))
                await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    waiter.cancel()
                    break
                try:
                    event = waiter.result()
                except StopAsyncIteration:  # the bus closed: corral is stopping
                    await asyncio.wait([task])
                    break
                line = None
                if event is not None:
                    if event.data.get("model") != self.model or event.kind != "load_progress":
                        continue
                    line = event.data.get("log")
                inst = daemon.instances.get(self.model)
                text = f"{inst.state if inst else 'waiting'} " \
                       f"{time.monotonic() - began:.0f} s"
                if line and line != last_line:
                    text += f": {line.strip()[:200]}"
                    last_line = line
                await self.say(text + "\n")
            lease = task.result()
            await self.say(f"{self.model} ready after {time.monotonic() - began:.1f} s.\n\n")
            return lease
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            elif not task.cancelled() and task.exception() is None:
                task.result().release()
            raise
        finally:
            daemon.events.unsubscribe(sub)

    async def fail(self, message: str, code: str) -> web.StreamResponse:
        """The stream is open, so the error goes in it (the status line is gone)."""
        await self.response.write(error_event(message, code=code))
        await self.response.write(DONE)
        await self.response.write_eof()
        return self.response
