"""A child's output, read in batches.

llama-server logs about 1 KB in ten lines per request, in several writes. Read as they come,
that was ~2.7 reads, as many event-loop wake-ups and a task step each per relayed request
(strace on the proxy_overhead load): the daemon's costliest thing after the relay itself, paid
on every request whichever way it reached the child. Here the pipe is read when it has data,
then left alone for BATCH_S: whatever the child wrote meanwhile waits in the pipe (grown to
PIPE_BYTES where the kernel allows) and comes in one read. A quiet child costs nothing; a
chatty one at most 1 / BATCH_S reads a second. Lines reach the log ring at most BATCH_S late.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable
from typing import cast

import uvloop

BATCH_S = 0.02
# 1 MiB: Linux's default pipe-max-size for an unprivileged process. At that size a child
# would have to log 50 MB/s to fill it within a batch and block on its own write.
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# The most of one line that is kept: the rest of it, up to its newline, is dropped as it comes
# (a child printing a progress bar with carriage returns only, binary, a prompt echoed whole).
# The log ring keeps 400 lines a child: at the 1 MiB this was, a child writing long lines made
# the daemon hold ~800 MB (invalid UTF-8 decodes to U+FFFD, 2 bytes each) and answer
# /admin/models/<m>/logs with 1.6 GB of JSON. At 8 KiB: a few MB at worst, and no line of a
# server's own log is cut (llama-server's and vLLM's are under 1 KiB).
LINE_LIMIT = 8 * 1024
CUT_MARK = b" [cut by corral: longer than %d bytes]" % LINE_LIMIT


def open_pipe() -> tuple[int, int]:
    """(read end, write end) for a child's stdout and stderr, the read end non-blocking and
    close-on-exec (the child gets only the write end)."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # a smaller pipe only means more reads
        fcntl.fcntl(read_end, _F_SETPIPE_SZ, PIPE_BYTES)
    os.set_blocking(read_end, False)
    return read_end, write_end


class LineReader(asyncio.Protocol):
    """Splits what the pipe delivers into lines for `keep` (one call per batch: a list of raw
    lines, without their newlines); `done` resolves at end of file."""

    def __init__(self, keep: Callable[[list[bytes]], None]) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._keep = keep
        self._pending = b""
        self._dropping = False  # past LINE_LIMIT of a line: the rest of it goes unread
        self._transport: asyncio.ReadTransport | None = None
        self._resume: asyncio.TimerHandle | None = None
        # Off until the child serves (batch()): while it loads its lines are read as they
        # come, for `corral logs -f` and for why a start failed.
        self._batching = False
        self.done: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's pipe transport is not registered as an asyncio.ReadTransport, but it is one.
        self._transport = cast(asyncio.ReadTransport, transport)

    def data_received(self, data: bytes) -> None:
        if self._dropping:  # the rest of a line already kept, cut
            end = data.find(b"\n")
            self._dropping = end < 0
            data = b"" if end < 0 else data[end + 1:]
        if data:
            *lines, self._pending = (self._pending + data).split(b"\n")
            if len(self._pending) > LINE_LIMIT:
                lines.append(self._pending)
                self._pending = b""
                self._dropping = True
            if lines:
                self._keep([_cut(line) for line in lines])
        transport = self._transport
        if (self._batching and transport is not None and self._resume is None
                and not transport.is_closing()):
            transport.pause_reading()
            self._resume = self._loop.call_later(BATCH_S, self._read_again)

    def batch(self) -> None:
        """From now on, a read at most every BATCH_S."""
        self._batching = True

    def read_to_end(self) -> None:
        """No more pauses: the child has exited, and what it wrote last is wanted now (why it
        failed), not a batch later."""
        self._batching = False
        if self._resume is not None:
            self._resume.cancel()
            self._read_again()

    def _read_again(self) -> None:
        self._resume = None
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._pending:
            self._keep([self._pending])
            self._pending = b""
        if not self.done.done():
            self.done.set_result(None)


def _cut(line: bytes) -> bytes:
    return line if len(line) <= LINE_LIMIT else line[:LINE_LIMIT] + CUT_MARK


async def read_lines(reader: LineReader, read_end: int) -> None:
    """Feed `reader` from `read_end` (which this takes over and closes) until end of file."""
    loop = asyncio.get_running_loop()
    # uvloop hands the number to libuv, which closes it, and then closes the file object too
    # (uvloop#763): a second close(2) of a number that another thread may have been given
    # in between (the memory reader's /proc opens got EBADF that way). Under uvloop the file
    # object must not own the descriptor; under asyncio's own loop it is the only closer.
    file = os.fdopen(read_end, "rb", buffering=0, closefd=not isinstance(loop, uvloop.Loop))
    transport, _ = await loop.connect_read_pipe(lambda: reader, file)
    try:
        await reader.done
    finally:
        transport.close()
