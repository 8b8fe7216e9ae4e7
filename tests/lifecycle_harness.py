"""A whole daemon in-process over fake upstream children (tests/fake_upstream.py: llama-server's
command line, a port open in milliseconds), driven as an operator would: config text in,
reloads by swapping that text, requests and admin commands through the daemon's port."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil

from corral.supervisor.config import LoadedConfig, parse_config
from corral.supervisor.daemon import Daemon
from corral.supervisor.instance import Instance, State

SOURCE = Path(__file__).resolve().parent / "fake_upstream.py"


def _fake_binary() -> Path:
    """tests/fake_upstream.py as an executable run by this interpreter, without site-packages:
    its own shebang finds `python3` on PATH, which may be a version manager's shim that costs
    more than the fake's whole start (pyenv's: ~70 ms against ~9)."""
    folder = Path(tempfile.mkdtemp(prefix="corral-fake-upstream-"))
    atexit.register(shutil.rmtree, folder, True)
    binary = folder / "fake-llama-server"
    binary.write_text(f"#!{sys.executable} -S\n" + SOURCE.read_text().split("\n", 1)[1])
    binary.chmod(0o755)
    return binary


FAKE = _fake_binary()

DEFAULTS = {"ttl": 300, "stop_grace": 1, "queue_timeout": 4, "start_backoff": 0.2,
            "start_backoff_max": 0.5, "health_interval": 0.2, "health_timeout": 0.5,
            "health_failures": 1, "start_timeout": 10, "ctx": 512}


def config_text(models: dict[str, dict[str, Any]], **top: Any) -> str:
    import json
    doc = {"binary": str(FAKE), "shutdown_grace": 0.2, "defaults": DEFAULTS,
           "models": models, **top}
    return json.dumps(doc)  # YAML reads JSON


class Harness:
    def __init__(self, text: str, folder: Path):
        self.text = text
        self.folder = folder
        self.daemon = Daemon(self._parse(), folder / "children.json",
                             config_loader=self._parse)
        self.stopped_pids: set[int] = set()  # children SIGSTOPped by a test

    def _parse(self) -> LoadedConfig:
        return parse_config(self.text, source=self.folder / "corral.yaml")

    async def reload(self, text: str) -> None:
        self.text = text
        attempt = await self.daemon.reload("admin")
        assert attempt.ok, attempt.issues

    def inst(self, name: str) -> Instance:
        return self.daemon.herd.member(name)

    async def until(self, predicate: Callable[[], bool], timeout: float = 10.0,
                    what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout}s: {what or predicate}; "
                                     f"{self.states()}")
            await self.daemon.herd.changed.wait(0.05)

    def states(self) -> dict[str, Any]:
        return {i.name: (str(i.state), i.pid) for i in self.daemon.herd.everyone()} | {
            f"model {m.name}": (str(m.state()), str(m.wish), m.waiting)
            for m in self.daemon.herd.models.values()}

    def freeze(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.stopped_pids.add(pid)

    def children(self) -> set[int]:
        """The fake children that run now (not zombies)."""
        found = set()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if str(FAKE) in " ".join(child.cmdline()) \
                        and child.status() != psutil.STATUS_ZOMBIE:
                    found.add(child.pid)
        return found

    def owned(self) -> set[int]:
        return {i.pid for i in self.daemon.herd.everyone()
                if i.pid is not None and i.state is not State.STOPPED}


@contextlib.asynccontextmanager
async def running(text: str, folder: Path) -> AsyncIterator[Harness]:
    harness = Harness(text, folder)
    await harness.daemon.start()
    try:
        yield harness
    finally:
        for pid in harness.stopped_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(harness.daemon.close(0.5), 30)
        assert not harness.children(), "a child outlived the daemon"
