"""The file being downloaded, on disk, and placing it once whole.

The bytes go to `<models_dir>/.<name>.gguf.part`: hidden and not ending in `.gguf`, so
discovery and the models_dir watcher never see a download in progress, whatever depth it lies
at. Beside it, `.<name>.gguf.part.json` keeps the URL and the server's validators (ETag,
Last-Modified), for the next attempt to resume from. A finished part is fsynced and renamed
into place in one step; an existing model is never replaced unless asked (`force`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.supervisor.pull.source import ModelExists, PullRunning


def part_paths(models_dir: Path, filename: str) -> tuple[Path, Path]:
    """The part file and its validators file for `filename` in models_dir."""
    return models_dir / f".{filename}.part", models_dir / f".{filename}.part.json"


class _Part:
    """The file being downloaded, the hash of what it holds, and its validators. Writes (and
    hashing) run in one thread of their own: in order, off the event loop, and a write in
    flight finishes before the file closes, even when the pull is cancelled."""

    def __init__(self, models_dir: Path, filename: str):
        self.path, self.meta_path = part_paths(models_dir, filename)
        self.size = 0
        self.hasher = hashlib.sha256()
        self.hashed = False  # the hasher covers the bytes on disk
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pull-write")
        self._closing = threading.Event()  # stops a hash of the part midway (see close())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            # Two pulls of one file (two terminals, a terminal and the daemon) would interleave
            # their bytes: the second is refused while the first holds the lock.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._pool.shutdown()
            raise PullRunning(f"another pull is writing {self.path}") from None
        # Unbuffered: a write the disk cuts short must not leave bytes in a buffer that the
        # close would write later, after the part was cut back (see write()).
        self._file = os.fdopen(fd, "r+b", buffering=0)
        self.size = self._file.seek(0, os.SEEK_END)
        self.hashed = self.size == 0

    def meta(self) -> dict[str, Any]:
        try:
            data = json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save_meta(self, meta: dict[str, Any]) -> None:
        tmp = self.meta_path.with_name(self.meta_path.name + ".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.meta_path)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        future = self._pool.submit(fn, *args)
        # Shielded: a cancelled pull stops waiting, but the write still lands whole (close()
        # waits for it), so the part's size and its hash never disagree.
        return await asyncio.shield(asyncio.wrap_future(future))

    def restart(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        self.size = 0
        self.hasher = hashlib.sha256()
        self.hashed = True

    def hash_existing(self) -> None:
        self.hasher = hashlib.sha256()
        self._file.seek(0)
        left = self.size
        # Reading back tens of GB takes minutes: a pull cancelled meanwhile stops here at the
        # next chunk instead of keeping its close (and the daemon's shutdown) waiting.
        while left > 0 and not self._closing.is_set():
            chunk = self._file.read(min(left, 8 << 20))
            if not chunk:
                break
            self.hasher.update(chunk)
            left -= len(chunk)
        self._file.seek(0, os.SEEK_END)
        self.hashed = left == 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[self._file.write(view) or 0:]
        except OSError:
            # The disk filled (or failed) partway: some of `data` may be on disk, but neither
            # the size nor the hash counts it. Cut back to what they cover, so a resume asks
            # for the right byte and a later write does not land after a torn one.
            with contextlib.suppress(OSError):
                self._file.truncate(self.size)
                self._file.seek(self.size)
            raise
        self.hasher.update(data)
        self.size += len(data)

    def head(self, n: int) -> bytes:
        return os.pread(self._file.fileno(), n, 0)

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    async def aclose(self) -> None:
        """close() off the event loop: it waits for the write (or the fsync) in flight, and
        the daemon's other requests must not. Shielded: a second cancel does not leave the
        file open."""
        self._closing.set()
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, self.close))

    def close(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=True)
        if self.size == 0:
            self.remove()  # nothing to resume (a 404, a refused body): no litter
        self._file.close()  # releases the lock

    def remove(self) -> None:
        for path in (self.path, self.meta_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _place(part: Path, target: Path, force: bool, last_modified: str | None) -> None:
    """Rename the part into place in one step. Its mtime becomes the server's Last-Modified
    (as wget and curl -R do): an old mtime tells the models_dir watcher the file is whole
    (renamed into place), so it is listed without waiting for it to settle."""
    stamp = email.utils.parsedate_to_datetime(last_modified).timestamp() \
        if last_modified else None
    if stamp is not None and stamp < time.time():
        os.utime(part, (time.time(), stamp))
    if force:
        os.replace(part, target)
        return
    try:
        # A link fails if the name exists: no model that appeared meanwhile is replaced.
        os.link(part, target)
    except FileExistsError:
        raise ModelExists(f"{target} appeared meanwhile (force to replace it); the download "
                          f"stays in {part}") from None
    except OSError:
        # A file system without hard links: check, then rename (a narrow window).
        if target.exists():
            raise ModelExists(f"{target} exists (force to replace it)") from None
        os.replace(part, target)
        return
    part.unlink()
