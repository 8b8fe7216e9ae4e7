"""What lets several corral daemons share one prompt-cache dir, and a save be counted from its
first byte: the dir's lock, who owns a save in flight, and the size a save will have.

Two daemons on one state dir (a head and a `--worker`, two configs on two ports) share its
prompt-cache/ and its index: every read-modify-write of the index, every rename of a finished
save into place and every deletion of a file the index does not name happens under an flock
of `.lock` in the dir, and re-reads the index first. A save in flight is written under a
temporary name (`.part`) and listed in the index as pending, with its owner (pid and process
start time) and its expected size, so the other daemon counts it against the budget and never
deletes it while its owner lives; a dead owner's temporary files are deleted, and their
reservations no longer counted, at the next change any live daemon makes to the index (or its
next start). Files and index are the user's alone: the dir 0700, corral's files 0600
(statefile.private_dir, write_private)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import psutil

from corral.supervisor.config.specs import ModelSpec

LOCK = ".lock"
TEMP_SUFFIX = ".part"
# Room beyond the KV itself in a slot file (its header, the token list's length word, the
# per-layer row sizes): a few KB measured; 64 KiB is generous.
_HEADER = 64 << 10
# A figure learned from an earlier file of the setup is a ratio (bytes per token); a longer
# conversation's file is that ratio times its tokens plus nothing that grows faster, so 2 %
# covers rounding.
_MARGIN = 1.02


def _owner_of_this_process() -> str:
    proc = psutil.Process()
    return f"{proc.pid}:{proc.create_time():.3f}"


OWNER = _owner_of_this_process()


def alive(owner: object) -> bool:
    """Whether the daemon that wrote `owner` (OWNER's format) is still running: the same pid
    with the same start time (a reused pid is someone else)."""
    if owner == OWNER:
        return True
    if not isinstance(owner, str) or ":" not in owner:
        return False
    pid, _, started = owner.partition(":")
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 0.01
    except (ValueError, psutil.Error):
        return False


class DirLock:
    """An exclusive flock on the dir's `.lock`, reentrant within this process (a drop inside
    an add inside a save): held only for an index's read-modify-write, never across an await.
    The descriptor is close-on-exec: a child that outlives corral never holds it."""

    def __init__(self, folder: Path):
        self._fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._depth = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def expected_bytes(tokens: int, per_token: float | None) -> int | None:
    """A slot file's size for `tokens` tokens at `per_token` bytes a token, rounded up with
    room for its header: None when nothing tells the figure."""
    if per_token is None:
        return None
    return int(per_token * tokens * _MARGIN) + _HEADER


def kv_per_token(spec: ModelSpec) -> float | None:
    """Bytes a token takes in a saved slot of this setup, from the GGUF (the KV rows of every
    layer at the cache types, and the token id itself): the figure for a setup's first save,
    before any file of it tells the real one. None when the file cannot be read. Blocking (a
    GGUF header read, cached per file version): call it in a thread."""
    from corral.supervisor.memory.estimate import EstimateError, kv_bytes, model_facts

    try:
        facts = model_facts(spec.model_path)
        # One cell: every layer counts in full (a sliding-window layer saves all of a short
        # conversation), each row as ggml stores it.
        kv = kv_bytes(facts, 1, spec.cache_type_k or "f16", spec.cache_type_v or "f16")
    except (EstimateError, OSError, ValueError):
        return None
    return kv + 4
