"""Downloading a source into its part over HTTP, resuming and checking it, until a verified
model file is in place: `pull()`.

A resumed pull asks for the rest with `Range` and `If-Range` (the validators the part kept), so
a file that changed upstream starts over instead of splicing two versions. A dropped connection
resumes by itself (RETRIES times in a row without progress, with back-off); a cancelled pull
(Ctrl-C, DELETE /admin/pulls/{id}) keeps its part for the next attempt.

A server that answers every resume with a range it was not asked for starts over at most
RESTARTS times; one that sends more than it announced is cut off at once. The disk
keeps a reserve free (RESERVE_BYTES, or 5 % of a small disk): a file that does not fit is
refused before its first byte when its size is known, and stopped at the reserve otherwise.

Only a whole, verified file becomes a model: the GGUF magic (checked on the first bytes too, so
an HTML error page served with 200 fails at once), the size the server announced, the end of
the tensor data its header lists (a body of no announced size ends when the line drops), and the
sha256 when one is known (given, or the Hugging Face hub's `X-Linked-Etag` for LFS files). A
bad checksum deletes the part.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import structlog
from yarl import URL

from corral.supervisor.gguf_header import read_header
from corral.supervisor.pull.part import _Part, _place
from corral.supervisor.pull.source import (
    ChecksumMismatch,
    ModelExists,
    NoSpace,
    NotGguf,
    PullError,
    Source,
    _hub_sha256,
    check_sha256,
    hub_endpoint,
)

log = structlog.get_logger("corral.pull")

GGUF_MAGIC = b"GGUF"
RETRIES = 5  # failed attempts in a row (no byte gained) before a pull gives up
RESTARTS = 3  # starts over (ranges that do not fit) before a pull gives up
RESERVE_BYTES = 512 << 20  # left free on the models_dir's disk (at most 5 % of it)
BACKOFF_S = 1.0  # first wait before a retry; doubles, at most BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 60.0  # silence on an open connection before it counts as dropped
PROGRESS_EVERY_S = 0.25
MAX_REDIRECTS = 10
_WRITE_AT = 1 << 20  # bytes gathered before one write (and hash update) in the writer thread
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# A write refused for want of room: the disk, a quota, a file size limit (RLIMIT_FSIZE).
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

ProgressFn = Callable[[int, int | None, float], None]  # downloaded, total (if known), bytes/s


class _Transient(Exception):
    """A failure a later attempt may not meet (a dropped connection, a 503)."""


@dataclass(frozen=True)
class Pulled:
    path: Path
    size: int
    sha256: str
    verified: str | None  # where the sha256 that was checked came from: "given", "hub", None
    resumed_from: int  # bytes already on disk when the pull began (0: a fresh download)


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total) from `bytes a-b/total` or `bytes */total`; None where absent."""
    match = re.match(r"bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)", value or "")
    if match is None:
        return None, None
    first = int(match[1]) if match[1] is not None else None
    return first, int(match[2]) if match[2] != "*" else None


class _Meter:
    """Calls `progress` at most every PROGRESS_EVERY_S with a speed over the last seconds. A
    call held back is made later with the latest figures, so a download that stalls still
    shows all it got."""

    def __init__(self, progress: ProgressFn | None):
        self.progress = progress
        self.last = 0.0
        self.window: list[tuple[float, int]] = []
        self.latest: tuple[int, int | None] = (0, None)
        self._later: asyncio.TimerHandle | None = None

    def __call__(self, downloaded: int, total: int | None, force: bool = False) -> None:
        self.latest = (downloaded, total)
        if self.progress is None:
            return
        wait = self.last + PROGRESS_EVERY_S - time.monotonic()
        if force or wait <= 0:
            self._emit()
        elif self._later is None:
            self._later = asyncio.get_running_loop().call_later(wait, self._emit)

    def close(self) -> None:
        if self._later is not None:
            self._later.cancel()
            self._later = None

    def _emit(self) -> None:
        self.close()
        if self.progress is None:
            return
        downloaded, total = self.latest
        now = self.last = time.monotonic()
        self.window.append((now, downloaded))
        while len(self.window) > 2 and now - self.window[0][0] > 3.0:
            self.window.pop(0)
        t0, d0 = self.window[0]
        speed = (downloaded - d0) / (now - t0) if now > t0 and downloaded >= d0 else 0.0
        self.progress(downloaded, total, speed)


