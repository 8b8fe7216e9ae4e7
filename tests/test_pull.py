"""Pulling models: `corral pull` and POST /admin/pull against a local HTTP server (aiohttp, in a
thread) serving tiny GGUFs with Range support: a plain pull, a dropped connection resumed with
Range, a cancelled pull resumed by the next one, a file changed upstream started over, bad
checksums and non-GGUF bodies refused, hostile names refused, the Hugging Face `repo:file`
form (its token kept from the CDN it redirects to), and partial files never listed as models.
No network beyond 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from corral.supervisor import pull
from corral.supervisor.config import parse_config
from corral.supervisor.discovery import discover
from corral.supervisor.events import EventBus

from conftest import CorralFactory, free_port, sse_lines, tiny_config, wait_until
from tinymodel import write_tiny_llama

OLD_DATE = "Tue, 01 Jul 2025 10:00:00 GMT"  # Last-Modified of the blobs served


class Server:
    """One aiohttp app on two ports: `port` plays the origin (and the hub), `cdn_port` another
    origin the hub redirects to. Every request is recorded."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[dict[str, Any]] = []
        self.blobs: dict[str, bytes] = {}
        self.cut_once: dict[str, int] = {}  # name → bytes sent before the connection drops
        self.cut_always: dict[str, int] = {}  # the same, on every answer
        self.stall: dict[str, int] = {}  # name → bytes sent before it goes silent
        self.linked_etag: dict[str, str] = {}  # name → the hub's X-Linked-Etag
        # Broken servers: `wrong_range` answers every Range with bytes from 0; `endless`
        # answers a Range with the right Content-Range, then never stops sending; `flood`
        # answers 200 with no Content-Length and never stops.
        self.wrong_range: set[str] = set()
        self.endless: set[str] = set()
        self.flood: set[str] = set()
        self.port, self.cdn_port = free_port(), free_port()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def url(self, path: str, cdn: bool = False) -> str:
        return f"http://127.0.0.1:{self.cdn_port if cdn else self.port}{path}"

    def seen(self, path_part: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if path_part in r["path"]]

    def start(self) -> None:
        app = web.Application()
        app.router.add_get("/files/{name}", self._file)
        app.router.add_get("/blob/{name}", self._blob)
        app.router.add_get("/html/{name}", self._html)
        app.router.add_get("/{owner}/{repo}/resolve/{rev}/{path:.+}", self._resolve)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(app), self._loop).result(10)

    async def _start(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        for port in (self.port, self.cdn_port):
            await web.TCPSite(self._runner, "127.0.0.1", port).start()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        asyncio.run_coroutine_threadsafe(self._cancel_the_rest(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @staticmethod
    async def _cancel_the_rest() -> None:
        """Handlers still stalled (a client that never came back)."""
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def _record(self, request: web.Request) -> None:
        self.requests.append({"path": request.path, "port": request.url.port,
                              "range": request.headers.get("Range"),
                              "if_range": request.headers.get("If-Range"),
                              "auth": request.headers.get("Authorization")})

    async def _file(self, request: web.Request) -> web.StreamResponse:
        # aiohttp's own Range support: what a real static server does.
        self._record(request)
        path = self.root / request.match_info["name"]
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    async def _html(self, request: web.Request) -> web.Response:
        self._record(request)
        return web.Response(text="<!DOCTYPE html><html><body>Rate limited</body></html>" * 50,
                            content_type="text/html")

    async def _resolve(self, request: web.Request) -> web.Response:
        self._record(request)
        name = request.match_info["path"].rsplit("/", 1)[-1]
        headers = {"Location": self.url(f"/blob/{name}", cdn=True)}
        if name in self.linked_etag:
            headers["X-Linked-Etag"] = f'"{self.linked_etag[name]}"'
        return web.Response(status=302, headers=headers)

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        """Range (`bytes=N-`) and If-Range by ETag, done by hand: aiohttp's FileResponse reads
        If-Range as a date only."""
        self._record(request)
        name = request.match_info["name"]
        data = self.blobs.get(name)
        if data is None:
            raise web.HTTPNotFound()
        etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
        start, status = 0, 200
        wanted = request.headers.get("Range")
        if_range = request.headers.get("If-Range")
        if wanted and (if_range is None or if_range == etag):
            start = int(wanted.removeprefix("bytes=").rstrip("-"))
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
        headers = {"ETag": etag, "Last-Modified": OLD_DATE, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if name in self.wrong_range and status == 206:
            start = 0
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        resp = web.StreamResponse(status=status, headers=headers)
        if (name in self.endless and status == 206) or name in self.flood:
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            with contextlib.suppress(ConnectionError):  # until the client gives up
                await resp.write(data[start:])
                while True:
                    await resp.write(b"\0" * 65536)
            return resp
        resp.content_length = len(data) - start
        await resp.prepare(request)
        body = data[start:]
        if name in self.cut_once or name in self.cut_always:
            await resp.write(body[:self.cut_once.pop(name, None) or self.cut_always[name]])
            assert request.transport is not None
            request.transport.close()  # the line drops: Content-Length promised more
            return resp
        if name in self.stall:
            await resp.write(body[:self.stall[name]])
            await asyncio.sleep(3600)  # silent until the client gives up or the server stops
        for i in range(0, len(body), 65536):
            await resp.write(body[i:i + 65536])
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("served")
    server = Server(root)
    write_tiny_llama(root / "tiny.gguf", seed=7)
    server.blobs["tiny.gguf"] = (root / "tiny.gguf").read_bytes()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server(served: Server) -> Server:
    served.requests.clear()
    served.cut_once.clear()
    served.cut_always.clear()
    served.stall.clear()
    served.linked_etag.clear()
    served.wrong_range.clear()
    served.endless.clear()
    served.flood.clear()
    return served


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run(source: pull.Source, folder: Path, **kwargs: Any) -> pull.Pulled:
    kwargs.setdefault("backoff", 0.01)
    return asyncio.run(pull.pull(source, folder, **kwargs))


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# -- the download itself ---------------------------------------------------------------------

def test_a_plain_pull_lands_whole_and_verified(server: Server, tmp_path: Path) -> None:
    source_bytes = (server.root / "tiny.gguf").read_bytes()
    seen: list[tuple[int, int | None, float]] = []
    result = run(pull.resolve_source(server.url("/files/tiny.gguf")), tmp_path / "models",
                 sha256=sha(source_bytes), progress=lambda *a: seen.append(a))
    target = tmp_path / "models" / "tiny.gguf"
    assert result.path == target and target.read_bytes() == source_bytes
    assert (result.size, result.sha256, result.verified, result.resumed_from) == (
        len(source_bytes), sha(source_bytes), "given", 0)
    assert leftovers(tmp_path / "models") == ["tiny.gguf"]  # no part, no validators file
    assert seen[-1][:2] == (len(source_bytes), len(source_bytes))
    assert [r["range"] for r in server.requests] == [None]
    # A second pull of the same name is refused before any request; force replaces it.
    with pytest.raises(pull.ModelExists):
        run(pull.resolve_source(server.url("/files/tiny.gguf")), tmp_path / "models")
    assert len(server.requests) == 1
    run(pull.resolve_source(server.url("/files/tiny.gguf"), name="again"), tmp_path / "models")
    assert (tmp_path / "models" / "again.gguf").read_bytes() == source_bytes


def test_a_dropped_connection_resumes_with_range(server: Server, tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    server.cut_once["tiny.gguf"] = 100_000
    result = run(pull.resolve_source(server.url("/blob/tiny.gguf")), tmp_path)
    assert (tmp_path / "tiny.gguf").read_bytes() == data and result.sha256 == sha(data)
    first, second = server.requests
    assert first["range"] is None
    # The rest, and only if it is still the same file (its ETag).
    assert second["range"] == "bytes=100000-"
    assert second["if_range"] == '"' + sha(data)[:16] + '"'
    assert leftovers(tmp_path) == ["tiny.gguf"]


def test_a_failed_pull_keeps_its_part_unlisted_and_the_next_pull_resumes(server: Server,
                                                                          tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    server.cut_once["tiny.gguf"] = 123_456
    with pytest.raises(pull.PullError, match="123456 bytes kept"):
        run(pull.resolve_source(server.url("/blob/tiny.gguf")), tmp_path, retries=0)
    assert leftovers(tmp_path) == [".tiny.gguf.part", ".tiny.gguf.part.json"]
    assert (tmp_path / ".tiny.gguf.part").read_bytes() == data[:123_456]
    assert discover(tmp_path) == []  # half a model is no model
    result = run(pull.resolve_source(server.url("/blob/tiny.gguf")), tmp_path)
    assert result.resumed_from == 123_456
    assert server.requests[-1]["range"] == "bytes=123456-"
    assert (tmp_path / "tiny.gguf").read_bytes() == data and result.sha256 == sha(data)
    assert leftovers(tmp_path) == ["tiny.gguf"]
    assert [m.name for m in discover(tmp_path)] == ["tiny"]


def test_a_cancelled_pull_closes_its_part_for_the_next_one(server: Server, tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    server.stall["tiny.gguf"] = 50_000
    part = tmp_path / ".tiny.gguf.part"

    async def cancel_midway() -> None:
        received = asyncio.Event()

        def progress(done: int, total: int | None, speed: float) -> None:
            if done == 50_000:
                received.set()

        task = asyncio.create_task(pull.pull(
            pull.resolve_source(server.url("/blob/tiny.gguf")), tmp_path, progress=progress))
        await asyncio.wait_for(received.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert part.stat().st_size == 50_000 and not (tmp_path / "tiny.gguf").exists()
    del server.stall["tiny.gguf"]
    result = run(pull.resolve_source(server.url("/blob/tiny.gguf")), tmp_path)
    assert result.resumed_from == 50_000 and server.requests[-1]["range"] == "bytes=50000-"
    assert (tmp_path / "tiny.gguf").read_bytes() == data


def test_a_file_changed_upstream_starts_over_instead_of_splicing(server: Server,
                                                                 tmp_path: Path) -> None:
    old = server.blobs["tiny.gguf"]
    new = write_tiny_llama(tmp_path / "new-src.gguf", seed=8).read_bytes()
    assert len(new) == len(old) and new != old
    server.blobs["changing.gguf"] = old
    server.cut_once["changing.gguf"] = 200_000
    models = tmp_path / "models"
    with pytest.raises(pull.PullError):
        run(pull.resolve_source(server.url("/blob/changing.gguf")), models, retries=0)
    server.blobs["changing.gguf"] = new  # a new upload under the same URL
    result = run(pull.resolve_source(server.url("/blob/changing.gguf")), models)
    # If-Range carried the old ETag: the server sent all of the new file, not its tail.
    assert server.requests[-1]["if_range"] == '"' + sha(old)[:16] + '"'
    assert (models / "changing.gguf").read_bytes() == new and result.sha256 == sha(new)
    assert result.resumed_from == 200_000  # it was there, and was thrown away


def test_a_part_already_whole_is_finished_without_downloading_again(server: Server,
                                                                    tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    url = server.url("/files/tiny.gguf")
    part, meta = pull.part_paths(tmp_path, "tiny.gguf")
    part.write_bytes(data)
    meta.write_text(json.dumps({"url": url, "total": len(data)}))
    result = run(pull.resolve_source(url), tmp_path, sha256=sha(data))
    assert server.requests[-1]["range"] == f"bytes={len(data)}-"  # answered 416
    assert result.sha256 == sha(data) and leftovers(tmp_path) == ["tiny.gguf"]


def test_a_server_whose_ranges_never_fit_is_given_up_on(server: Server, tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    server.blobs["ranges.gguf"] = data
    server.wrong_range.add("ranges.gguf")
    server.cut_always["ranges.gguf"] = 100_000  # every answer drops; every resume is refused
    with pytest.raises(pull.PullError, match="Range support is broken"):
        run(pull.resolve_source(server.url("/blob/ranges.gguf")), tmp_path)
    # Start, drop, resume (a wrong range: start over), ... a few times, not forever.
    asked = [r["range"] for r in server.seen("/blob/ranges.gguf")]
    assert asked == [None, "bytes=100000-"] * (pull.download.RESTARTS + 1), asked
    assert leftovers(tmp_path) == []


def test_a_server_that_sends_more_than_it_announced_is_cut_off(server: Server,
                                                               tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    server.blobs["endless.gguf"] = data
    server.cut_once["endless.gguf"] = 100_000  # the resume's 206 announces the size, then floods
    server.endless.add("endless.gguf")
    began = time.monotonic()
    with pytest.raises(pull.PullError, match=f"more than the {len(data)} bytes it announced"):
        run(pull.resolve_source(server.url("/blob/endless.gguf")), tmp_path)
    assert time.monotonic() - began < 10
    assert leftovers(tmp_path) == []  # its bytes are not worth resuming from


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """A real small filesystem (tmpfs; CI runs as root) to fill up."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       check=True)
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_file_that_does_not_fit_is_refused_before_its_first_byte(
        server: Server, small_disk: Callable[[str], Path]) -> None:
    disk = small_disk("256k")  # the model is ~0.5 MB
    with pytest.raises(pull.NoSpace, match=r"not enough space .*\(nothing was kept\)"):
        run(pull.resolve_source(server.url("/blob/tiny.gguf")), disk)
    assert leftovers(disk) == []


def test_a_download_of_unknown_size_stops_at_the_reserve(server: Server,
                                                         small_disk: Callable[[str], Path]) -> None:
    disk = small_disk("3m")
    server.blobs["flood.gguf"] = server.blobs["tiny.gguf"]
    server.flood.add("flood.gguf")
    with pytest.raises(pull.NoSpace, match="bytes kept; free space and pull again"):
        run(pull.resolve_source(server.url("/blob/flood.gguf")), disk)
    free = os.statvfs(disk)
    assert free.f_bavail * free.f_frsize >= (3 << 20) // 20  # the reserve stayed free
    assert (disk / ".flood.gguf.part").stat().st_size >= 1 << 20  # kept for a resume


def test_a_bad_checksum_leaves_nothing_behind(server: Server, tmp_path: Path) -> None:
    with pytest.raises(pull.ChecksumMismatch, match=r"sha256 mismatch.*deleted"):
        run(pull.resolve_source(server.url("/files/tiny.gguf")), tmp_path, sha256="0" * 64)
    assert leftovers(tmp_path) == []
    with pytest.raises(pull.BadSource, match="64 hexadecimal"):
        run(pull.resolve_source(server.url("/files/tiny.gguf")), tmp_path, sha256="abc")


def test_an_error_page_served_with_200_is_not_a_model(server: Server, tmp_path: Path) -> None:
    with pytest.raises(pull.NotGguf, match=r"text/html.*DOCTYPE"):
        run(pull.resolve_source(server.url("/html/x.gguf")), tmp_path)
    assert leftovers(tmp_path) == []
    with pytest.raises(pull.PullError, match="HTTP 404"):
        run(pull.resolve_source(server.url("/files/missing.gguf")), tmp_path)
    assert leftovers(tmp_path) == []


def test_the_hugging_face_form_resolves_and_keeps_the_token_on_the_hub(
        server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = server.blobs["tiny.gguf"]
    monkeypatch.setenv("HF_ENDPOINT", server.url(""))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    server.linked_etag["tiny.gguf"] = sha(data)
    source = pull.resolve_source("someone/tiny-GGUF@v1.0:quants/tiny.gguf")
    assert source.url == server.url("/someone/tiny-GGUF/resolve/v1.0/quants/tiny.gguf")
    assert source.hub and source.filename == "tiny.gguf"
    result = run(source, tmp_path)
    hub, cdn = server.requests
    assert (hub["path"], hub["port"], hub["auth"]) == (
        "/someone/tiny-GGUF/resolve/v1.0/quants/tiny.gguf", server.port, "Bearer hf_secret")
    # The CDN is another origin: the token stays home.
    assert (cdn["path"], cdn["port"], cdn["auth"]) == ("/blob/tiny.gguf", server.cdn_port, None)
    assert result.verified == "hub" and result.sha256 == sha(data)
    # The hub's sha256 is checked: a file that does not match it is refused.
    server.linked_etag["tiny.gguf"] = "1" * 64
    with pytest.raises(pull.ChecksumMismatch, match="from the hub"):
        run(pull.resolve_source("someone/tiny-GGUF:tiny.gguf", name="other"), tmp_path)
    assert pull.resolve_source("someone/tiny-GGUF:tiny.gguf").url.endswith(
        "/someone/tiny-GGUF/resolve/main/tiny.gguf")
    # A plain URL elsewhere never gets the token.
    server.requests.clear()
    run(pull.resolve_source(server.url("/files/tiny.gguf", cdn=True), name="plain"), tmp_path)
    assert server.requests[0]["auth"] is None


@pytest.mark.parametrize("spec,name", [
    ("http://h/files/%2e%2e%2fx.gguf", None),
    ("http://h/files/..%2Fx.gguf", None),
    ("http://h/files/a%2Fb.gguf", None),
    ("http://h/files/a%5Cb.gguf", None),
    ("http://h/files/.hidden.gguf", None),
    ("http://h/files/model.bin", None),
    ("http://h/download?file=x.gguf", None),
    ("http://h/files/x.gguf", "../x"),
    ("http://h/files/x.gguf", "sub/x"),
    ("http://h/files/x.gguf", ".x"),
    ("http://h/files/x.gguf", "x\n.gguf"),
    ("owner/repo:../x.gguf", None),
    ("owner/repo:sub/../../x.gguf", None),
    ("owner/repo:sub/readme.md", None),
    ("owner/../repo:x.gguf", None),
    ("ftp://h/x.gguf", None),
    ("file:///etc/x.gguf", None),
    ("just-a-name.gguf", None),
])
def test_hostile_sources_and_names_are_refused(spec: str, name: str | None, tmp_path: Path) -> None:
    with pytest.raises(pull.BadSource):
        pull.resolve_source(spec, name)


def test_names_a_url_gives_and_names_given() -> None:
    assert pull.resolve_source("https://h/a/b/My%20Model-Q4_K_M.gguf?download=1").filename == \
        "My Model-Q4_K_M.gguf"
    assert pull.resolve_source("https://h/download?id=3", name="mine").filename == "mine.gguf"
    assert pull.resolve_source("o/r:x.gguf", name="y.gguf").filename == "y.gguf"


def test_partial_downloads_are_never_discovered(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "whole.gguf", seed=1)
    for folder in (tmp_path, tmp_path / "org" / "repo"):
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in (".big.gguf.part", ".big.gguf.part.json", ".big.gguf.part.json.tmp"):
            (folder / leftover).write_bytes(b"GGUF" + b"\0" * 100)
    assert [m.name for m in discover(tmp_path)] == ["whole"]


# -- corral pull -------------------------------------------------------------------------------

def cli(*args: str, cwd: Path, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "pull", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_corral_pull_end_to_end(server: Server, tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    done = cli(server.url("/files/tiny.gguf"), "--sha256", sha(data), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "models" / "tiny.gguf").read_bytes() == data  # ./models by default
    assert f"sha256 {sha(data)} (matches --sha256)" in done.stdout
    # Not a terminal: plain lines (no carriage returns), the last at 100 %.
    assert "\r" not in done.stderr and "tiny.gguf: 100.0%" in done.stderr.splitlines()[-1]

    # A config's models_dir, relative to the config file; --name.
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "corral.yaml").write_text("models_dir: ../store\n")
    done = cli(server.url("/files/tiny.gguf"), "-c", "conf/corral.yaml", "--name", "renamed",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "store" / "renamed.gguf").read_bytes() == data

    # Failures: exit 1 with one `error:` line, nothing left behind.
    for args, message in [
            ((server.url("/files/tiny.gguf"), "--sha256", "f" * 64, "--name", "bad"),
             "sha256 mismatch"),
            ((server.url("/files/tiny.gguf"),), "exists"),
            ((server.url("/files/%2e%2e%2fescape.gguf"),), "not a plain file name"),
            ((server.url("/html/page.gguf"),), "not a GGUF file")]:
        failed = cli(*args, cwd=tmp_path)
        assert failed.returncode == 1, (args, failed.stderr)
        # Progress lines, if it got that far, then one line that says why.
        lines = failed.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and message in lines[-1], failed.stderr
        assert sum("error" in line for line in lines) == 1, failed.stderr
    assert leftovers(tmp_path / "models") == ["tiny.gguf"]
    assert not (tmp_path / "escape.gguf").exists()

    # The hub form, through HF_ENDPOINT.
    done = cli("owner/repo:tiny.gguf", "--name", "from-hub", cwd=tmp_path,
               env={"HF_ENDPOINT": server.url("")})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "models" / "from-hub.gguf").read_bytes() == data
    assert server.seen("/owner/repo/resolve/main/tiny.gguf")


def test_corral_pull_with_a_config_that_sets_no_models_dir_pulls_beside_it(
        server: Server, tmp_path: Path) -> None:
    """Into the config's default models folder, `models` beside the file: where its daemon
    lists it (tests/test_config_models_dir.py)."""
    data = server.blobs["tiny.gguf"]
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "corral.yaml").write_text("listen: 127.0.0.1:9999\n")
    done = cli(server.url("/files/tiny.gguf"), "-c", "conf/corral.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "conf" / "models" / "tiny.gguf").read_bytes() == data
    assert not (tmp_path / "models").exists()


# -- POST /admin/pull ----------------------------------------------------------------------------

def pull_events(url: str, until: set[str], timeout: float = 20,
                pull_id: str | None = None) -> list[dict[str, Any]]:
    """The `pull` events (of one pull, if given) from the start of history until one reaches
    a state in `until`."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", url + "/admin/events?kinds=pull&since=0", timeout=timeout) as resp:
        for line in sse_lines(resp):
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if pull_id in (None, event["id"]):
                    events.append(event)
                    if event["state"] in until:
                        return events
            assert time.monotonic() < deadline, events
    raise AssertionError(events)


def test_admin_pull_downloads_in_the_background_and_the_model_appears(
        server: Server, start_corral: CorralFactory, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    data = server.blobs["tiny.gguf"]
    models = tmp_path / "models"
    models.mkdir()
    # A leftover of an interrupted pull: never a model.
    (models / ".stale.gguf.part").write_bytes(data[:1000])
    corral = start_corral(tiny_config(tiny_models, models_dir=str(models)))

    def listed() -> set[str]:
        return {m["id"] for m in corral.http.get("/v1/models").json()["data"]}

    assert listed() == {"tiny-a"}

    resp = corral.http.post("/admin/pull", json={"source": server.url("/files/tiny.gguf"),
                                                 "name": "pulled", "sha256": sha(data)})
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert (body["file"], body["state"]) == ("pulled.gguf", "running")
    events = pull_events(corral.url, {"done", "failed"})
    assert events[0]["state"] == "running" and events[-1]["state"] == "done", events
    assert all(e["id"] == body["pull"] and e["file"] == "pulled.gguf" for e in events)
    assert events[-1]["downloaded"] == events[-1]["total"] == len(data)
    [job] = corral.http.get("/admin/pulls").json()["pulls"]
    assert (job["id"], job["state"], job["downloaded"], job["sha256"]) == (
        body["pull"], "done", len(data), sha(data))
    assert (models / "pulled.gguf").read_bytes() == data
    # models_dir is watched: the new file is a model without a reload; it serves.
    wait_until(lambda: "pulled" in listed(), timeout=15)
    assert listed() == {"tiny-a", "pulled"}
    answer = corral.chat("pulled", max_tokens=2)
    assert answer.status_code == 200, answer.text
    assert any(e.get("file") == "pulled.gguf" for e in corral.log_events("pull.done"))

    # Refusals, OpenAI-shaped.
    def refused(payload: Any) -> tuple[int, str | None, str | None]:
        r = corral.http.post("/admin/pull", json=payload)
        return r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]

    url = server.url("/files/tiny.gguf")
    assert refused({}) == (400, "missing_source", "source")
    assert refused({"source": 3}) == (400, "missing_source", "source")
    assert refused({"source": url, "name": "pulled"}) == (409, "model_exists", "name")
    assert refused({"source": url, "name": "../escape"}) == (400, "invalid_request", "name")
    assert refused({"source": server.url("/files/%2e%2e%2fx.gguf")}) == (
        400, "invalid_source", "source")
    assert refused({"source": url, "sha256": "xyz"}) == (400, "invalid_request", "sha256")
    assert refused({"source": url, "force": "yes"}) == (400, "invalid_request", "force")
    assert corral.http.get("/admin/pulls/nope").status_code == 404
    assert not (tmp_path / "escape.gguf").exists() and not (tmp_path / "x.gguf").exists()
    assert listed() == {"tiny-a", "pulled"}  # the stale part never showed


def test_admin_pull_cancels_and_shutdown_keeps_the_part(
        server: Server, start_corral: CorralFactory, tiny_models: dict[str, Path],
        tmp_path: Path) -> None:
    models = tmp_path / "models"
    server.stall["tiny.gguf"] = 30_000
    corral = start_corral(tiny_config(tiny_models, models_dir=str(models)))
    url = server.url("/blob/tiny.gguf")
    first = corral.http.post("/admin/pull", json={"source": url}).json()["pull"]
    part = models / ".tiny.gguf.part"
    wait_until(lambda: corral.http.get(f"/admin/pulls/{first}").json()["downloaded"] == 30_000,
               timeout=10)
    # One pull per file at a time.
    again = corral.http.post("/admin/pull", json={"source": url})
    assert (again.status_code, again.json()["error"]["code"]) == (409, "pull_running")
    # At most MAX_RUNNING at once: a client looping on POST gets 429s, not a download each.
    others = []
    for n in range(pull.jobs.MAX_RUNNING - 1):
        server.blobs[f"other{n}.gguf"] = server.blobs["tiny.gguf"]
        server.stall[f"other{n}.gguf"] = 10_000
        resp = corral.http.post("/admin/pull", json={"source": server.url(f"/blob/other{n}.gguf")})
        assert resp.status_code == 202, resp.text
        others.append(resp.json()["pull"])
    refused = corral.http.post("/admin/pull", json={"source": server.url("/blob/one-more.gguf")})
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "too_many_pulls")
    assert refused.json()["error"]["type"] == "rate_limit_error"
    for other in others:
        assert corral.http.delete(f"/admin/pulls/{other}").status_code == 200
    cancelled = corral.http.delete(f"/admin/pulls/{first}")
    assert (cancelled.status_code, cancelled.json()["state"]) == (200, "cancelled")
    assert pull_events(corral.url, {"cancelled"}, pull_id=first)[-1]["downloaded"] == 30_000
    assert part.stat().st_size == 30_000 and not (models / "tiny.gguf").exists()

    # Resumed by the next pull, which the daemon's shutdown cancels: it stops promptly and
    # keeps the part for later.
    corral.http.post("/admin/pull", json={"source": url})
    wait_until(lambda: server.seen("/blob/tiny.gguf")[-1]["range"] == "bytes=30000-",
               timeout=10)
    corral.proc.send_signal(signal.SIGTERM)
    assert corral.proc.wait(15) == 0
    assert part.stat().st_size >= 30_000 and not (models / "tiny.gguf").exists()
    assert corral.log_events("pull.cancelled")


def test_the_daemon_needs_a_models_dir_to_pull_into() -> None:
    loaded = parse_config("models: {}\n")
    puller = pull.Puller(EventBus(), lambda: loaded)
    with pytest.raises(pull.NoModelsDir, match="models_dir"):
        puller.start("https://h/x.gguf")


def test_the_daemons_puller_reports_progress_live_and_its_end_for_replay(
        server: Server, tmp_path: Path) -> None:
    # Big enough for several progress ticks (one per MiB written); GGUF by its magic only.
    data = b"GGUF" + os.urandom(4 << 20)
    server.blobs["big.gguf"] = data
    server.cut_once["big.gguf"] = 1_500_000
    loaded = parse_config(f"models_dir: {tmp_path / 'models'}\n")

    async def scenario() -> tuple[list[dict[str, Any]], list[dict[str, Any]], pull.PullJob]:
        bus = EventBus()
        puller = pull.Puller(bus, lambda: loaded, event_every=0)
        sub = bus.subscribe()
        job = puller.start(server.url("/blob/big.gguf"), sha256=sha(data))
        await puller.wait(job.id)
        live = [e.as_dict() for e in sub.pending()]
        return live, [e.as_dict() for e in bus.recent()], job

    live, replayed, job = asyncio.run(scenario())
    assert (job.state, job.downloaded, job.total, job.error) == ("done", len(data), len(data),
                                                                  None)
    assert (tmp_path / "models" / "big.gguf").read_bytes() == data
    states = [e["state"] for e in live]
    assert states[0] == "running" and states[-1] == "done" and len(states) >= 4, live
    ticks = [e["downloaded"] for e in live[1:-1]]
    assert ticks == sorted(ticks) and 0 < ticks[0] < len(data)  # resumed past the drop too
    # Resumed where the part ended (at most what came before the drop: aiohttp drops what it
    # still buffered when the line went).
    first, second = server.seen("/blob/big.gguf")
    assert first["range"] is None
    assert 1 << 20 <= int(second["range"].removeprefix("bytes=").rstrip("-")) <= 1_500_000
    # Only the start and the end stay for a reader that reconnects.
    assert [e["state"] for e in replayed] == ["running", "done"]


def test_a_host_that_does_not_resolve_fails_at_once(tmp_path: Path) -> None:
    # Not retried like a dropped connection (5 times, ~30 s): a typo, or no network.
    began = time.monotonic()
    with pytest.raises(pull.PullError, match="cannot resolve"):
        run(pull.resolve_source("http://corral-test.invalid/x.gguf"), tmp_path)
    assert time.monotonic() - began < 5
    assert leftovers(tmp_path) == []
