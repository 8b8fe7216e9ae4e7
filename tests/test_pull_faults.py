"""Pulling models when the machine, not the server, fails: a disk that fills up partway (after
the free-space check passed), a models_dir that cannot be written, a cancel while a big part is
read back; and split models, pulled a shard at a time. The same local server as
tests/test_pull.py (its fixtures, imported). No network beyond 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import threading
import types
from collections.abc import Callable, Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import structlog
import test_pull
from test_pull import Server, run, sha

from corral.supervisor import pull
from corral.supervisor.config import parse_config
from corral.supervisor.discovery import discover
from corral.supervisor.events import EventBus

from tinymodel import write_tiny_llama

# test_pull's local server and small disks, as fixtures of this module too.
served, server, small_disk = test_pull.served, test_pull.server, test_pull.small_disk


def _roomy(path: Any) -> Any:
    """What disk_usage says of a disk another writer is about to fill: plenty free."""
    return shutil._ntuple_diskusage(1 << 40, 0, 1 << 39)


def _pull_in_daemon(models: Path, url: str) -> tuple[pull.PullJob, list[MutableMapping[str, Any]]]:
    """One pull through the daemon's Puller, and what it logged."""
    loaded = parse_config(f"models_dir: {models}\n")

    async def scenario() -> pull.PullJob:
        puller = pull.Puller(EventBus(), lambda: loaded)
        job = puller.start(url)
        await puller.wait(job.id)
        return job

    with structlog.testing.capture_logs() as logs:
        job = asyncio.run(scenario())
    return job, logs


