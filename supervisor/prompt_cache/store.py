"""The files of the prompt cache and their index: which prefix each file holds, for which
KV-compatible setup (the key), how big, when last used. The index is a JSON file beside the
files, written whole (temporary file, then rename) at every change, so it survives a corral
restart and a crash leaves either the old index or the new one.

Several daemons may share the dir (files.py): every change to the index happens under the
dir's flock and re-reads the index first, and a save is written under a temporary name,
counted as pending (its expected size) from the moment it is asked for, and renamed into
place and indexed in one step under the lock, or deleted.

A file is trusted only when its size and fingerprint (hash of its head and tail) are what the
index says: llama-server aborts (SIGABRT, the child dies) when it restores a truncated file,
so a file that changed on disk is deleted, never handed to a child.

A restore does not write the index (it is on its request's path): a file's last_used reaches
disk with this daemon's next write, so another daemon's budget may evict a file this one
restored a moment ago as if it were older (it only orders evictions; nothing is lost).

The conversations are private: the dir is 0700 and every file corral writes in it 0600; the
slot files llama-server writes are made 0600 as they are indexed."""

from __future__ import annotations

import array
import base64
import collections
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from corral.supervisor.prompt_cache.files import (
    OWNER,
    TEMP_SUFFIX,
    DirLock,
    alive,
    expected_bytes,
)
from corral.supervisor.statefile import private_dir, write_private

log = structlog.get_logger("corral.prompt_cache")

INDEX = "index.json"
# The saves in flight (files.py), beside the index in a file of their own: a reservation
# rewrites a few lines, not the index with every file's tokens.
PENDING = "pending.json"
SUFFIX = ".slot"
_VERSION = 1
# The head holds the file's header and token list (4 bytes a token): 1 MiB covers 256k tokens.
_HEAD, _TAIL = 1 << 20, 64 << 10


@dataclasses.dataclass(slots=True)
class Entry:
    file: str  # the name inside the cache dir (llama-server takes names, not paths)
    key: str  # the KV-compatible setup it was saved under (identity.cache_key)
    model: str
    tokens: list[int]  # the prompt the slot held, as the child tokenized it
    n_tokens: int  # what the file holds (prompt and generated tokens)
    bytes: int
    fingerprint: str
    saved_at: float
    last_used: float
    # What the request's text began with, before any tokenizing (slots.head_of): a request
    # whose head no entry of its setup has is never tokenized for a restore. None: unknown
    # (an index written before heads were kept), so any request of the setup may match.
    head: str | None = None
    # Whose conversation it is (PromptCache.namespace: a keyed hash of the API key that sent
    # it; "" with no keys configured, and in an index written before namespaces were kept).
    namespace: str = ""

    def as_json(self, packed_tokens: str | None = None) -> dict[str, Any]:
        # Shallow: asdict deep-copies the token list element by element (1.7 s for an index
        # of 100 files of 4,000 tokens).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["tokens"] = packed_tokens if packed_tokens is not None \
            else pack_tokens(self.tokens)
        return fields

    @property
    def scope(self) -> str:
        return scope(self.key, self.namespace)


def scope(key: str, namespace: str) -> str:
    """What the store looks files up by: the setup and whose they are. A file is only ever
    restored, matched or superseded within its own scope; "" (no keys) keeps the setup key
    alone, as before namespaces were kept."""
    return f"{key}/{namespace}" if namespace else key


