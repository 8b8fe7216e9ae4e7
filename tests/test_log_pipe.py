"""A child's output read in batches (supervisor/log_pipe.py): every line arrives, in order, in
few reads however the child writes them."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar

import pytest
import uvloop

from corral.supervisor import log_pipe
from corral.supervisor.process import ChildProcess

# A child that writes `n` lines, each in its own flushed write, `pause` seconds apart, then a
# last line without a newline.
WRITER = """
import sys, time
n, pause = int(sys.argv[1]), float(sys.argv[2])
for i in range(n):
    sys.stdout.write(f"line {i}\\n"); sys.stdout.flush()
    time.sleep(pause)
sys.stdout.write("the end, unterminated"); sys.stdout.flush()
"""


async def _read_child(*argv: str) -> tuple[list[list[bytes]], float]:
    """Runs `python argv...` with its stdout on a batching reader's pipe: the batches the
    reader handed on, and how long reading took."""
    read_end, write_end = log_pipe.open_pipe()
    child = subprocess.Popen([sys.executable, *argv], stdout=write_end)
    os.close(write_end)
    batches: list[list[bytes]] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader = log_pipe.LineReader(batches.append)
    reader.batch()
    await asyncio.wait_for(log_pipe.read_lines(reader, read_end), 60)
    elapsed = loop.time() - started
    assert child.wait(10) == 0
    return batches, elapsed


def _lines(batches: list[list[bytes]]) -> list[bytes]:
    return [line for batch in batches for line in batch]


def test_every_line_in_order_in_few_batches() -> None:
    batches, elapsed = uvloop.run(_read_child("-c", WRITER, "400", "0.001"))
    assert _lines(batches) == [f"line {i}".encode() for i in range(400)] + [
        b"the end, unterminated"]
    # One batch per BATCH_S at most while the child writes (plus the first and the last):
    # read as they came, 400 writes would have been ~400 batches.
    most = elapsed / log_pipe.BATCH_S + 3
    assert len(batches) <= most, (len(batches), elapsed)
    assert len(batches) < 100


def test_a_chatty_child_is_not_blocked_by_the_pause() -> None:
    # 4 MB in one go: more than the pipe holds (1 MiB, or 64 KiB where the kernel refuses):
    # the child blocks only until the next batch, and nothing is lost.
    code = "import sys\nfor i in range(200000): sys.stdout.write(f'{i:019d}\\n')\n"
    got = _lines(uvloop.run(_read_child("-c", code))[0])
    assert len(got) == 200000 and got[-1] == b"%019d" % 199999 and got[123] == b"%019d" % 123


def test_a_line_past_the_limit_is_cut_and_the_rest_of_it_dropped() -> None:
    limit, mark = log_pipe.LINE_LIMIT, log_pipe.CUT_MARK
    # Unterminated past the limit, in several writes; then whole lines past it in one write.
    code = (f"import sys, time\nw = sys.stdout.buffer\n"
            f"for _ in range(5): w.write(b'x' * {limit}); w.flush(); time.sleep(0.01)\n"
            f"w.write(b'x\\nnext\\n' + b'y' * {limit * 3} + b'\\n' + b'z' * {limit} + b'\\nend')\n")
    got = _lines(uvloop.run(_read_child("-c", code))[0])
    assert got == [b"x" * limit + mark, b"next", b"y" * limit + mark, b"z" * limit, b"end"]


def test_a_child_writing_long_lines_costs_its_log_ring_kilobytes_not_megabytes() -> None:
    # 50 lines of 256 KiB of invalid UTF-8: the ring held all of them whole (13 M characters;
    # at 1 MiB a line, 400 of them: the daemon at 800 MB, /admin logs 1.6 GB of JSON).
    code = ("import sys\nw = sys.stdout.buffer\n"
            "for _ in range(50): w.write(b'\\xff' * 262144 + b'\\n')\n"
            "w.write(b'the end\\n')\n")

    async def run() -> list[str]:
        child = ChildProcess("long-lines", [sys.executable, "-c", code], {})
        await child.spawn()
        assert await asyncio.wait_for(child.wait(), 30) == 0
        return list(child.logs)

    lines = uvloop.run(run())
    assert len(lines) == 51 and lines[-1] == "the end"
    assert all(len(line) <= log_pipe.LINE_LIMIT + len(log_pipe.CUT_MARK) for line in lines)
    assert lines[0].endswith(log_pipe.CUT_MARK.decode())


def test_a_serving_child_keeps_lines_and_wakes_a_reader_once_per_batch() -> None:
    async def run() -> tuple[list[str], int, int, float]:
        child = ChildProcess("writer", [sys.executable, "-c", WRITER, "50", "0.001"], {})
        await child.spawn()

        async def ready(_: float) -> bool:
            return True

        await child.wait_healthy(ready, 10)  # serving: its output is read in batches now
        wakes = 0

        async def follow() -> None:
            nonlocal wakes
            while True:
                await child.logs.wait(None)
                wakes += 1

        follower = asyncio.create_task(follow())
        loop = asyncio.get_running_loop()
        started = loop.time()
        code = await asyncio.wait_for(child.wait(), 30)
        follower.cancel()
        return list(child.logs), wakes, code, loop.time() - started

    lines, wakes, code, elapsed = uvloop.run(run())
    assert code == 0
    assert lines == [f"line {i}" for i in range(50)] + ["the end, unterminated"]
    # Once serving (wait_healthy said so), a wake-up per batch: one per BATCH_S at most, plus
    # the last lines read at the exit.
    assert 1 <= wakes <= elapsed / log_pipe.BATCH_S + 3, (wakes, elapsed)


class _StealingFile(io.FileIO):
    """The file object read_lines hands the loop, probed: when the loop closes it, a fresh pipe
    is opened first. Linux gives out the lowest free number, so if the descriptor was already
    closed, the new pipe takes that number, and a second close would close it (uvloop#763:
    another thread's /proc read got EBADF that way)."""

    stolen: ClassVar[list[int]] = []

    def close(self) -> None:
        read_end, write_end = os.pipe()
        self.stolen.extend((read_end, write_end))
        super().close()


def _probe_fdopen(fd: int, mode: str, buffering: int = -1, closefd: bool = True) -> io.FileIO:
    assert mode == "rb" and buffering == 0
    return _StealingFile(fd, "rb", closefd=closefd)


async def _read_a_pipe_to_its_end() -> list[bytes]:
    read_end, write_end = log_pipe.open_pipe()
    os.write(write_end, b"one\ntwo")
    os.close(write_end)
    lines: list[bytes] = []
    await asyncio.wait_for(log_pipe.read_lines(log_pipe.LineReader(lines.extend), read_end), 10)
    return lines


@pytest.mark.parametrize("run", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_the_pipe_is_closed_once_and_nothing_else_is(
        run: Callable[[Coroutine[Any, Any, list[bytes]]], list[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _StealingFile.stolen = []
    monkeypatch.setattr(os, "fdopen", _probe_fdopen)
    before = set(os.listdir("/proc/self/fd"))
    assert run(_read_a_pipe_to_its_end()) == [b"one", b"two"]
    monkeypatch.undo()
    assert _StealingFile.stolen, "the loop never closed the file object"
    try:
        for fd in _StealingFile.stolen:
            os.fstat(fd)  # EBADF: read_lines's close hit a number it no longer owned
    finally:
        for fd in _StealingFile.stolen:
            with contextlib.suppress(OSError):
                os.close(fd)
    # ...and the pipe's own read end is closed: nothing new is left open.
    assert set(os.listdir("/proc/self/fd")) <= before