def test_a_disk_that_fills_up_midway_keeps_an_exact_part_to_resume(
        server: Server, small_disk: Callable[[str], Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check saw room, then the disk filled (another writer): the write fails partway.
    The pull fails as NoSpace, not an OSError (a traceback in the daemon's log); the part
    holds exactly the bytes it says it kept, none of the torn write; a pull once there is room
    resumes from them."""
    disk = small_disk("1536k")
    data = b"GGUF" + os.urandom(3 << 20)
    server.blobs["full.gguf"] = data
    monkeypatch.setattr(shutil, "disk_usage", _roomy)
    job, logs = _pull_in_daemon(disk, server.url("/blob/full.gguf"))
    assert job.state == "failed" and job.error is not None, job
    assert "no room left" in job.error and "free space and pull again" in job.error, job.error
    assert not [e for e in logs if e.get("exc_info")], logs  # a failure, not a bug
    part = disk / ".full.gguf.part"
    kept = part.stat().st_size
    # What it says it kept is what is on disk: the torn write's bytes were cut back off.
    assert 0 < kept < len(data) and f"{kept} bytes kept" in job.error
    assert part.read_bytes() == data[:kept]

    monkeypatch.undo()
    subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
    result = run(pull.resolve_source(server.url("/blob/full.gguf")), disk)
    assert result.resumed_from == kept and server.requests[-1]["range"] == f"bytes={kept}-"
    assert (disk / "full.gguf").read_bytes() == data and result.sha256 == sha(data)


def test_a_models_dir_that_cannot_be_written_is_a_failed_pull_not_a_bug(
        server: Server, small_disk: Callable[[str], Path]) -> None:
    disk = small_disk("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    job, logs = _pull_in_daemon(disk, server.url("/blob/tiny.gguf"))
    assert job.state == "failed" and job.error is not None, job
    assert job.error.startswith("tiny.gguf: cannot write in") and "Read-only" in job.error
    assert not [e for e in logs if e.get("exc_info")], logs
    assert server.requests == []  # refused before the network
    with pytest.raises(pull.PullError, match="cannot write in"):
        run(pull.resolve_source(server.url("/blob/tiny.gguf")), disk / "sub")


def test_a_split_model_is_listed_once_all_its_shards_are_pulled(server: Server,
                                                                tmp_path: Path) -> None:
    """Each shard is its own pull (`owner/repo:m-00001-of-00003.gguf`, ...): the model the
    first one names is no model until the last has landed (llama-server would fail to load
    it, on every request that asked for it)."""
    data = server.blobs["tiny.gguf"]
    shards = [f"m-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for name in shards:
        server.blobs[name] = data
    listed: list[list[str]] = []
    for name in shards:
        run(pull.resolve_source(server.url(f"/blob/{name}")), tmp_path)
        listed.append([f"{m.name} {m.path.name}" for m in discover(tmp_path)])
    assert listed[:2] == [[], []]
    assert listed[2] == [f"m-Q4_K_M {shards[0]}"]


def test_a_pull_cancelled_while_it_hashes_its_part_leaves_the_loop_free(
        server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume reads its part back to hash it: minutes for tens of GB. A pull cancelled then
    (DELETE /admin/pulls/{id}, shutdown) closed its part on the event loop, waiting for the
    whole hash: every other request of the daemon stalled behind it. Now the hash stops at its
    next chunk and the close waits off the loop; the part stays, and resumes."""
    data = b"GGUF" + os.urandom(20 << 20)
    server.blobs["held.gguf"] = data
    url = server.url("/blob/held.gguf")
    part, meta = pull.part_paths(tmp_path, "held.gguf")
    part.write_bytes(data[:17 << 20])  # read back in three chunks (8 MiB each)
    meta.write_text(json.dumps({"url": url, "total": len(data)}))
    entered, release = threading.Event(), threading.Event()
    chunks: list[int] = []

    class HeldHash:
        """sha256 whose first chunk waits for the test (at most 5 s: a loop held that long
        shows as the test's own sleep not ending before it)."""

        def __init__(self) -> None:
            self.inner = hashlib.sha256()

        def update(self, chunk: bytes) -> None:
            chunks.append(len(chunk))
            if len(chunks) == 1:
                entered.set()
                release.wait(10)
            self.inner.update(chunk)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    monkeypatch.setattr(pull.part, "hashlib", types.SimpleNamespace(sha256=HeldHash))
    timer = threading.Timer(5, release.set)

    async def cancel_while_hashing() -> bool:
        task = asyncio.create_task(pull.pull(pull.resolve_source(url), tmp_path))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        timer.start()
        task.cancel()
        await asyncio.sleep(0.05)  # the cancel is delivered; the part's close begins
        free = not release.is_set()  # the loop came back before the hash was let go
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return free

    try:
        assert asyncio.run(cancel_while_hashing()), "the event loop waited for the hash"
    finally:
        timer.cancel()
    assert len(chunks) == 1  # the hash stopped at its next chunk
    assert part.stat().st_size == 17 << 20 and not (tmp_path / "held.gguf").exists()
    monkeypatch.undo()
    result = run(pull.resolve_source(url), tmp_path)
    assert result.resumed_from == 17 << 20 and result.sha256 == sha(data)
    assert (tmp_path / "held.gguf").read_bytes() == data


class _CloseDelimited(BaseHTTPRequestHandler):
    """HTTP/1.0 as old servers and some proxies speak it: no Content-Length, the body ends
    when the connection closes. The first answer is cut at `cut` bytes (the line drops, which
    reads just like the end); a Range is answered with the rest, its total unsaid."""

    body = b""
    cut = 0
    ranges: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        wanted = self.headers.get("Range")
        type(self).ranges.append(wanted)
        if wanted:
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(self.body) - 1}/*")
            self.end_headers()
            self.wfile.write(self.body[start:])
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(self.body[:self.cut] if self.cut else self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def close_delimited() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _CloseDelimited)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def test_a_body_of_no_announced_size_cut_short_is_resumed_not_listed(
        close_delimited: str, server: Server, tmp_path: Path) -> None:
    """Without Content-Length, a connection that drops reads as the body's end: the pull took
    the first part of the file for all of it, and listed a model that cannot load. The file's
    tensor table says where it ends: short of that, the pull resumes with Range; a file the
    server holds truncated (announced size or not) fails, and is never listed."""
    data = write_tiny_llama(tmp_path / "src.gguf", seed=3).read_bytes()
    _CloseDelimited.body, _CloseDelimited.cut, _CloseDelimited.ranges = data, 300_000, []
    models = tmp_path / "models"
    result = run(pull.resolve_source(close_delimited + "/tiny.gguf"), models)
    assert _CloseDelimited.ranges == [None, "bytes=300000-"]
    assert (models / "tiny.gguf").read_bytes() == data and result.sha256 == sha(data)

    _CloseDelimited.body, _CloseDelimited.cut = data[:300_000], 0  # truncated at the source
    with pytest.raises(pull.PullError, match="tensor data ends at"):
        run(pull.resolve_source(close_delimited + "/cut.gguf"), models, retries=1)
    server.blobs["cut.gguf"] = data[:300_000]  # the same, its size announced
    with pytest.raises(pull.NotGguf, match="truncated; the download was deleted"):
        run(pull.resolve_source(server.url("/blob/cut.gguf"), name="announced"), models)
    assert [m.name for m in discover(models)] == ["tiny"]
    assert not (models / "cut.gguf").exists() and not (models / "announced.gguf").exists()