async def pull(source: Source, models_dir: Path, *, sha256: str | None = None,
               force: bool = False, progress: ProgressFn | None = None,
               token: str | None = None, retries: int = RETRIES,
               backoff: float = BACKOFF_S) -> Pulled:
    """Download `source` into `models_dir` (created if missing) and return the model file.
    `token` (default: HF_TOKEN) goes to the hub only."""
    expected = check_sha256(sha256)
    target = models_dir / source.filename
    if target.exists() and not force:
        raise ModelExists(f"{target} exists (force to replace it)")
    download = _Download(source, models_dir, expected, progress,
                         token if token is not None else os.environ.get("HF_TOKEN"))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                    connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        part = _Part(models_dir, source.filename)
        try:
            # auto_decompress off: the bytes on disk are the file's bytes, and offsets in
            # Range count those (a gzip-encoded answer would count others).
            async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                             headers={"User-Agent": "corral-pull/1"}) as session:
                return await download.run(session, part, target, force, retries, backoff)
        finally:
            download.meter.close()
            await part.aclose()
    except OSError as exc:
        # The folder, not the network (those errors end in _fetch): not writable, read-only,
        # a failing disk. A failed pull to report, not a bug.
        kind = NoSpace if exc.errno in _NO_ROOM else PullError
        raise kind(f"{source.filename}: cannot write in {models_dir}: {exc}") from exc


