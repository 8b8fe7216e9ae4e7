"""Pulling a GGUF into models_dir: `corral pull` and POST /admin/pull.

A source is an http(s) URL, or a Hugging Face file, `owner/repo[@revision]:path/in/repo.gguf`,
which becomes `{HF_ENDPOINT}/{owner}/{repo}/resolve/{revision}/{path}` (HF_ENDPOINT defaults
to https://huggingface.co, as in huggingface_hub).

The bytes go to `<models_dir>/.<name>.gguf.part`: hidden and not ending in `.gguf`, so
discovery and the models_dir watcher never see a download in progress, whatever depth it lies
at. Beside it, `.<name>.gguf.part.json` keeps the URL and the server's validators (ETag,
Last-Modified): a resumed pull asks for the rest with `Range` and `If-Range`, so a file that
changed upstream starts over instead of splicing two versions. A dropped connection resumes by
itself (RETRIES times in a row without progress, with back-off); a cancelled pull (Ctrl-C,
DELETE /admin/pulls/{id}) keeps its part for the next attempt.

Only a whole, verified file becomes a model: the GGUF magic (checked on the first bytes too, so
an HTML error page served with 200 fails at once), the size the server announced, and the
sha256 when one is known (given, or the Hugging Face hub's `X-Linked-Etag` for LFS files). A
bad checksum deletes the part. The part is then fsynced and renamed into place in one step;
an existing model is never replaced unless asked (`force`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import fcntl
import hashlib
import itertools
import json
import os
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from yarl import URL

from corral.supervisor.events import EventBus

if TYPE_CHECKING:
    from corral.supervisor.config import LoadedConfig

log = structlog.get_logger("corral.pull")

GGUF_MAGIC = b"GGUF"
DEFAULT_HUB = "https://huggingface.co"
RETRIES = 5  # failed attempts in a row (no byte gained) before a pull gives up
BACKOFF_S = 1.0  # first wait before a retry; doubles, at most BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 60.0  # silence on an open connection before it counts as dropped
PROGRESS_EVERY_S = 0.25
MAX_REDIRECTS = 10
_WRITE_AT = 1 << 20  # bytes gathered before one write (and hash update) in the writer thread
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")
# owner/repo[@revision]:path — Hugging Face's repository id rules, roughly: no slash, colon or
# whitespace in either part; the revision may hold slashes (refs/pr/1).
_HUB_FORM = re.compile(r"^(?P<owner>[A-Za-z0-9][\w.-]*)/(?P<repo>[\w.-]+)"
                       r"(?:@(?P<rev>[^:\s]+))?:(?P<file>[^\s]+)$", re.ASCII)
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})

ProgressFn = Callable[[int, int | None, float], None]  # downloaded, total (if known), bytes/s


class PullError(Exception):
    """A pull that failed; the message says why, for a person."""


class BadSource(PullError):
    """The source, name or checksum given cannot be pulled (a request error, not a failure)."""


class ModelExists(PullError):
    """The model file is there already and `force` was not given."""


class PullRunning(PullError):
    """Another pull writes the same file now."""


class NoModelsDir(PullError):
    """Nowhere to put the file: the config has no models_dir."""


class ChecksumMismatch(PullError):
    pass


class NotGguf(PullError):
    pass


class _Transient(Exception):
    """A failure a later attempt may not meet (a dropped connection, a 503)."""


@dataclass(frozen=True)
class Source:
    url: str
    filename: str  # the model file's name in models_dir
    # Whether the URL is on the Hugging Face hub: only then does HF_TOKEN go with it, and only
    # then is an ETag read as the file's sha256.
    hub: bool = False


@dataclass(frozen=True)
class Pulled:
    path: Path
    size: int
    sha256: str
    verified: str | None  # where the sha256 that was checked came from: "given", "hub", None
    resumed_from: int  # bytes already on disk when the pull began (0: a fresh download)


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HUB).rstrip("/")


def safe_filename(name: str) -> str:
    """`name` if it is a plain model file name: it ends in .gguf, names no folder (no `/` or
    `\\`), does not start with `.` (hidden: a part file, `..`), holds no control character
    and fits a file system's limit. It is written inside models_dir, so a name from a hostile
    URL must not be able to point anywhere else."""
    if not name.endswith(".gguf") or name == ".gguf":
        raise BadSource(f"{name[:100]!r} is not a .gguf file name")
    if "/" in name or "\\" in name or name.startswith("."):
        raise BadSource(f"{name[:100]!r} is not a plain file name (no folders, no leading '.')")
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or len(name.encode()) > 240:
        raise BadSource(f"{name[:100]!r} is not a usable file name")
    return name


def resolve_source(spec: str, name: str | None = None) -> Source:
    """Where to download `spec` from, and the file name it gets in models_dir (`name`, with
    `.gguf` added when it lacks it, else the name the URL or repository path ends with)."""
    spec = spec.strip()
    hub = URL(hub_endpoint())
    if spec.startswith(("http://", "https://")):
        url = URL(spec)
        if not url.host:
            raise BadSource(f"{spec[:200]!r} has no host")
        # The path's last segment, percent-decoded: `%2e%2e%2fx.gguf` is `../x.gguf`, refused.
        tail = urllib.parse.unquote(url.raw_path.rsplit("/", 1)[-1])
        filename = tail
        on_hub = url.origin() == hub.origin()
    else:
        match = _HUB_FORM.match(spec)
        if match is None or "://" in spec:
            raise BadSource(f"{spec[:200]!r} is neither an http(s) URL nor a Hugging Face file "
                            "(owner/repo:file.gguf or owner/repo@revision:file.gguf)")
        parts = match["file"].split("/")
        if any(p in ("", ".", "..") for p in parts) or match["repo"] in (".", ".."):
            raise BadSource(f"{match['file'][:200]!r} is not a file path in a repository")
        revision = urllib.parse.quote(match["rev"] or "main", safe="")
        path = "/".join(urllib.parse.quote(p, safe="") for p in parts)
        url = URL(f"{hub}/{match['owner']}/{match['repo']}/resolve/{revision}/{path}",
                  encoded=True)
        filename = parts[-1]
        on_hub = True
    if name is not None:
        return Source(str(url), model_filename(name), hub=on_hub)
    try:
        return Source(str(url), safe_filename(filename), hub=on_hub)
    except BadSource as exc:
        raise BadSource(f"{exc}; the file name comes from the URL: give a name to save it "
                        "under") from None


def model_filename(name: str) -> str:
    """The file a model pulled under `name` is saved as: `name`, with `.gguf` added."""
    return safe_filename(name if name.endswith(".gguf") else name + ".gguf")


def check_sha256(value: str | None) -> str | None:
    if value is None:
        return None
    if not _SHA256.match(value.strip()):
        raise BadSource("sha256 must be 64 hexadecimal digits")
    return value.strip().lower()


def part_paths(models_dir: Path, filename: str) -> tuple[Path, Path]:
    """The part file and its validators file for `filename` in models_dir."""
    return models_dir / f".{filename}.part", models_dir / f".{filename}.part.json"


def models_dir_of(loaded: LoadedConfig) -> Path | None:
    """The folder discovery reads for this config (None: no models_dir)."""
    # Imported here: config_watch imports the daemon, which imports this module.
    from corral.supervisor.config_watch import models_folder

    return models_folder(loaded)


def _hub_sha256(headers: Any) -> str | None:
    """The hub answers a resolve for an LFS file with `X-Linked-Etag: "<sha256>"` (and ETag the
    same on its own 200s); a 40-digit ETag is a git blob id, not a content hash."""
    for key in ("X-Linked-Etag", "ETag"):
        value = headers.get(key)
        if value:
            value = value.removeprefix("W/").strip('"')
            return value.lower() if _SHA256.match(value) else None
    return None


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total) from `bytes a-b/total` or `bytes */total`; None where absent."""
    match = re.match(r"bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)", value or "")
    if match is None:
        return None, None
    first = int(match[1]) if match[1] is not None else None
    return first, int(match[2]) if match[2] != "*" else None


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
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            # Two pulls of one file (two terminals, a terminal and the daemon) would interleave
            # their bytes: the second is refused while the first holds the lock.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._pool.shutdown()
            raise PullRunning(f"another pull is writing {self.path}") from None
        self._file = os.fdopen(fd, "r+b")
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
        while left > 0:
            chunk = self._file.read(min(left, 8 << 20))
            if not chunk:
                break
            self.hasher.update(chunk)
            left -= len(chunk)
        self._file.seek(0, os.SEEK_END)
        self.hashed = True

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self.hasher.update(data)
        self.size += len(data)

    def head(self, n: int) -> bytes:
        self._file.flush()
        return os.pread(self._file.fileno(), n, 0)

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.size == 0:
            self.remove()  # nothing to resume (a 404, a refused body): no litter
        self._file.close()  # flushes, and releases the lock

    def remove(self) -> None:
        for path in (self.path, self.meta_path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


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
    models_dir.mkdir(parents=True, exist_ok=True)
    download = _Download(source, models_dir, expected, progress,
                         token if token is not None else os.environ.get("HF_TOKEN"))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                    connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    part = _Part(models_dir, source.filename)
    try:
        # auto_decompress off: the bytes on disk are the file's bytes, and offsets in Range
        # count those (a gzip-encoded answer would count others).
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False,
                                         headers={"User-Agent": "corral-pull/1"}) as session:
            return await download.run(session, part, target, force, retries, backoff)
    finally:
        download.meter.close()
        part.close()


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
        failures = 0
        while True:
            before = part.size
            try:
                if await self._attempt(session, part):
                    return
                continue  # the server told us to start over: at once, not a failure
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
            await self._receive(resp, part)
        if self.total is not None and part.size < self.total:
            raise _Transient(f"connection ended at {part.size} of {self.total} bytes")
        if self.total is not None and part.size > self.total:
            await part.run(part.restart)
            raise PullError(f"{self.source.filename}: the server sent more bytes than it "
                            "announced; the partial download was deleted")
        return True

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
                if len(buffer) >= _WRITE_AT:
                    await part.run(part.write, bytes(buffer))
                    buffer.clear()
                self.meter(part.size + len(buffer), self.total)
        finally:
            # What arrived before a drop or a cancel is kept: the next attempt asks for less.
            if buffer:
                await part.run(part.write, bytes(buffer))
            self.meter(part.size, self.total, force=True)

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