def pack_tokens(tokens: Sequence[int]) -> str:
    """A token list as the index keeps it: base64 of little-endian int32s. As a JSON list of
    numbers an index of 100 files of 4,000 tokens took 130 ms to write, on the event loop,
    at every save; packed (and each file's packed once), a few ms."""
    packed = array.array("i", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_tokens(value: object) -> list[int] | None:
    """The index's token list: packed, or a JSON list of numbers (an index written before
    they were packed). None when it is neither."""
    if isinstance(value, list):
        return value if all(type(t) is int for t in value) else None
    if not isinstance(value, str):
        return None
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None
    if len(raw) % 4:
        return None
    packed = array.array("i")
    packed.frombytes(raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def fingerprint(path: Path) -> tuple[int, str]:
    """(size, hash of head and tail): cheap (1 MiB read) and enough to see a truncated or
    overwritten file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(_HEAD))
        if size > _HEAD:
            f.seek(max(_HEAD, size - _TAIL))
            digest.update(f.read(_TAIL))
    return size, digest.hexdigest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclasses.dataclass(slots=True)
class Counters:
    saves: int = 0
    saved_bytes: int = 0
    restores: int = 0
    restored_tokens: int = 0
    misses: int = 0
    dropped: int = 0
    unused_restores: int = 0  # restores the child's answer showed it did not reuse


class Store:
    """The directory and its index. Every method is synchronous (no await inside), so two
    instances saving at once cannot interleave their changes."""

    def __init__(self, folder: Path, max_bytes: Callable[[], int],
                 on_drop: Callable[[Entry, str], None] | None = None):
        self.dir = folder
        self._max_bytes = max_bytes  # read at each save: a reload may change the budget
        self._on_drop = on_drop
        self.entries: dict[str, Entry] = {}
        # The same entries by setup, and how many of each setup's entries have each head: a
        # restore's look-up is a dict's, never a scan of every file.
        self._by_key: dict[str, dict[str, Entry]] = {}
        self._heads: dict[str, collections.Counter[str | None]] = {}
        # Setups whose restores the child was seen not to reuse (verify_restore): no more
        # restores of them until a restart (a reload that changes the setup changes its key).
        self.off: dict[str, str] = {}
        self.counters = Counters()
        # Bytes per token of the last file saved for each setup: a save that could not fit
        # the budget (or the disk) is not written at all.
        self._per_token: dict[str, float] = {}
        # Saves in flight in this dir, this daemon's and others': temporary file name ->
        # {"bytes", "owner", "since"}. Counted against the budget until indexed or deleted.
        self.pending: dict[str, dict[str, Any]] = {}
        # The index and pending files as this store last read or wrote them (inode, size,
        # mtime): a change is another daemon's.
        self._seen: dict[str, tuple[int, int, int]] = {}
        self._packed: dict[str, str] = {}  # each indexed file's tokens as the index has them
        private_dir(self.dir)
        self._lock = DirLock(self.dir)
        self._load()

    # -- the index -----------------------------------------------------------------------------

    def _read_json(self, name: str) -> Any:
        """One of the dir's JSON files as written (None: absent); its signature noted."""
        try:
            with open(self.dir / name, "rb") as f:
                st = os.fstat(f.fileno())
                data = json.loads(f.read())
        except FileNotFoundError:
            return None
        self._seen[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return data

    def _write_json(self, name: str, data: Any) -> None:
        tmp = self.dir / f".{name}.tmp"
        write_private(tmp, json.dumps(data).encode())
        os.replace(tmp, self.dir / name)
        st = os.stat(self.dir / name)
        self._seen[name] = (st.st_ino, st.st_size, st.st_mtime_ns)

    def _changed(self, name: str) -> bool:
        try:
            st = os.stat(self.dir / name)
        except FileNotFoundError:
            return name in self._seen
        return (st.st_ino, st.st_size, st.st_mtime_ns) != self._seen.get(name)

    def _read_pending(self) -> dict[str, dict[str, Any]]:
        try:
            data = self._read_json(PENDING)
        except (OSError, ValueError) as exc:
            log.warning("prompt_cache.index_unreadable", file=PENDING, error=str(exc))
            return {}
        items = data.get("pending", []) if isinstance(data, dict) else []
        return {str(p["file"]): p for p in items
                if isinstance(p, dict) and isinstance(p.get("file"), str)
                and isinstance(p.get("bytes"), int)}

    def _read(self) -> list[Entry] | None:
        """The index's entries on disk (None: unreadable)."""
        raw: list[dict[str, Any]] = []
        try:
            data = self._read_json(INDEX)
        except (OSError, ValueError) as exc:
            log.warning("prompt_cache.index_unreadable", dir=str(self.dir), error=str(exc))
            return None
        if isinstance(data, dict) and data.get("version") == _VERSION:
            raw = [e for e in data.get("entries", []) if isinstance(e, dict)]
        fields = {f.name for f in dataclasses.fields(Entry)}
        optional = {f.name for f in dataclasses.fields(Entry)
                    if f.default is not dataclasses.MISSING}  # absent from older indexes
        entries = []
        for item in raw:
            try:
                entry = Entry(**{k: item[k] for k in fields if k in item or k not in optional})
            except (KeyError, TypeError):
                continue
            tokens = unpack_tokens(entry.tokens)
            if tokens is None:
                continue
            entry.tokens = tokens
            if os.path.basename(entry.file) != entry.file or not entry.file.endswith(SUFFIX):
                continue
            entries.append(entry)
        return entries

    def _load(self) -> None:
        """Read the index; drop what does not check out (missing, truncated, changed), and
        delete files the index does not name (a save whose index write never happened) and
        temporary files no live daemon is writing (this daemon's earlier run's included).

        Every file is fingerprinted (1 MiB read each) before the lock is taken: another
        daemon on the dir blocks on the lock in its event loop (a restore's drop, a save's
        reserve), so it is held only to re-read the index, apply the results and write."""
        scanned = self._read() or []
        checked = {e.file: (e.bytes, e.fingerprint, self.check(e)) for e in scanned}
        with self._lock.held():
            self._load_locked(scanned, checked)

    def _load_locked(self, scanned: list[Entry],
                     checked: dict[str, tuple[int, str, str | None]]) -> None:
        entries = (self._read() or []) if self._changed(INDEX) else scanned
        for name, item in self._read_pending().items():
            if alive(item.get("owner")):
                self.pending[name] = item
            else:
                log.info("prompt_cache.partial_deleted", file=name,
                         reason="its daemon is gone")
        for entry in entries:
            seen = checked.get(entry.file)
            # An entry another daemon indexed (or re-saved) since the scan: checked now.
            problem = seen[2] if seen is not None and seen[:2] == (entry.bytes,
                                                                  entry.fingerprint) \
                else self.check(entry)
            if problem is not None:
                self._drop(entry, problem)
                continue
            self._remember(entry)
            self._per_token[entry.key] = entry.bytes / max(entry.n_tokens, 1)
        for path in self.dir.glob(f"*{SUFFIX}"):
            if path.name not in self.entries:
                log.info("prompt_cache.orphan_deleted", file=path.name)
                path.unlink(missing_ok=True)
        for path in self.dir.glob(f"*{TEMP_SUFFIX}"):
            if path.name not in self.pending:
                log.info("prompt_cache.partial_deleted", file=path.name,
                         reason="no live daemon is writing it")
                path.unlink(missing_ok=True)
        self._fit_budget()  # a lowered budget applies at once
        try:
            self._write()
            self._write_pending()
        except OSError as exc:
            # A full disk must not keep corral from starting: what is in memory is checked,
            # and an index on disk naming files deleted here drops them at the next read.
            log.warning("prompt_cache.index_not_written", dir=str(self.dir), error=str(exc))

    def _write(self) -> None:
        packed = self._packed
        entries = []
        for name, entry in self.entries.items():
            if name not in packed:  # a file's tokens never change: packed once
                packed[name] = pack_tokens(entry.tokens)
            entries.append(entry.as_json(packed[name]))
        self._write_json(INDEX, {"version": _VERSION, "entries": entries})

    def _write_pending(self) -> None:
        self._write_json(PENDING, {"version": _VERSION, "pending": list(self.pending.values())})

    def _sync(self) -> None:
        """Under the lock: what another daemon changed in the index since this one last read
        or wrote it (its saves, drops and pending saves) made this store's own. Files are not
        checked here: a restore checks its file first."""
        if self._changed(PENDING):
            self.pending = self._read_pending()
        # A daemon killed mid-save never releases its reservation: left counted, its bytes
        # would evict real files and refuse saves for as long as this daemon runs.
        dead = [name for name, item in self.pending.items() if not alive(item.get("owner"))]
        for name in dead:
            del self.pending[name]
            (self.dir / name).unlink(missing_ok=True)
            log.info("prompt_cache.partial_deleted", file=name, reason="its daemon is gone")
        if dead:
            self._write_pending()
        if not self._changed(INDEX):
            return
        entries = self._read()
        if entries is None:
            return
        on_disk = {e.file: e for e in entries}
        for name, entry in list(self.entries.items()):
            if name not in on_disk:
                self._forget(entry)  # dropped by the other daemon (its file is gone)
        for name, entry in on_disk.items():
            mine = self.entries.get(name)
            if mine is None:
                self._remember(entry)
                self._per_token[entry.key] = entry.bytes / max(entry.n_tokens, 1)
            else:
                mine.last_used = max(mine.last_used, entry.last_used)

    # -- files ---------------------------------------------------------------------------------

    def check(self, entry: Entry) -> str | None:
        """None when the file is the one the index describes, else why not."""
        try:
            size, digest = fingerprint(self.dir / entry.file)
        except OSError as exc:
            return f"unreadable: {exc.strerror or exc}"
        if size != entry.bytes:
            return f"size {size} bytes, saved as {entry.bytes} (truncated or overwritten)"
        if digest != entry.fingerprint:
            return "contents changed since it was saved"
        return None

    def drop(self, entry: Entry, reason: str) -> None:
        """Forget a file and delete it."""
        with self._lock.held():
            self._sync()
            self._drop(entry, reason)
            self._write()

    def _drop(self, entry: Entry, reason: str) -> None:
        """drop() within a batch (a start's checks, a save's supersedes, the budget): the
        caller holds the lock and writes the index once at the end. A write per drop would
        cost k+1 writes, and a kill mid-batch would leave an index naming only the files
        kept so far (the next start deleting the rest as orphans)."""
        self._forget(entry)
        (self.dir / entry.file).unlink(missing_ok=True)
        self.counters.dropped += 1
        log.info("prompt_cache.dropped", file=entry.file, model=entry.model, reason=reason)
        if self._on_drop is not None:
            self._on_drop(entry, reason)

    def add(self, entry: Entry) -> None:
        """A file llama-server just wrote. Files of the same setup whose prompt is a prefix of
        this one's are superseded (this one holds all they hold); then the budget."""
        with self._lock.held():
            self._sync()
            self._add(entry)

    def _add(self, entry: Entry) -> None:
        for old in list(self._by_key.get(entry.scope, {}).values()):
            if len(old.tokens) <= len(entry.tokens) \
                    and common_prefix(old.tokens, entry.tokens) == len(old.tokens):
                self._drop(old, "superseded by a longer save of the same conversation")
        self._remember(entry)
        self._per_token[entry.key] = entry.bytes / max(entry.n_tokens, 1)
        self.counters.saves += 1
        self.counters.saved_bytes += entry.bytes
        self._fit_budget()
        self._write()

    def _remember(self, entry: Entry) -> None:
        self.entries[entry.file] = entry
        self._by_key.setdefault(entry.scope, {})[entry.file] = entry
        self._heads.setdefault(entry.scope, collections.Counter())[entry.head] += 1

    def _forget(self, entry: Entry) -> None:
        self._packed.pop(entry.file, None)
        if self.entries.pop(entry.file, None) is None:
            return
        of_key = self._by_key.get(entry.scope, {})
        of_key.pop(entry.file, None)
        heads = self._heads[entry.scope]
        heads[entry.head] -= 1
        if heads[entry.head] <= 0:
            del heads[entry.head]
        if not of_key:
            del self._by_key[entry.scope], self._heads[entry.scope]

    def fit_budget(self) -> int:
        """The budget applied now (a reload lowered `max_mb`): how many files were deleted.
        Otherwise it applies only at the next save, and the disk holds more than the config
        allows until then."""
        with self._lock.held():
            self._sync()
            dropped = self._fit_budget()
            if dropped:
                try:
                    self._write()
                except OSError as exc:  # as at a start: the next read drops what is gone
                    log.warning("prompt_cache.index_not_written", dir=str(self.dir),
                                error=str(exc))
        return dropped

    def _fit_budget(self, extra: int = 0) -> int:
        """Files and saves in flight (with `extra` more bytes) within the budget: the least
        recently used files deleted first (the index not written: the caller's to do). How
        many were deleted."""
        budget = self._max_bytes()
        by_age = sorted(self.entries.values(), key=lambda e: e.last_used)
        total = sum(e.bytes for e in by_age) + self.pending_bytes() + extra
        dropped = 0
        for entry in by_age:
            if total <= budget:
                break
            total -= entry.bytes
            self._drop(entry, f"disk budget ({budget // (1 << 20)} MiB)")
            dropped += 1
        return dropped

    def pending_bytes(self) -> int:
        return sum(int(p["bytes"]) for p in self.pending.values())

    def expected(self, key: str, tokens: int, per_token: float | None) -> int | None:
        """A file's size for `tokens` tokens of this setup: from its earlier files' bytes per
        token, else `per_token` (the model's KV per token, files.kv_per_token)."""
        return expected_bytes(tokens, self._per_token.get(key, per_token))

    # -- saves in flight -------------------------------------------------------------------------

    def reserve(self, name: str, size: int | None) -> str | None:
        """Before the child is asked to write `name` (a temporary name, TEMP_SUFFIX): None when
        a file of `size` bytes fits (least recently used files deleted to make room, and the
        size counted as pending until commit or release), else why not: larger than the whole
        budget, or than half the disk's free space. An unknown size is counted as nothing
        until the file is indexed (the budget then applies)."""
        nbytes = size or 0
        with self._lock.held():
            self._sync()
            if nbytes > self._max_bytes():
                return f"about {nbytes / (1 << 20):.0f} MiB, over the whole budget"
            if nbytes * 2 > shutil.disk_usage(self.dir).free:
                return f"about {nbytes / (1 << 20):.0f} MiB, over half the free disk space"
            in_flight = self.pending_bytes()
            if in_flight + nbytes > self._max_bytes():
                # Deleting every file would not make room: saves in flight hold the rest.
                return (f"about {nbytes / (1 << 20):.0f} MiB, and saves in flight take "
                        f"{in_flight / (1 << 20):.0f} MiB of the budget")
            if self._fit_budget(extra=nbytes):
                self._write()
            self.pending[name] = {"file": name, "bytes": nbytes, "owner": OWNER,
                                  "since": time.time()}
            try:
                self._write_pending()
            except OSError as exc:
                # Not counted where the other daemons look: not asked for either (left in
                # memory, a full disk's failed saves would hold the budget until a restart).
                del self.pending[name]
                return f"the list of saves in flight could not be written: {exc}"
        return None

    def commit(self, name: str, entry: Entry) -> None:
        """The child wrote `name` and `entry` describes it: renamed to entry.file and indexed
        in one step (no other daemon ever sees a finished file the index does not name)."""
        with self._lock.held():
            self._sync()
            budget = self._max_bytes()
            if entry.bytes > budget:
                # A save of unknown size (reserved as nothing) larger than the whole budget:
                # indexed, it would push out every other file, then itself. The next save of
                # this setup knows its size now, and is skipped at its reservation.
                self._per_token[entry.key] = entry.bytes / max(entry.n_tokens, 1)
                raise ValueError(f"{entry.bytes / (1 << 20):.0f} MiB written, over the whole "
                                 f"budget ({budget // (1 << 20)} MiB)")
            # llama-server created it under its umask (0644 as a rule): the conversation is
            # made private before any other daemon can see it indexed.
            os.chmod(self.dir / name, 0o600)
            os.replace(self.dir / name, self.dir / entry.file)
            # Its reservation ends as its file is counted (the budget must not see both).
            self.pending.pop(name, None)
            self._add(entry)
            self._write_pending()

    def release(self, name: str) -> None:
        """A save that will not be indexed (failed, cut short, its child gone): its temporary
        file deleted and its bytes no longer counted."""
        with self._lock.held():
            self._sync()
            (self.dir / name).unlink(missing_ok=True)
            if self.pending.pop(name, None) is not None:
                self._write_pending()

    def best(self, key: str, tokens: Sequence[int], min_tokens: int,
             namespace: str = "") -> tuple[Entry, int] | None:
        """The file of this setup and namespace sharing the longest prefix with `tokens` (at
        least `min_tokens` of it), and that length."""
        found: tuple[Entry, int] | None = None
        for entry in self._by_key.get(scope(key, namespace), {}).values():
            shared = common_prefix(entry.tokens, tokens)
            if shared >= min_tokens and (found is None or shared > found[1]):
                found = (entry, shared)
        return found

    def has_key(self, key: str, namespace: str = "") -> bool:
        return scope(key, namespace) in self._by_key

    def may_match(self, key: str, head: str | None, namespace: str = "") -> bool:
        """Whether any file of this setup and namespace could share a prefix with a request
        that begins with `head` (restores of the setup not turned off): when not, the child is
        not asked for the request's tokens at all."""
        heads = self._heads.get(scope(key, namespace))
        if heads is None or key in self.off:
            return False
        return head is None or head in heads or None in heads

    def restore_unused(self, key: str, why: str) -> None:
        """A restore of this setup was not reused by the child: no more restores of it."""
        self.counters.unused_restores += 1
        self.off.setdefault(key, why)

    def used(self, entry: Entry, tokens: int) -> None:
        # Not written now: a restore is on its request's path, and last_used only orders the
        # budget's evictions. The index's next write (a save, a drop) carries it; a crash
        # before then forgets only that the file was used.
        entry.last_used = time.time()
        self.counters.restores += 1
        self.counters.restored_tokens += tokens

    def of_model(self, model: str) -> dict[str, int]:
        """One model's files and bytes (for its /admin/models entry)."""
        mine = [e.bytes for e in self.entries.values() if e.model == model]
        return {"files": len(mine), "bytes": sum(mine)}

    def status(self) -> dict[str, Any]:
        c = self.counters
        models: dict[str, dict[str, int]] = {}
        for e in self.entries.values():
            m = models.setdefault(e.model, {"files": 0, "bytes": 0})
            m["files"] += 1
            m["bytes"] += e.bytes
        return {
            "dir": str(self.dir), "files": len(self.entries),
            "bytes": sum(e.bytes for e in self.entries.values()),
            "max_bytes": self._max_bytes(), "pending_bytes": self.pending_bytes(),
            "saves": c.saves, "saved_bytes": c.saved_bytes,
            "hits": c.restores, "restored_tokens": c.restored_tokens, "misses": c.misses,
            "dropped": c.dropped, "unused_restores": c.unused_restores,
            "restores_off": len(self.off), "models": models,
            "entries": [{"file": e.file, "model": e.model, "namespace": e.namespace or None,
                         "setup": e.key, "tokens": e.n_tokens,
                         "prompt_tokens": len(e.tokens), "bytes": e.bytes,
                         "saved_at": e.saved_at, "last_used": e.last_used}
                        for e in sorted(self.entries.values(), key=lambda e: -e.last_used)],
        }
