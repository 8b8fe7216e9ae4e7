"""Reload when the config file, or any file it includes, changes on disk (watchfiles).

The folders of the files are watched, not the files: editors save by writing a new file and
renaming it over the old one, which a watch on the old file's inode never sees. A burst of
writes (an editor's save, a `cp` in pieces) becomes one reload: watchfiles yields once no
change has come for `step_ms`. A reload that still catches a file half written fails
validation (an empty file is refused too) and keeps the running config; the write's next event
reloads again. After each reload the set of files is looked at again, since an
edit may add or drop an include.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog
from watchfiles import Change, awatch

from corral.supervisor.daemon import Daemon

log = structlog.get_logger("corral.config")

# Quiet time that ends a burst of writes. watchfiles checks in slices of this length and reloads
# after the first slice without a new change, so a write is seen after 1-2 steps (25-50 ms).
# An editor's save (one write, or a new file renamed over the old) takes well under that.
STEP_MS = 25
MAX_BURST_MS = 1600  # a longer stream of writes still reloads this often


def watched_files(daemon: Daemon) -> frozenset[str]:
    """The active config's files, and those the last failed attempt tried (a missing include
    is fixed by creating it), each as given and with symlinks resolved."""
    files: set[Path] = set(daemon.loaded.files)
    if daemon.last_reload is not None and not daemon.last_reload.ok:
        files.update(daemon.last_reload.files)
    out: set[str] = set()
    for path in files:
        out.add(os.path.abspath(path))
        out.add(os.path.realpath(path))
    return frozenset(out)


def _only(files: frozenset[str]) -> Callable[[Change, str], bool]:
    def accept(_change: Change, path: str) -> bool:
        return path in files
    return accept


async def watch_config(daemon: Daemon, stopping: asyncio.Event, step_ms: int = STEP_MS) -> None:
    """Run until `stopping` is set (the CLI owns this task; setting the event ends the watcher
    thread within a step, where a bare cancel would wait for its timeout)."""
    while not stopping.is_set():
        files = watched_files(daemon)
        if not files:
            return  # the embedded default config: no file to watch (SIGHUP still reloads)
        folders = sorted({os.path.dirname(f) for f in files if os.path.isdir(os.path.dirname(f))})
        try:
            if not folders:
                raise FileNotFoundError(f"none of the folders of {sorted(files)} exists")
            log.debug("config.watching", files=sorted(files))
            async for changes in awatch(
                    *folders, watch_filter=_only(files),
                    step=step_ms, debounce=MAX_BURST_MS, recursive=False, stop_event=stopping,
                    rust_timeout=1000):
                paths = sorted({path for _, path in changes})
                deleted = all(kind is Change.deleted for kind, _ in changes)
                log.info("config.changed", files=paths, deleted=deleted)
                await asyncio.shield(daemon.reload("file"))
                if watched_files(daemon) != files:
                    break  # includes changed: watch the new set
        except Exception:
            # inotify limits, a folder that vanished: say so, and try again in a while.
            log.exception("config.watch_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 5)
