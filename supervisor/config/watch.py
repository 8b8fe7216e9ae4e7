"""Reload when the config file, or any file it includes, changes on disk (watchfiles).

The folders of the files are watched, not the files: editors save by writing a new file and
renaming it over the old one, which a watch on the old file's inode never sees. A burst of
writes (an editor's save, a `cp` in pieces) becomes one reload: watchfiles yields once no
change has come for `step_ms`. A file found empty is read again for a moment (a save in
place truncates, then writes) before the reload refuses it. A reload that still catches a file
half written fails validation and keeps the running config; the write's next event reloads
again. After each reload the set of files is looked at again, since an
edit may add or drop an include (or a link on the way was re-pointed); when it changed, the
watch moves to the new set, and once it is in place the config is read again, so an edit made
while it moved is not missed. And each quiet second, and at each change of another file in
the folders (a log written beside the config keeps the quiet second from coming), the files'
inode, size and mtime are compared with what they were before the last reload: an edit no
event reported (a write through a hard link in another folder, which inotify does not report;
an event lost under load) reloads within a second. The config is read again once the first
watch is in place too: the daemon serves before its watch is set up, and an edit made in
between came as no event.

`watch_models_dir` does the same for the models folder (models_dir or --models-dir, with its
subfolders; the embedded default too, which has no config file): a model file added, removed
or renamed there reloads, and the reload's diff adds, drains and stops the models. A file is
held back from discovery while it is being written: from its first event until its size and
mtime have not changed for SETTLE_S (or its mtime is already that old: a file renamed into
place). A copy that stalls longer than that is seen half-written, so README says to copy to a
hidden name or another folder on the same filesystem and rename into place (`corral pull`
does). Hidden files and folders are ignored, as discovery ignores them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from watchfiles import Change, awatch

from corral.supervisor import discovery
from corral.supervisor.config.include import read_config_file
from corral.supervisor.config.issues import ConfigError
from corral.supervisor.config.loaded import LoadedConfig
from corral.supervisor.daemon import Daemon
from corral.supervisor.discovery import Signature, signature

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
        out.update(_links_along(os.path.abspath(path)))
    return frozenset(out)


def _links_along(path: str) -> set[str]:
    """Every symlink `path` goes through, folders included: a deploy that re-points
    `current -> releases/v2` (or a Kubernetes ConfigMap's `..data`) changes none of the files
    watched, only the link; the link's own folder is watched for it."""
    out: set[str] = set()
    pending = [path]
    for _ in range(40):  # as many links as the kernel follows: a loop of links ends here
        if not pending:
            break
        todo = pending.pop()
        head = os.path.sep
        parts = todo.split(os.path.sep)[1:]
        for i, part in enumerate(parts):
            step = os.path.join(head, part)
            if os.path.islink(step):
                out.add(step)
                with contextlib.suppress(OSError):
                    target = os.path.join(head, os.readlink(step))
                    pending.append(os.path.normpath(os.path.join(target, *parts[i + 1:])))
                break
            head = step
    return out


def _read_differs(daemon: Daemon) -> bool:
    """Whether the config on disk now differs from what the active config was read from (or
    cannot be read: the reload says why)."""
    loaded = daemon.loaded
    if loaded.source is None:
        return False
    try:
        return read_config_file(loaded.source).digest != loaded.digest
    except ConfigError:
        return True


# What a watched file is now: its inode, size and mtime (None: not there).
Stamp = tuple[int, int, int] | None


def _stamps(files: frozenset[str]) -> dict[str, Stamp]:
    """Each file's stamp: compared once a quiet second with what the last reload saw, for the
    edits no event reports (inotify reports a change only through the folder it was made in:
    a write through a hard link elsewhere is silent; and an event lost under load)."""
    out: dict[str, Stamp] = {}
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            out[path] = None
            continue
        out[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _only(files: frozenset[str]) -> Callable[[Change, str], bool]:
    def accept(_change: Change, path: str) -> bool:
        return path in files
    return accept


async def watch_config(daemon: Daemon, stopping: asyncio.Event, step_ms: int = STEP_MS) -> None:
    """Run until `stopping` is set (the CLI owns this task; setting the event ends the watcher
    thread within a step, where a bare cancel would wait for its timeout)."""
    # Set while the watch is not yet in place on the files the active config was read from:
    # what changes before it is comes as no event (and the stamps taken when it starts already
    # show the edit), so once it is (its first quiet second) the config is read and compared
    # with what was applied. So at the start too: the daemon read its config and serves (its
    # relay workers may answer first) before this task's watch is set up in its thread, and an
    # edit in between (a deploy's, a test's, right after /health answers) was lost for good.
    moved = True
    while not stopping.is_set():
        files = watched_files(daemon)
        if not files:
            return  # the embedded default config: no file to watch (SIGHUP still reloads)
        folders = sorted({os.path.dirname(f) for f in files if os.path.isdir(os.path.dirname(f))})
        try:
            if not folders:
                raise FileNotFoundError(f"none of the folders of {sorted(files)} exists")
            log.debug("config.watching", files=sorted(files))
            seen = _stamps(files)
            ours = _only(files)
            # Every change in the folders, ours picked here: other files there (a log written
            # beside the config) keep the quiet second from coming, and each of their batches
            # is a moment to compare the stamps too.
            async for raw in awatch(
                    *folders, watch_filter=None,
                    step=step_ms, debounce=MAX_BURST_MS, recursive=False, stop_event=stopping,
                    rust_timeout=1000, yield_on_timeout=True):
                changes = {(kind, path) for kind, path in raw if ours(kind, path)}
                if not changes:  # a quiet second, or other files: the watch is in place
                    if moved and _read_differs(daemon):
                        log.info("config.changed", files=sorted(files), deleted=False,
                                 note="changed before the watch was in place on these files")
                        changes = {(Change.modified, "")}
                    elif _stamps(files) != seen:
                        log.info("config.changed", files=sorted(files), deleted=False,
                                 note="no event came for it: seen by the files' stamps")
                        changes = {(Change.modified, "")}
                    moved = False
                    if not changes:
                        continue
                else:
                    moved = False
                paths = sorted({path for _, path in changes if path})
                deleted = all(kind is Change.deleted for kind, _ in changes)
                if paths:
                    log.info("config.changed", files=paths, deleted=deleted)
                # Before the reload reads them: an edit made while it runs differs after.
                seen = _stamps(files)
                await asyncio.shield(daemon.reload("file"))
                if watched_files(daemon) != files:
                    moved = True
                    break  # includes changed: watch the new set
        except Exception:
            # inotify limits, a folder that vanished: say so, and try again in a while.
            log.exception("config.watch_failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 5)


# -- the models folder ----------------------------------------------------------------------------

SETTLE_S = 2.0  # a new or changed model file is listed once unchanged this long
TICK_MS = 250  # how often held files are looked at again while no event comes

def models_folder(loaded: LoadedConfig) -> Path | None:
    """The folder discovery reads, with symlinks resolved: watchfiles reports paths under the
    folder it was given, and discovery holds back files by their paths under it."""
    return loaded.models_folder.resolve() if loaded.models_folder else None


def _model_files(folder: Path) -> Callable[[Change, str], bool]:
    def accept(_change: Change, path: str) -> bool:
        rel = os.path.relpath(path, folder)
        if rel.startswith("..") or any(part.startswith(".") for part in Path(rel).parts):
            return False  # hidden: a download in progress, a cache, version control
        # Folders count too: `mv org/ elsewhere` reports the folder alone.
        return path.endswith(".gguf") or not os.path.isfile(path)
    return accept


class _Held:
    """Model files being written: held back from discovery until they settle."""

    def __init__(self, settle: float) -> None:
        self.settle = settle
        self.files: dict[str, tuple[int, int, float]] = {}  # path → size, mtime_ns, since
        # What was released, as it was then: not held again for an mtime in the future (a
        # clock ahead on a network share), which would never settle by age.
        self.released: dict[str, tuple[int, int]] = {}

    def saw(self, path: str, listed: Signature | None) -> None:
        """An event for `path`: hold it if it is a model file being written."""
        try:
            st = os.stat(path)
        except OSError:
            self.release(path)  # deleted (or renamed away) meanwhile
            self.released.pop(path, None)
            return
        if path.endswith(".gguf") and os.path.isfile(path) and path not in self.files \
                and self.fresh(path, st.st_size, st.st_mtime_ns, listed):
            self.hold(path, st.st_size, st.st_mtime_ns)

    def fresh(self, path: str, size: int, mtime_ns: int, listed: Signature | None) -> bool:
        """Written within the settle time, and not as it was listed: a file renamed into
        place keeps its (older) mtime; a touch keeps its size, and a running child need not
        stop for it."""
        if time.time() - mtime_ns / 1e9 >= self.settle \
                or self.released.get(path) == (size, mtime_ns):
            return False
        return not (listed and any(p == path and s == size for p, s, _ in listed[1]))

    def hold(self, path: str, size: int, mtime_ns: int) -> None:
        self.files[path] = (size, mtime_ns, time.monotonic())
        discovery.hold_back([path], True)

    def settled(self) -> list[str]:
        """Files that stopped changing (released now), and those gone."""
        done: list[str] = []
        for path, (size, mtime, since) in list(self.files.items()):
            try:
                st = os.stat(path)
            except OSError:
                done.append(path)
                continue
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                self.files[path] = (st.st_size, st.st_mtime_ns, time.monotonic())
            elif time.monotonic() - since >= self.settle:
                done.append(path)
        for path in done:
            size, mtime, _ = self.files[path]
            self.release(path)
            self.released[path] = (size, mtime)
        return done

    def release(self, path: str) -> None:
        if self.files.pop(path, None) is not None:
            discovery.hold_back([path], False)

    def clear(self) -> None:
        discovery.hold_back(list(self.files), False)
        self.files.clear()


async def watch_models_dir(daemon: Daemon, stopping: asyncio.Event, step_ms: int = STEP_MS,
                           settle: float = SETTLE_S) -> None:
    """Run until `stopping` is set (the CLI owns this task, beside watch_config). Reloads
    (trigger "models_dir") when what discovery lists changed: a model file added, removed,
    renamed, rewritten, or a folder of them moved."""
    held = _Held(settle)
    # What the active config's discovery listed when it was read: the watch compares the folder
    # with it once in place, for a file added or removed before it was (the daemon serves
    # before this task's watch is set up).
    last = daemon.loaded.models_signature
    try:
        while not stopping.is_set():
            watched = daemon.loaded.models_folder
            folder = models_folder(daemon.loaded)
            if folder is None or not folder.is_dir():
                # Nothing to watch yet: a reload may set models_dir, a mkdir create it.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 1)
                if folder is not None and folder.is_dir():
                    last = await _reload_if_changed(daemon, folder, last, held)
                continue
            try:
                log.debug("models_dir.watching", folder=str(folder))
                in_place = False
                async for changes in awatch(
                        folder, watch_filter=_model_files(folder), step=step_ms,
                        debounce=MAX_BURST_MS, stop_event=stopping, rust_timeout=TICK_MS,
                        yield_on_timeout=True, recursive=True):
                    for _, path in changes:
                        held.saw(path, last)
                    released = held.settled()
                    if changes or released or not in_place:
                        # Held files are left out of this listing, and reload again once
                        # they settle. The first batch (a tick at the latest) means the watch
                        # is in place: what changed before it came as no event.
                        in_place = True
                        last = await _reload_if_changed(daemon, folder, last, held)
                    if daemon.loaded.models_folder != watched \
                            or models_folder(daemon.loaded) != folder:
                        # models_dir changed in the config, or a link on its way was
                        # re-pointed (a release switched): watch the new folder.
                        break
                    if not folder.is_dir():
                        break  # removed: its models go with the next listing
                if stopping.is_set():
                    return
                held.clear()
                last = await _reload_if_changed(daemon, folder, last, held)
            except Exception:
                # inotify limits, a folder that vanished: say so, and try again in a while.
                log.exception("models_dir.watch_failed", folder=str(folder))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 5)
    finally:
        held.clear()


async def _reload_if_changed(daemon: Daemon, folder: Path, last: Signature | None,
                             held: _Held) -> Signature | None:
    now = await asyncio.to_thread(signature, folder)
    # A file can be listed with no event of its own seen: written into a folder made just
    # before, whose watch was not set up yet. Its mtime still says it is being written.
    fresh = [(path, size, mtime) for path, size, mtime in now[1]
             if path not in held.files and held.fresh(path, size, mtime, last)]
    if fresh:
        for path, size, mtime in fresh:
            held.hold(path, size, mtime)
        now = await asyncio.to_thread(signature, folder)
    if now == last or daemon.closing:
        return now
    before = dict(daemon.loaded.models)
    attempt = await asyncio.shield(daemon.reload("models_dir"))
    if attempt.ok and attempt.changes:
        after = daemon.loaded.models
        for what, names, specs in (("added", attempt.changes["added"], after),
                                   ("removed", attempt.changes["removed"], before),
                                   ("changed", attempt.changes["restarted"], after)):
            for name in names:
                spec = specs.get(name)
                log.info(f"inventory.{what}", model=name,
                         path=str(spec.model_path) if spec else None,
                         mmproj=str(spec.mmproj) if spec and spec.mmproj else None)
    return now
