"""What a child's saved KV cache is valid for (its setup key), taken before the child starts.

A KV cache is only as good as the weights that computed it. The key is computed at spawn,
before the child's process exists, from the files the child is about to map: each file's
identity (device, inode, size, mtime in ns) and a hash of its GGUF header and tensor index
(gguf_header.header_digest). Read after the start instead, a file replaced meanwhile (`corral
pull --force`, a copy renamed into place) would give the new weights' children the old
weights' key. The child keeps its key for its whole life: its saves are made under it, and it
restores only files of it. Before each restore its files are stat'ed again (no hash): a file
replaced under it since the spawn turns its restores off (its saves keep the spawn-time key,
which is what its KV was computed with and which the new file's children never match)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from corral.supervisor.gguf_header import header_digest

__all__ = ["FileId", "Setup", "file_id", "key_parts"]


@dataclass(frozen=True, slots=True)
class FileId:
    """One file as the child maps it: where, which file there, and its header's hash."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    digest: str

    def same(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (
            self.dev, self.ino, self.size, self.mtime_ns)

    def replaced(self) -> bool:
        """Whether the path names another file now (or none): one stat, no read."""
        try:
            return not self.same(os.stat(self.path))
        except OSError:
            return True


@dataclass(frozen=True, slots=True)
class Setup:
    """A child's setup key and the files it was computed from."""

    key: str
    files: tuple[FileId, ...]

    def replaced(self) -> FileId | None:
        """The first of its files that is not the one the child started with, if any."""
        return next((f for f in self.files if f.replaced()), None)


# The header digest per file version (device, inode, size, mtime): hashed once.
_digests: dict[tuple[int, int, int, int], str] = {}


def _version(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


async def file_id(path: Path) -> FileId:
    """The file at `path` now. A version seen before costs one stat; a new one a hash of its
    header, in a thread (a few MB for a large vocabulary). Raises OSError."""
    st = os.stat(path)
    known = _digests.get(_version(st))
    if known is not None:
        return FileId(str(path), *_version(st), known)
    # The stat of the file actually hashed: one renamed into place between the two calls
    # gets its own version, never the other's digest.
    st, digest = await asyncio.to_thread(header_digest, path)
    if len(_digests) >= 256:
        _digests.clear()  # files replaced over a long life: start again, stay small
    _digests[_version(st)] = digest
    return FileId(str(path), *_version(st), digest)


def key_parts(f: FileId) -> list[object]:
    """The parts of the key a file brings."""
    return [f.path, f.dev, f.ino, f.size, f.mtime_ns, f.digest]
