"""A private directory for one child's Unix sockets, and the sweep of those a killed daemon left.

vLLM names its ZMQ sockets `ipc://$VLLM_RPC_BASE_PATH/<uuid4>` (default: the system temp dir)
and removes them only when it shuts down cleanly: a child ended by SIGKILL (a stop past its
grace, a crash) leaves them in /tmp for good. Each such child gets a directory of its own,
which corral removes whole once the child's group is gone (supervisor.process.ChildProcess).

A daemon killed by SIGKILL removes nothing, so the directory's name carries its owner: the
daemon's pid and the kernel's start time of that pid (a reused pid has another start time).
The next daemon start removes the directories whose owner is gone, and never a live daemon's:
two daemons may run side by side.

Under the system temp dir, not corral's state dir: a socket's path is at most 107 bytes, and
a state dir can be long on its own."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import structlog

__all__ = ["SocketDir", "make", "owner_alive", "owner_tag", "remove", "sweep_leftovers"]

log = structlog.get_logger("corral.socket_dir")

# The longest Unix socket path (sun_path is 108 bytes with its NUL).
SOCKET_PATH_MAX = 107
# What vLLM appends to the directory for each socket: "/" and a uuid4.
_SOCKET_NAME = 1 + 36
_NAME = re.compile(r"^corral-[a-z][a-z0-9]*-(?P<pid>\d+)\.(?P<start>\d+)-[A-Za-z0-9_]+$")


@dataclasses.dataclass(frozen=True)
class SocketDir:
    """What a backend's child takes: the variable naming its socket directory, and the word
    its directories are named with (`corral-<kind>-...`)."""

    env: str
    kind: str


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (/proc/<pid>/stat, field 22),
    or None when no such process runs."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: fields are counted after
    # its closing one, where field 3 comes first.
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[19])


def owner_tag(pid: int | None = None) -> str:
    """`<pid>.<start>` of this process (or `pid`): whose directory it is."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{process_start(pid)}"


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a directory still runs. A /proc we may not read
    (hidepid) counts as alive: a directory is removed only when its owner is known gone."""
    try:
        return process_start(pid) == start
    except (OSError, ValueError, IndexError):
        return True


def make(kind: str) -> str:
    """A new directory (mode 0700) for one child's sockets, named after this daemon. Raises
    OSError when it cannot be made or its sockets' paths would be too long."""
    base = tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix=f"corral-{kind}-{owner_tag()}-", dir=base)
    if len(os.fsencode(path)) + _SOCKET_NAME > SOCKET_PATH_MAX:
        os.rmdir(path)
        raise OSError(f"socket paths under {path} would pass {SOCKET_PATH_MAX} bytes (the "
                      f"temp dir {base!r} is too long)")
    return path


def remove(path: str) -> None:
    """Remove a socket directory and whatever the child left in it. Raises OSError."""
    # Gone already: removed by hand, or by a sweep that found its owner gone.
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def sweep_leftovers(base: str | None = None) -> list[str]:
    """Remove the socket directories under `base` (the system temp dir) whose owning daemon
    is gone; the paths removed. Only directories named by corral and owned by this user are
    looked at; a link is never followed."""
    base = tempfile.gettempdir() if base is None else base
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError as exc:
        log.warning("socket_dir.sweep_failed", base=base, error=str(exc))
        return removed
    for name in names:
        found = _NAME.match(name)
        if found is None:
            continue
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        if owner_alive(int(found["pid"]), int(found["start"])):
            continue
        try:
            remove(path)
        except OSError as exc:
            log.warning("socket_dir.remove_failed", path=path, error=str(exc))
            continue
        removed.append(path)
    if removed:
        log.info("socket_dir.leftovers_removed", paths=removed,
                 note="left by a daemon that was killed")
    return removed
