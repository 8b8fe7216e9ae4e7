"""A file of live child pids, so children of a daemon killed with SIGKILL are reaped at the next
start even where the parent-death signal could not fire (e.g. a child that re-parented itself)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import structlog

log = structlog.get_logger("corral.statefile")


@dataclass(frozen=True)
class ChildRecord:
    model: str
    pid: int
    create_time: float  # guards against pid reuse: only this exact process is ours


# Filesystems whose files live in RAM: a prompt cache there takes memory the memory loop does
# not see (it then evicts idle models to relieve pressure the cache made), lost at logout.
IN_MEMORY = frozenset({"tmpfs", "ramfs"})


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/corral (~/.local/state/corral): on disk. Not $XDG_RUNTIME_DIR, which is
    a tmpfs in every SSH or desktop session (the service passes --state-dir /var/lib/corral)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "corral"


def old_default_state_dir() -> Path | None:
    """Where corral kept its state by default before: $XDG_RUNTIME_DIR/corral."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "corral" if runtime else None


def private_dir(folder: Path, *, existing: bool = True) -> None:
    """`folder` made (with its missing parents) and 0700 whatever the umask: its files are
    conversations (token ids, decodable) and their KV, readable by no other local user.
    `existing`: one that was already there is made 0700 too (corral's own dir)."""
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    # mkdir's mode is cut by the umask, never widened past it: chmod says it whole.
    if (made or existing) and folder.stat().st_mode & 0o077:
        try:
            os.chmod(folder, 0o700)
        except PermissionError as exc:  # another user's dir: used as it is, and said
            log.warning("statefile.dir_not_private", dir=str(folder), error=str(exc))


def write_private(path: Path, data: bytes) -> None:
    """`data` as the whole of `path`, mode 0600 from its creation (never readable by others,
    not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by an earlier version keeps its mode otherwise
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def filesystem_of(path: Path) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount that holds `path` (or would: its nearest
    existing parent), from the mount table; None when it cannot tell."""
    here = Path(os.path.realpath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    found: tuple[str, str] | None = None
    try:
        partitions = psutil.disk_partitions(all=True)
    except OSError:
        return None
    for part in partitions:  # in mount order: a later mount over the same point wins
        mount = Path(part.mountpoint)
        if (mount == here or mount in here.parents) \
                and (found is None or len(part.mountpoint) >= len(found[0])):
            found = (part.mountpoint, part.fstype)
    return found


def move_old_prompt_cache(state_dir: Path) -> Path | None:
    """The prompt cache under the old default state dir, moved under `state_dir` when that has
    none yet (its index last: a move cut short is finished at the next start, and a file is
    never left where nothing reads or deletes it). The dir it came from, or None."""
    old = old_default_state_dir()
    if old is None:
        return None
    source, target = old / "prompt-cache", state_dir / "prompt-cache"
    if not (source / "index.json").is_file() or (target / "index.json").exists():
        return None
    try:
        if os.path.realpath(source) == os.path.realpath(target):
            return None
        log.info("statefile.prompt_cache_moving", source=str(source), target=str(target),
                 hint="a copy from the runtime dir (RAM) to disk: the start waits for it")
        private_dir(target)
        for path in sorted(source.iterdir(), key=lambda p: p.name == "index.json"):
            if path.is_file() and (path.suffix == ".slot" or path.name == "index.json"):
                shutil.move(path, target / path.name)
    except OSError as exc:
        log.warning("statefile.prompt_cache_not_moved", source=str(source),
                    target=str(target), error=str(exc))
        return None
    return source


class ChildRegistry:
    def __init__(self, path: Path):
        self.path = path

    def record(self, children: list[tuple[str, int]]) -> None:
        records = []
        for model, pid in children:
            try:
                records.append(ChildRecord(model, pid, psutil.Process(pid).create_time()))
            except psutil.NoSuchProcess:
                continue
        private_dir(self.path.parent, existing=False)
        tmp = self.path.with_suffix(".tmp")
        write_private(tmp, json.dumps([asdict(r) for r in records]).encode())
        tmp.replace(self.path)

    def reap_leftovers(self) -> list[int]:
        """Kill the process groups of children a previous daemon left behind."""
        try:
            raw = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            # Another user's file (a `sudo corral serve` once), a directory, bytes that are
            # not JSON: nothing to reap by, and no reason not to serve.
            log.warning("statefile.unreadable", path=str(self.path),
                        error=f"{type(exc).__name__}: {exc}")
            self.clear()
            return []
        reaped = []
        for rec in _records(raw, self.path):
            try:
                proc = psutil.Process(rec.pid)
                if abs(proc.create_time() - rec.create_time) > 0.01:
                    continue
            except psutil.Error:  # gone; or not ours to look at, so not ours to kill
                continue
            # Children lead their own process group (start_new_session): group id == pid.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(rec.pid, signal.SIGKILL)
            reaped.append(rec.pid)
            log.warning("statefile.reaped_orphan", model=rec.model, pid=rec.pid)
        self.clear()
        return reaped

    def clear(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:  # a directory, a read-only dir: the next record() says more
            log.warning("statefile.not_cleared", path=str(self.path), error=str(exc))


def _records(raw: object, path: Path) -> list[ChildRecord]:
    """The well-formed records of a state file's JSON: a pid of 0, 1 or less (os.killpg(0)
    is the caller's own group), a string or a float is nobody corral could have started."""
    records = []
    for entry in raw if isinstance(raw, list) else [raw]:
        if (isinstance(entry, dict)
                and isinstance(pid := entry.get("pid"), int) and not isinstance(pid, bool)
                and pid > 1 and isinstance(started := entry.get("create_time"), (int, float))
                and isinstance(model := entry.get("model", ""), str)):
            records.append(ChildRecord(model, pid, float(started)))
        else:
            log.warning("statefile.record_skipped", path=str(path), record=repr(entry)[:200])
    return records
