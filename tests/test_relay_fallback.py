"""The relay without aiohttp's private writer internals (issue 39): an aiohttp that lacks one
(3.10 has no `send_headers`) is detected once, logged once, and every answer still arrives whole
through the public StreamResponse.write. A release without the `on_body_write` hook (3.14.0 to
3.14.3) has no hook to skip: it keeps the fast path."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiohttp import web

from corral.proxy import client_io
from corral.proxy.client_io import internals_missing

from conftest import tiny_config

TOKENS = 64


class _Protocol:
    writing_paused = False


class _Complete:
    """A writer with everything the fast path reads (as aiohttp 3.14.5 has)."""

    def __init__(self) -> None:
        self.protocol = _Protocol()
        self.chunked = True
        self.length: int | None = None
        self.on_body_write = None

    def send_headers(self) -> None:
        pass

    async def write(self, chunk: bytes, *, drain: bool = True) -> None:
        pass


class _No_on_body_write(_Complete):
    """aiohttp 3.14.3's shape."""

    def __init__(self) -> None:
        super().__init__()
        del self.on_body_write


class _NoSendHeaders:
    """aiohttp 3.10's shape: the head goes out at prepare, the protocol has no writing_paused
    property... here only send_headers is missing."""

    def __init__(self) -> None:
        self.protocol = _Protocol()
        self.chunked = True
        self.length = None
        self.on_body_write = None

    async def write(self, chunk: bytes, *, drain: bool = True) -> None:
        pass


class _OldProtocol(_Complete):
    def __init__(self) -> None:
        super().__init__()
        self.protocol = object()  # type: ignore[assignment]


class _NoDrainArgument(_Complete):
    async def write(self, chunk: bytes) -> None:  # type: ignore[override]
        pass


def test_detection_names_the_internal_a_writer_lacks():
    assert internals_missing(_Complete()) is None
    assert internals_missing(_No_on_body_write()) is None  # no hook: nothing skipped
    assert internals_missing(_NoSendHeaders()) == "send_headers"
    assert internals_missing(_OldProtocol()) == "protocol.writing_paused"
    assert internals_missing(_NoDrainArgument()) == "write(drain=)"
    assert internals_missing(object()) == "protocol.writing_paused"


def test_detection_on_this_aiohttp_matches_what_it_has():
    """The probe on a real prepared writer of the installed aiohttp: it names a missing
    internal exactly when the class lacks it (with the newest aiohttp: nothing)."""
    found: list[Any] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        stream = await response.prepare(request)
        found.append(stream)
        found.append(internals_missing(stream))
        await response.write(b"x")
        await response.write_eof()
        return response

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{port}/")).content == b"x"
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    _, missing = found
    # Every aiohttp pyproject allows (>= 3.14: checked on 3.14.0, 3.14.3, 3.14.5) has what the
    # fast path reads: a probe that finds something missing here is the bug (it would turn
    # the write-through off for everyone, silently but for one log line).
    assert missing is None, missing


# -- through a real daemon to a real llama-server child, the detection forced ------------------

FORCED = "send_headers (forced by tests/test_relay_fallback.py)"


def _forcing_env(folder: Path) -> dict[str, str]:
    """A sitecustomize that makes the daemon's probe report an internal missing: the
    detection's result is what is replaced, aiohttp stays as it is."""
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "from corral.proxy import client_io\n"
        f"client_io.internals_missing = lambda stream: {FORCED!r}\n")
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.fixture(scope="module")
def public_corral(start_corral_module, tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fallback")
    config = folder / "corral.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_models)))
    return start_corral_module.serve(config, env=_forcing_env(folder / "site"))


def _events(body: bytes) -> list[bytes]:
    return [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]


def test_streams_arrive_whole_through_the_public_path(public_corral):
    body = {"model": "tiny-a", "stream": True, "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "go"}]}
    for _ in range(3):  # the first response probes; the next ones use what it found
        with public_corral.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            raw = resp.read()
        events = _events(raw)
        assert events[-1] == b"[DONE]", raw[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == TOKENS
        # The stream's last choice event and its usage event came: nothing was cut off.
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finish[-1] == "length", finish[-3:]
    log = public_corral.log_path.read_text()
    lines = [json.loads(line) for line in log.splitlines()
             if '"proxy.relay_public_writes"' in line]
    assert len(lines) == 1 and lines[0]["missing"] == FORCED, lines


def test_whole_answers_arrive_through_the_public_path(public_corral):
    body = {"model": "tiny-a", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "go"}]}
    for _ in range(3):
        resp = public_corral.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        answer = resp.json()
        assert answer["usage"]["completion_tokens"] == TOKENS
        assert int(resp.headers["content-length"]) == len(resp.content)


def test_the_probe_runs_once_per_process(monkeypatch):
    calls: list[object] = []

    def probe(stream: object) -> str | None:
        calls.append(stream)
        return "send_headers"

    monkeypatch.setattr(client_io, "internals_missing", probe)
    monkeypatch.setattr(client_io._Internals, "probed", False)
    monkeypatch.setattr(client_io._Internals, "missing", None)
    writer = object()
    assert client_io._Internals.usable(writer) is False  # type: ignore[arg-type]
    assert client_io._Internals.usable(writer) is False  # type: ignore[arg-type]
    assert len(calls) == 1


class _Transport:
    def is_closing(self) -> bool:
        return False

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 * 1024, 64 * 1024

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        pass


class _Request:
    transport = _Transport()


class _Response:
    compression = False


def _through(stream: object) -> object:
    out = client_io.ClientWriter(_Request(), _Response(), "m", 5.0,  # type: ignore[arg-type]
                                 lambda model: None)
    out._stream = stream  # type: ignore[assignment]
    return out.through()


def test_the_write_through_skips_no_hook_a_writer_has():
    """through() puts chunks past aiohttp's write(): only where no per-write hook would be
    skipped. A release without the hook attribute (3.14.0 to 3.14.3) has none to skip."""
    assert callable(_through(_Complete()))
    assert callable(_through(_No_on_body_write()))
    hooked = _Complete()
    hooked.on_body_write = lambda *a: None  # type: ignore[assignment]
    assert _through(hooked) is None
    traced = _Complete()
    traced._on_chunk_sent = lambda chunk: None  # type: ignore[attr-defined]
    assert _through(traced) is None