class _Download:
    def __init__(self, source: Source, models_dir: Path, expected: str | None,
                 progress: ProgressFn | None, token: str | None):
        self.source = source
        self.models_dir = models_dir
        self.expected = expected
        self.expected_from: str | None = "given" if expected else None
        self.meter = _Meter(progress)
        self.token = token or None
        self.total: int | None = None
        self.log = log.bind(file=source.filename)

    async def run(self, session: aiohttp.ClientSession, part: _Part, target: Path,
                  force: bool, retries: int, backoff: float) -> Pulled:
        resumed_from = part.size
        meta = part.meta()
        if part.size and meta.get("url") != self.source.url:
            # Left by a pull of another URL into the same name: its bytes are not ours.
            self.log.info("pull.part_discarded", reason="another source", size=part.size)
            await part.run(part.restart)
            resumed_from, meta = 0, {}
        self.total = meta.get("total") if isinstance(meta.get("total"), int) else None
        self.log.info("pull.started", url=_loggable(self.source.url), folder=str(self.models_dir),
                      resume_from=part.size or None)
        try:
            await self._fetch(session, part, retries, backoff)
        except NotGguf:
            part.remove()  # nothing in it is worth resuming
            raise
        return await self._finish(part, target, force, resumed_from)

    async def _fetch(self, session: aiohttp.ClientSession, part: _Part, retries: int,
                     backoff: float) -> None:
        """Until the part holds the whole file: resume after drops, start over when told."""
        failures = restarts = 0
        while True:
            before = part.size
            try:
                if await self._attempt(session, part):
                    return
                # The server told us to start over: at once, not a failure; but a server
                # whose every answer does not fit would have us start over forever.
                restarts += 1
                if restarts > RESTARTS:
                    raise PullError(f"{self.source.filename}: the server answered {restarts} "
                                    "resumes with a range that does not fit the file; "
                                    "its Range support is broken (the partial download was "
                                    "deleted)")
                continue
            except aiohttp.ClientConnectorDNSError as exc:
                # A name that does not resolve is a typo or no network, not a dropped
                # connection: waiting half a minute to say so helps nobody.
                raise PullError(f"{self.source.filename}: cannot resolve "
                                f"{exc.host}: {_why(exc)}") from exc
            except (aiohttp.ClientError, TimeoutError, _Transient) as exc:
                # A failure after some progress starts a new streak: a long download may
                # drop many times, as long as each attempt gets somewhere.
                failures = 1 if part.size > before else failures + 1
                if failures > retries:
                    raise PullError(f"{self.source.filename}: download failed after {retries} "
                                    f"retries: {_why(exc)} ({part.size} bytes kept; pull "
                                    "again to resume)") from exc
                wait = min(backoff * 2 ** (failures - 1), BACKOFF_MAX_S)
                self.log.warning("pull.retry", error=_why(exc), downloaded=part.size,
                                 total=self.total, attempt=failures, wait_s=wait)
                await asyncio.sleep(wait)

    async def _attempt(self, session: aiohttp.ClientSession, part: _Part) -> bool:
        """One request: True once the part holds the whole file, False to start over."""
        meta = part.meta()
        headers = {"Accept-Encoding": "identity"}
        offset = part.size
        if offset:
            headers["Range"] = f"bytes={offset}-"
            # Changed upstream since: the server sends the whole new file (200). A weak ETag
            # may not be used here (RFC 9110), a date may.
            etag, modified = meta.get("etag"), meta.get("last_modified")
            validator = etag if isinstance(etag, str) and not etag.startswith("W/") else modified
            if isinstance(validator, str):
                headers["If-Range"] = validator
        async with await self._get(session, headers) as resp:
            if resp.status == 416 and offset:
                _, total = _content_range(resp.headers.get("Content-Range"))
                if total == offset and (self.total in (None, total)):
                    self.total = total
                    return True  # the part was whole already
                self.log.info("pull.restart", reason="range not satisfiable", size=offset,
                              total=total)
                await part.run(part.restart)
                return False
            if resp.status in _TRANSIENT_STATUS:
                raise _Transient(f"HTTP {resp.status} from {resp.url.host}")
            if resp.status not in (200, 206):
                raise PullError(self._refusal(resp.status))
            if resp.status == 206:
                first, total = _content_range(resp.headers.get("Content-Range"))
                if first != offset or (self.total is not None and total != self.total):
                    self.log.info("pull.restart", reason="unexpected range", asked=offset,
                                  got=resp.headers.get("Content-Range"))
                    await part.run(part.restart)
                    return False
                self.total = total
                if not part.hashed:
                    await part.run(part.hash_existing)
                self.log.info("pull.resumed", offset=offset, total=total)
            else:
                if offset:
                    # No Range support, or the file changed (If-Range): all of it again.
                    self.log.info("pull.restart", reason="server sent the whole file",
                                  size=offset)
                    await part.run(part.restart)
                self.total = resp.content_length
            part.save_meta({"url": self.source.url, "etag": resp.headers.get("ETag"),
                            "last_modified": resp.headers.get("Last-Modified"),
                            "total": self.total})
            self._check_room(part, 0)  # the whole rest, when its size is known
            await self._receive(resp, part)
        if self.total is not None and part.size < self.total:
            raise _Transient(f"connection ended at {part.size} of {self.total} bytes")
        if self.total is None:
            # No size announced: a body that ends when the connection closes reads as whole
            # when the line drops. The file's own tensor table says where it ends.
            end = await part.run(_gguf_end, part.path)
            if end is not None and part.size < end:
                raise _Transient(f"connection ended at {part.size} bytes; the file's tensor "
                                 f"data ends at {end}")
        return True

    def _check_room(self, part: _Part, pending: int) -> None:
        """Raise NoSpace when the rest of the file (or, its size unknown, the bytes about to be
        written) would leave less than the reserve free."""
        usage = shutil.disk_usage(self.models_dir)
        reserve = min(RESERVE_BYTES, usage.total // 20)
        need = self.total - part.size if self.total is not None else pending
        if usage.free - need >= reserve:
            return
        raise NoSpace(f"{self.source.filename}: not enough space in {self.models_dir}: "
                      f"{_size(need)} more needed, {_size(usage.free)} free, of which "
                      f"{_size(reserve)} stays free ({_kept(part)})")

    async def _get(self, session: aiohttp.ClientSession,
                   headers: dict[str, str]) -> aiohttp.ClientResponse:
        """GET, following redirects by hand: the token goes to the hub's own origin only (HF
        sends LFS files on to a CDN), and the hub's redirect carries the file's sha256."""
        url = URL(self.source.url, encoded=True)
        hub = URL(hub_endpoint()).origin()
        for _ in range(MAX_REDIRECTS + 1):
            sent = dict(headers)
            if self.token and url.origin() == hub:
                sent["Authorization"] = f"Bearer {self.token}"
            resp = await session.get(url, headers=sent, allow_redirects=False)
            if self.source.hub and url.origin() == hub and self.expected is None:
                found = _hub_sha256(resp.headers)
                if found:
                    self.expected, self.expected_from = found, "hub"
            if resp.status not in (301, 302, 303, 307, 308):
                return resp
            location = resp.headers.get("Location")
            resp.release()
            if not location:
                raise PullError(f"HTTP {resp.status} without a Location from {url.host}")
            url = url.join(URL(location, encoded=True))
            if url.scheme not in ("http", "https"):
                raise PullError(f"redirected to a {url.scheme!r} URL")
        raise PullError(f"more than {MAX_REDIRECTS} redirects")

    def _refusal(self, status: int) -> str:
        what = f"{_loggable(self.source.url)}: HTTP {status}"
        if status in (401, 403) and self.source.hub:
            return what + (" (a gated or private repository: set HF_TOKEN, and accept its "
                           "terms on the hub)" if not self.token else
                           " (HF_TOKEN was sent: does it have access to this repository?)")
        if status == 404:
            return what + " (no such file; check the repository, revision and file name)"
        return what

    async def _receive(self, resp: aiohttp.ClientResponse, part: _Part) -> None:
        buffer = bytearray()
        check = part.size == 0  # a resumed part was checked when its first bytes came
        try:
            # Whatever has arrived, at once: what aiohttp still buffers when the line drops is
            # lost (it raises first), so the less it holds the less is fetched again.
            async for chunk in resp.content.iter_any():
                buffer += chunk
                if check and len(buffer) >= len(GGUF_MAGIC):
                    # Before the rest arrives: an error page served with 200 fails at once.
                    if not buffer.startswith(GGUF_MAGIC):
                        head = bytes(buffer[:80])
                        buffer.clear()
                        raise NotGguf(self._not_gguf(resp, head))
                    check = False
                if self.total is not None and part.size + len(buffer) > self.total:
                    # Cut off here: a server that does not stop must not fill the disk.
                    buffer.clear()
                    await part.run(part.restart)
                    raise PullError(f"{self.source.filename}: the server sent more than the "
                                    f"{self.total} bytes it announced; the partial download "
                                    "was deleted")
                if len(buffer) >= _WRITE_AT:
                    data = bytes(buffer)
                    buffer.clear()  # not written twice: a failed write is not retried below
                    self._check_room(part, len(data))
                    await self._write(part, data)
                self.meter(part.size + len(buffer), self.total)
        finally:
            # What arrived before a drop or a cancel is kept: the next attempt asks for less.
            if buffer:
                data = bytes(buffer)
                buffer.clear()
                await self._write(part, data)
            self.meter(part.size, self.total, force=True)

    async def _write(self, part: _Part, data: bytes) -> None:
        """Append `data`; a disk that fills up meanwhile (another writer took the room the
        check saw) is NoSpace, like one found full before, with the part kept to resume."""
        try:
            await part.run(part.write, data)
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            raise NoSpace(f"{self.source.filename}: no room left in {self.models_dir} "
                          f"({exc.strerror}) ({_kept(part)})") from None

    def _not_gguf(self, resp: aiohttp.ClientResponse, head: bytes) -> str:
        kind = resp.headers.get("Content-Type", "no Content-Type")
        text = head.decode("utf-8", "replace").replace("\n", " ")[:60]
        return (f"{_loggable(self.source.url)} is not a GGUF file (the server sent {kind}, "
                f"starting {text!r})")

    async def _finish(self, part: _Part, target: Path, force: bool,
                      resumed_from: int) -> Pulled:
        self.meter(part.size, self.total, force=True)
        if await part.run(part.head, len(GGUF_MAGIC)) != GGUF_MAGIC:
            part.remove()
            raise NotGguf(f"{_loggable(self.source.url)} is not a GGUF file; the download was "
                          "deleted")
        end = await part.run(_gguf_end, part.path)
        if end is not None and part.size < end:
            # Whole as the server counts, cut short as the file counts: a model that would
            # fail to load (or one the server itself holds truncated).
            part.remove()
            raise NotGguf(f"{_loggable(self.source.url)}: the file is {part.size} bytes but its "
                          f"tensor data ends at {end}: truncated; the download was deleted")
        if not part.hashed:
            await part.run(part.hash_existing)  # a part found whole (416) on a resume
        digest = part.hasher.hexdigest()
        if self.expected is not None and digest != self.expected:
            part.remove()
            raise ChecksumMismatch(
                f"{self.source.filename}: sha256 mismatch (expected {self.expected}"
                f"{' from the hub' if self.expected_from == 'hub' else ''}, got {digest}); "
                "the download was deleted")
        # On disk before its name says it is a model: a crash after the rename must not
        # leave a file of zeros under that name.
        await part.run(part.sync)
        modified = part.meta().get("last_modified")
        await part.run(_place, part.path, target, force, modified)
        with contextlib.suppress(FileNotFoundError):
            part.meta_path.unlink()
        self.log.info("pull.done", path=str(target), size=part.size, sha256=digest,
                      verified=self.expected_from, resumed_from=resumed_from or None)
        return Pulled(target, part.size, digest, self.expected_from, resumed_from)


def _loggable(url: str) -> str:
    """`url` without what may be a secret: a user and password, a signed query."""
    parsed = URL(url, encoded=True)
    return str(parsed.with_user(None).with_query(None)) + ("?..." if parsed.raw_query_string
                                                           else "")


def _gguf_end(path: Path) -> int | None:
    """Where the GGUF file at `path` says its tensor data ends; None when its header cannot
    be read (cut inside it, or a type this gguf does not know: no verdict)."""
    try:
        header = read_header(path)
        return max((t.offset + t.n_bytes for t in header.tensors), default=header.data_start)
    except (OSError, ValueError, KeyError):
        return None


def _kept(part: _Part) -> str:
    return f"{part.size} bytes kept; free space and pull again to resume" if part.size \
        else "nothing was kept"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} bytes"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no data for {READ_TIMEOUT_S:g}s (or no connection within {CONNECT_TIMEOUT_S:g}s)"
    return str(exc) or type(exc).__name__