def _loggable(url: str) -> str:
    """`url` without what may be a secret: a user and password, a signed query."""
    parsed = URL(url, encoded=True)
    return str(parsed.with_user(None).with_query(None)) + ("?..." if parsed.raw_query_string
                                                           else "")


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no data for {READ_TIMEOUT_S:g}s (or no connection within {CONNECT_TIMEOUT_S:g}s)"
    return str(exc) or type(exc).__name__


# -- pulls the daemon runs (POST /admin/pull) ----------------------------------------------------

PULL_STATES = ("running", "done", "failed", "cancelled")
_KEEP_FINISHED = 50


@dataclass(eq=False)
class PullJob:
    id: str
    source: str
    url: str
    file: str
    state: str = "running"
    downloaded: int = 0
    total: int | None = None
    speed: float = 0.0
    error: str | None = None
    sha256: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "url": self.url, "file": self.file,
                "state": self.state, "downloaded": self.downloaded, "total": self.total,
                "speed": round(self.speed), "error": self.error, "sha256": self.sha256,
                "started": self.started, "finished": self.finished}


class Puller:
    """The pulls a daemon runs: each one a task it owns (a client that hangs up does not stop
    it; DELETE /admin/pulls/{id} and shutdown do), its progress on the event bus as `pull`
    events: its start and end (kept for replay), and at most one a second while it runs
    (live only)."""

    def __init__(self, events: EventBus, loaded: Callable[[], LoadedConfig],
                 event_every: float = 1.0):
        self.events = events
        self._loaded = loaded  # models_dir may change with a reload: read at each pull
        self._event_every = event_every
        self._jobs: dict[str, PullJob] = {}
        self._ids = itertools.count(1)

    def models_dir(self) -> Path | None:
        return models_dir_of(self._loaded())

    def start(self, spec: str, *, name: str | None = None, sha256: str | None = None,
              force: bool = False) -> PullJob:
        """Check the request and start the pull; raises BadSource, NoModelsDir, ModelExists or
        PullRunning before anything is downloaded."""
        source = resolve_source(spec, name)
        expected = check_sha256(sha256)
        folder = self.models_dir()
        if folder is None:
            raise NoModelsDir("the config sets no models_dir: nowhere to put the file "
                              "(set models_dir, or serve with --models-dir)")
        if any(j.state == "running" and j.file == source.filename for j in self._jobs.values()):
            raise PullRunning(f"{source.filename} is being pulled already")
        if (folder / source.filename).exists() and not force:
            raise ModelExists(f"{source.filename} exists in models_dir (force to replace it)")
        job = PullJob(f"pull-{next(self._ids)}", spec, source.url, source.filename)
        self._jobs[job.id] = job
        self._forget_old()
        job.task = asyncio.create_task(self._run(job, source, folder, expected, force),
                                       name=f"pull {source.filename}")
        self._publish(job)
        return job

    def jobs(self) -> list[PullJob]:
        return list(self._jobs.values())

    def get(self, pull_id: str) -> PullJob | None:
        return self._jobs.get(pull_id)

    def cancel(self, pull_id: str) -> PullJob | None:
        job = self._jobs.get(pull_id)
        if job is not None and job.task is not None and not job.task.done():
            job.task.cancel()
        return job

    async def wait(self, pull_id: str) -> PullJob | None:
        job = self._jobs.get(pull_id)
        if job is not None and job.task is not None:
            await asyncio.wait([job.task])
        return job

    async def close(self) -> None:
        """Cancel every running pull and wait for each to close its file (parts are kept)."""
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self, job: PullJob, source: Source, folder: Path, expected: str | None,
                   force: bool) -> None:
        last_event = 0.0

        def progress(downloaded: int, total: int | None, speed: float) -> None:
            nonlocal last_event
            job.downloaded, job.total, job.speed = downloaded, total, speed
            now = time.monotonic()
            if now - last_event >= self._event_every:
                last_event = now
                self._publish(job, history=False)

        try:
            result = await pull(source, folder, sha256=expected, force=force, progress=progress)
        except asyncio.CancelledError:
            job.state = "cancelled"
            log.info("pull.cancelled", file=job.file, id=job.id, downloaded=job.downloaded)
            raise
        except PullError as exc:
            job.state, job.error = "failed", str(exc)
            log.error("pull.failed", file=job.file, id=job.id, error=str(exc))
        except Exception as exc:  # a bug, or the disk: the pull fails, the daemon goes on
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("pull.failed", file=job.file, id=job.id)
        else:
            job.state, job.sha256 = "done", result.sha256
            job.downloaded = job.total = result.size
        finally:
            job.finished = time.time()
            job.speed = 0.0
            self._publish(job)

    def _publish(self, job: PullJob, history: bool = True) -> None:
        # Progress ticks are live only: a long download must not push the rarer events
        # (loads, reloads, this pull's start and end) out of what a reader can replay.
        self.events.publish("pull", history=history, id=job.id, file=job.file, state=job.state,
                            downloaded=job.downloaded, total=job.total, speed=round(job.speed),
                            error=job.error)

    def _forget_old(self) -> None:
        done = [j for j in self._jobs.values() if j.state != "running"]
        for job in done[:max(len(done) - _KEEP_FINISHED, 0)]:
            del self._jobs[job.id]
