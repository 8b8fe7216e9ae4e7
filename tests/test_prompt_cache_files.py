"""The prompt cache's files on disk: every file counted from its first byte (a save written
under a temporary name and reserved in the budget when it is asked for, indexed or deleted
whatever happens), the budget and free disk checked before every save (a setup's first
included), two daemons sharing one state dir without deleting each other's saves, and the
state dir on disk by default.

Real llama-server children (SmolLM2) where a save must happen; a fake child answering /slots
save where its behaviour is not the point."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_prompt_cache import _FACTS, _chat, _cold, _conversation, _next_turn, _restored

from corral.supervisor import cli
from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.events import EventBus
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.prompt_cache.choice import CHAT, Record
from corral.supervisor.prompt_cache.files import TEMP_SUFFIX, kv_per_token
from corral.supervisor.prompt_cache.saver import Saver
from corral.supervisor.prompt_cache.store import INDEX, PENDING, SUFFIX, Entry, Store, fingerprint
from corral.supervisor.statefile import default_state_dir, filesystem_of

from conftest import Corral, CorralFactory, wait_until

MiB = 1 << 20


def _spec(model: Path = Path("m.gguf")) -> ModelSpec:
    return ModelSpec(name="m", backend="llama-server", model_path=model, aliases=(), ttl=0,
                     ctx=2048, parallel=1, n_gpu_layers=0, threads=1, cache_type_k=None,
                     cache_type_v=None, args=(), env={}, binary=None, start_timeout=10,
                     max_queue=1, queue_timeout=1, stop_grace=1, prompt_cache=True)


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kwargs: Any) -> None:
        self.lines.append((event, kwargs))

    warning = info


class _Child:
    """What the saver asks of a child's slots. Its save writes `n_tokens * per_token + 100`
    bytes to the file it is given; `hang` makes it write half of them and answer only once
    `answer` is set (then with `outcome`: an answer, or an exception such as a child that
    went)."""

    def __init__(self, cache: PromptCache, spec: ModelSpec | None = None):
        self.cache = cache
        self.model = self.instance = "m"
        self.spec = spec or _spec()
        self.records: list[Record | None] = [None]
        self.unsure: set[int] = set()
        self.n_tokens = 500
        self.per_token = 1000  # what this child's files take a token
        self.hang = False
        self.answer = asyncio.Event()
        self.outcome: BaseException | None = None
        self.writing = asyncio.Event()
        self.posts: list[str] = []
        self.during_write: list[int] = []  # the budget's use seen while the file is written

    def leased(self, slot: int) -> bool:
        return False

    async def key(self) -> str:
        return f"k{self.per_token}"  # another size a token: another model

    async def listing(self) -> Any:
        return [{"id": 0, "n_prompt_tokens": self.n_tokens}]

    async def tokens(self, record: Record) -> list[int]:
        return list(range(self.n_tokens))

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        self.posts.append(payload["filename"])
        target = self.cache.store.dir / payload["filename"]
        size = self.n_tokens * self.per_token + 100
        if self.hang:
            target.write_bytes(b"\0" * (size // 2))
            self.writing.set()
            await self.answer.wait()
            if self.outcome is not None:
                raise self.outcome
        target.write_bytes(b"\1" * size)
        self.during_write.append(_used(self.cache.store) - _over(self.cache.store))
        return 200, {"n_saved": self.n_tokens}


def _used(store: Store) -> int:
    """What the cache takes: its files on disk (finished or not) and the part of each
    reservation not written yet."""
    on_disk = _on_disk(store)
    reserved = sum(max(0, int(p["bytes"]) - on_disk.get(name, 0))
                   for name, p in store.pending.items())
    return sum(on_disk.values()) + reserved


def _over(store: Store) -> int:
    """What saves in flight wrote past their reservations (a child that writes more than
    the estimate, or a save of unknown size, reserved as nothing)."""
    on_disk = _on_disk(store)
    return sum(max(0, on_disk.get(name, 0) - int(p["bytes"]))
               for name, p in store.pending.items())


def _on_disk(store: Store) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in store.dir.iterdir()
            if p.name.endswith((SUFFIX, TEMP_SUFFIX))}


def _cache(folder: Path, **settings: Any) -> PromptCache:
    config = PromptCacheConfig(**{"min_tokens": 64, **settings})
    return PromptCache(folder, lambda: config, EventBus())


def _saver(child: _Child, per_token: float | None = None) -> Saver:
    saver = Saver(child, child.cache, lambda: False, _Log())  # type: ignore[arg-type]
    if per_token is not None:  # what the GGUF would say
        saver._per_token, saver._per_token_read = per_token, True
    return saver


def _record(text: str = _FACTS) -> Record:
    return Record(CHAT, {"messages": [{"role": "user", "content": text}]})


# -- a save cut short ------------------------------------------------------------------------------


def test_a_save_cut_short_by_save_timeout_is_counted_until_the_child_is_done(tmp_path):
    asyncio.run(_cut_short(tmp_path))


async def _cut_short(tmp_path: Path) -> None:
    cache = _cache(tmp_path, save_timeout=0.2, max_mb=4)
    events: list[tuple[str, dict[str, Any]]] = []
    cache.events.listen(lambda e: events.append((e.kind, e.data)))
    store = cache.store
    child = _Child(cache)
    child.hang = True
    child.records[0] = _record()
    saver = _saver(child, per_token=1000)
    await saver.at_stop()  # gives up after save_timeout; the child still writes
    (part,) = child.posts
    assert part.endswith(TEMP_SUFFIX)
    assert (tmp_path / part).exists() and not store.entries
    # Counted: its whole expected size is reserved, in memory and in the index on disk.
    reserved = store.pending[part]["bytes"]
    assert reserved >= 500 * 1000 + 100
    on_disk = json.loads((tmp_path / PENDING).read_text())
    assert [p["file"] for p in on_disk["pending"]] == [part]
    assert _used(store) == reserved <= 4 * MiB

    # The child answers at last (a stopped child's connection reset, here): the file goes
    # with its reservation.
    child.outcome = aiohttp.ServerDisconnectedError()
    child.answer.set()
    await _until(lambda: not (tmp_path / part).exists())
    assert store.pending == {} and _used(store) == 0
    assert json.loads((tmp_path / PENDING).read_text())["pending"] == []

    # One that answered 200 after corral gave up is deleted too: never indexed, never lost.
    child.answer.clear()
    child.outcome = None
    child.records[0] = _record(_FACTS + "?")
    await _saver(child, per_token=1000).at_stop()
    part = child.posts[-1]
    child.answer.set()
    await _until(lambda: not (tmp_path / part).exists())
    assert store.pending == {} and not store.entries and not list(tmp_path.glob("*" + SUFFIX))


def test_a_save_cut_short_over_http_is_deleted_once_the_child_goes(tmp_path):
    """The same over a real HTTP connection (aiohttp both sides, as Slots.post does): the child
    writes part of the file and hangs; corral gives up at save_timeout; the child then goes
    (its server closes the connection), and only then is the file deleted."""
    asyncio.run(_cut_short_http(tmp_path))


async def _cut_short_http(tmp_path: Path) -> None:
    from aiohttp import web

    cache = _cache(tmp_path, save_timeout=0.3, max_mb=4)
    hang = asyncio.Event()
    wrote: list[Path] = []

    async def save(request: web.Request) -> web.Response:
        target = tmp_path / (await request.json())["filename"]
        target.write_bytes(b"\0" * 250_000)  # half written, then stuck (a SIGSTOPped child)
        wrote.append(target)
        await hang.wait()
        return web.json_response({"n_saved": 500})

    app = web.Application()
    app.router.add_post("/slots/{slot}", save)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:
        child = _Child(cache)

        async def post(path: str, payload: dict[str, Any]) -> tuple[int, Any]:
            async with session.post(f"http://127.0.0.1:{port}{path}", json=payload) as resp:
                return resp.status, await resp.json(content_type=None)

        child.post = post  # type: ignore[method-assign]
        child.records[0] = _record()
        saver = _saver(child, per_token=1000)
        log = saver._log
        await saver.at_stop()
        assert "prompt_cache.save_cut_short" in [line[0] for line in log.lines]
        (part,) = wrote
        # Still being written: kept, and counted whole.
        assert part.exists() and part.name in cache.store.pending
        assert _used(cache.store) >= 500 * 1000
        await runner.cleanup()  # the child goes: its connection closes
        await _until(lambda: not part.exists())
        assert not cache.store.pending and not cache.store.entries
        assert "prompt_cache.partial_deleted" in [line[0] for line in log.lines]


def test_a_restart_deletes_the_temporary_files_of_a_daemon_that_died(tmp_path):
    store = Store(tmp_path, lambda: 4 * MiB)
    # A daemon killed mid-save: its temporary file, listed pending under its (dead) owner;
    # another left unlisted (the index write never happened).
    (tmp_path / f"dead{TEMP_SUFFIX}").write_bytes(b"x" * 1000)
    (tmp_path / f"unlisted{TEMP_SUFFIX}").write_bytes(b"x" * 1000)
    store.pending[f"dead{TEMP_SUFFIX}"] = {"file": f"dead{TEMP_SUFFIX}", "bytes": 1000,
                                           "owner": "1:12.0", "since": 0.0}
    store._write_pending()
    # A live daemon's save in flight (this process stands for it) is left alone.
    assert store.reserve(f"live{TEMP_SUFFIX}", 1000) is None
    (tmp_path / f"live{TEMP_SUFFIX}").write_bytes(b"x" * 500)

    again = Store(tmp_path, lambda: 4 * MiB)
    assert sorted(p.name for p in tmp_path.glob("*" + TEMP_SUFFIX)) == [f"live{TEMP_SUFFIX}"]
    assert list(again.pending) == [f"live{TEMP_SUFFIX}"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- the budget ------------------------------------------------------------------------------------


_SWAP = st.tuples(st.integers(64, 900), st.integers(200, 3000),
                  st.sampled_from(["save", "save", "save", "fail", "hang"]),
                  # What the GGUF's figure for a setup's first save is, to what the child
                  # writes: right, half (the child writes twice the reservation), unknown.
                  st.sampled_from([1.0, 1.0, 1.0, 0.5, None]))


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_SWAP, min_size=100, max_size=100))
# Two saves of unknown size hung mid-write (reserved as nothing, half written), then one of
# unknown size larger than the whole budget (~2.8 MiB), one twice its reservation, then
# ordinary saves.
@example([(900, 1000, "hang", None)] * 2 + [(900, 3300, "save", None)]
         + [(900, 1500, "save", 0.5)] + [(500, 1000, "save", 1.0)] * 96)
def test_a_cache_at_max_mb_never_exceeds_it_across_100_swaps(tmp_path_factory, swaps):
    """Each swap saves a conversation of random length (and bytes per token: another model),
    some saves fail or hang past save_timeout, and a setup's first save may write more than
    its GGUF said (or the GGUF told nothing: reserved as 0 bytes).

    The bound: the files indexed and the reservations of saves in flight fit max_mb at every
    moment; what is on disk fits max_mb once no save is in flight, and while saves are in
    flight exceeds it by at most what they wrote past their reservations (corral cannot stop
    llama-server's write; an oversized file is counted, and the least recently used files
    deleted, the moment it is indexed: one larger than the whole budget is deleted itself)."""
    asyncio.run(_swaps(tmp_path_factory.mktemp("swaps"), swaps))


async def _swaps(folder: Path, swaps: list[tuple[int, int, str, float | None]]) -> None:
    budget = 2 * MiB
    cache = _cache(folder, max_mb=2, save_timeout=0.05)
    store = cache.store
    hung: list[_Child] = []
    for i, (tokens, per_token, outcome, accuracy) in enumerate(swaps):
        child = _Child(cache)
        child.n_tokens, child.per_token = tokens, per_token
        child.records[0] = _record(f"{i} {_FACTS}")
        child.hang = outcome == "hang"
        # The first save of a setup is sized from the GGUF (its KV per token and the token
        # id: test_the_first_save... checks that figure), later ones from its files.
        saver = _saver(child, per_token=per_token * accuracy + 4 if accuracy else None)
        saver._per_token_read = True
        if outcome == "fail":
            child.outcome = RuntimeError("no space left")
            child.hang = True
            child.answer.set()
        await saver.at_stop()
        assert _used(store) - _over(store) <= budget, (i, store.status())
        assert _used(store) <= budget or store.pending, (i, store.status())
        if child.hang and not child.answer.is_set():
            hung.append(child)
        if len(hung) > 2 or i == len(swaps) - 1:  # the child answers, or goes
            for old in hung:
                old.outcome = aiohttp.ServerDisconnectedError()
                old.answer.set()
            hung.clear()
            await _until(lambda: not store.pending)
        assert _used(store) - _over(store) <= budget, (i, store.status())
        assert _used(store) <= budget or store.pending, (i, store.status())
        assert all(seen <= budget for seen in child.during_write)
    assert not list(folder.glob("*" + TEMP_SUFFIX))
    # What the index says is what is on disk.
    assert sorted(store.entries) == sorted(p.name for p in folder.glob("*" + SUFFIX))


def test_the_first_save_of_a_setup_larger_than_the_budget_is_not_written(tmp_path, smol_model):
    asyncio.run(_first_save(tmp_path, smol_model))


async def _first_save(tmp_path: Path, smol: Path) -> None:
    # SmolLM2-135M at f16: 30 layers x 3 KV heads x 64 x 2 (K and V) x 2 bytes a token.
    per_token = kv_per_token(_spec(smol))
    assert per_token == 30 * 3 * 64 * 2 * 2 + 4
    cache = _cache(tmp_path, max_mb=5)
    events: list[tuple[str, dict[str, Any]]] = []
    cache.events.listen(lambda e: events.append((e.kind, e.data)))
    child = _Child(cache, _spec(smol))
    child.n_tokens = 500  # ~11 MiB: over the whole budget, and no file of the setup yet
    child.records[0] = _record()
    saver = Saver(child, cache, lambda: False, log := _Log())  # type: ignore[arg-type]
    await saver.at_stop()
    assert child.posts == [] and not list(tmp_path.glob("*" + SUFFIX))
    ((kind, data),) = events
    assert kind == "prompt_cache_save_skipped" and "over the whole budget" in data["reason"]
    assert ("prompt_cache.save_skipped" in [line[0] for line in log.lines])

    # One that fits is written, older files making room for it (least recently used first).
    child.n_tokens = 150  # ~3.3 MiB
    child.per_token = 23_000
    child.records[0] = _record(_FACTS + "!")
    await Saver(child, cache, lambda: False, _Log()).at_stop()  # type: ignore[arg-type]
    assert len(cache.store.entries) == 1
    child.records[0] = _record("another " + _FACTS)
    await Saver(child, cache, lambda: False, _Log()).at_stop()  # type: ignore[arg-type]
    assert len(cache.store.entries) == 1 and _used(cache.store) <= 5 * MiB
    assert all(seen <= 5 * MiB for seen in child.during_write)


async def _until(predicate: Any, timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def test_a_daemon_skips_a_first_save_over_its_budget_before_the_child_writes(start_corral,
                                                                             smol_model):
    """The same on a daemon: a conversation of ~400 tokens of SmolLM2 is ~9 MiB, over a
    budget of 4 MiB, and no file of the setup exists yet: nothing is written."""
    config = _config(smol_model)
    config["prompt_cache"]["max_mb"] = 4
    corral = start_corral(config)
    answer, _ = _chat(corral, "smol", _conversation("the valley"))
    assert _cold(answer)
    (skipped,) = wait_until(lambda: corral.log_events("prompt_cache.save_skipped"), timeout=30)
    assert "over the whole budget" in skipped["reason"]
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    assert not list(folder.glob("*" + SUFFIX)) and not list(folder.glob("*" + TEMP_SUFFIX))
    status = corral.http.get("/admin/prompt-cache").json()
    assert status["files"] == 0 and status["pending_bytes"] == 0
    assert not corral.log_events("prompt_cache.saved")


# -- two daemons on one state dir ------------------------------------------------------------------


def _config(smol: Path) -> dict[str, Any]:
    # restore_timeout: two children prefilling on a busy 2-core box take their time.
    return {"defaults": {"ttl": 300, "stop_grace": 5},
            "prompt_cache": {"min_tokens": 64, "idle_save_after": 0.2, "restore_timeout": 60},
            "models": {"smol": {"model": str(smol), "ctx": 2048, "threads": 1}}}


def _stop(corral: Corral) -> None:
    corral.proc.send_signal(signal.SIGTERM)
    corral.proc.wait(30)


def test_two_daemons_on_one_state_dir_keep_each_others_saves_across_restarts(start_corral,
                                                                           smol_model):
    config = _config(smol_model)
    # Two configs, two ports, one state dir (the factory gives every daemon the same one).
    head, other = start_corral(config), start_corral(config)
    valley, mill = _conversation("the valley"), _conversation("the mill")
    first_valley, _ = _chat(head, "smol", valley)
    first_mill, _ = _chat(other, "smol", mill)
    assert _cold(first_valley) and _cold(first_mill)
    wait_until(lambda: head.log_events("prompt_cache.saved"), timeout=30)
    wait_until(lambda: other.log_events("prompt_cache.saved"), timeout=30)
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    index = json.loads((folder / INDEX).read_text())
    assert len(index["entries"]) == 2
    assert json.loads((folder / PENDING).read_text())["pending"] == []
    # llama-server's own files too (it writes them under corral's umask): made 0600 as indexed.
    assert _mode(folder) == 0o700
    assert {p.name: _mode(p) for p in folder.iterdir()} \
        == {p.name: 0o600 for p in folder.iterdir()}

    # Both stop (each saves nothing more: its idle save was all), then both start again,
    # in the other order.
    _stop(head)
    _stop(other)
    other, head = start_corral(config), start_corral(config)
    assert len(list(folder.glob("*" + SUFFIX))) == 2
    for corral, messages, first in ((head, valley, first_valley), (other, mill, first_mill)):
        messages = _next_turn(messages, first, "And another?")
        answer, headers = _chat(corral, "smol", messages)
        assert _restored(answer, headers), (answer["timings"], headers.get("Server-Timing"))
    for corral in (head, other):
        assert not corral.log_events("prompt_cache.orphan_deleted")
        assert not corral.log_events("prompt_cache.partial_deleted")
        # Only its own conversation's shorter file, replaced by the longer turn's save.
        assert all(e["reason"].startswith("superseded")
                   for e in corral.log_events("prompt_cache.dropped"))
    # Either daemon sees the other's saves (the same setup: the same model file and flags).
    assert len(head.http.get("/admin/prompt-cache").json()["entries"]) >= 2


# -- the state dir ---------------------------------------------------------------------------------


def test_the_default_state_dir_is_on_disk_not_the_runtime_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert default_state_dir() == Path.home() / ".local" / "state" / "corral"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_state_dir() == tmp_path / "state" / "corral"


def _args(state_dir: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(state_dir=state_dir)


class _Loaded:
    state_dir: Path | None = None
    prompt_cache_dir: Path | None = None


def test_a_tmpfs_state_dir_not_asked_for_is_named_in_a_warning(monkeypatch, tmp_path):
    # Never skipped: every Linux this runs on (CI's included) mounts a tmpfs at /dev/shm.
    found = filesystem_of(Path("/dev/shm"))
    assert found is not None and found[1] == "tmpfs", f"/dev/shm is not a tmpfs here: {found}"
    shm = Path("/dev/shm") / f"corral-test-{os.getpid()}-{random.randrange(1 << 30)}"
    try:
        _tmpfs_warning(monkeypatch, tmp_path, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)  # the state dir is made (0700) as it is named


def _tmpfs_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shm: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(shm))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert filesystem_of(shm / "corral") == ("/dev/shm", "tmpfs")
    with structlog.testing.capture_logs() as logs:
        assert cli._state_dir(_args(), _Loaded()) == shm / "corral"  # type: ignore[arg-type]
    (warning,) = [e for e in logs if e["event"] == "corral.state_dir_in_memory"]
    assert warning["dir"] == str(shm / "corral") and warning["filesystem"] == "tmpfs"
    assert warning["log_level"] == "warning"

    # Asked for (--state-dir, or state_dir in the config): the user's choice, no warning.
    with structlog.testing.capture_logs() as logs:
        assert cli._state_dir(_args(shm), _Loaded()) == shm  # type: ignore[arg-type]
    assert not [e for e in logs if e["event"] == "corral.state_dir_in_memory"]
    # On disk: none either.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    with structlog.testing.capture_logs() as logs:
        cli._state_dir(_args(), _Loaded())  # type: ignore[arg-type]
    assert not [e for e in logs if e["event"] == "corral.state_dir_in_memory"]


def test_a_cache_in_the_old_default_place_is_moved_not_lost(monkeypatch, tmp_path):
    old = tmp_path / "run" / "corral" / "prompt-cache"
    store = Store(old, lambda: 4 * MiB)
    (old / f"a{SUFFIX}").write_bytes(b"kv" * 1000)
    size, digest = fingerprint(old / f"a{SUFFIX}")
    store.add(Entry(file=f"a{SUFFIX}", key="k", model="m", tokens=[1, 2, 3], n_tokens=3,
                    bytes=size, fingerprint=digest, saved_at=0.0, last_used=0.0))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    # prompt_cache.dir set: the cache is read from there, never from the state dir, so the
    # old one stays where it is (moved, nothing would read, count or delete it).
    elsewhere = _Loaded()
    elsewhere.prompt_cache_dir = tmp_path / "elsewhere"
    with structlog.testing.capture_logs() as logs:
        state_dir = cli._state_dir(_args(), elsewhere)  # type: ignore[arg-type]
    assert not [e for e in logs if "moved" in e["event"] or "moving" in e["event"]]
    assert (old / INDEX).exists() and not (state_dir / "prompt-cache").exists()

    with structlog.testing.capture_logs() as logs:
        state_dir = cli._state_dir(_args(), _Loaded())  # type: ignore[arg-type]
    # Said before it starts (a copy from a tmpfs to disk takes a while), and once.
    assert [e["event"] for e in logs if "prompt_cache_mov" in e["event"]] \
        == ["statefile.prompt_cache_moving", "corral.prompt_cache_moved"]
    moved = Store(state_dir / "prompt-cache", lambda: 4 * MiB)
    assert list(moved.entries) == [f"a{SUFFIX}"] and not (old / INDEX).exists()


_unused = CorralFactory  # the fixtures' type, named for readers of the signatures above


def test_a_request_waits_while_the_child_writes_a_file_and_not_before(tmp_path):
    asyncio.run(_waits_while_writing(tmp_path))


async def _waits_while_writing(tmp_path: Path) -> None:
    """Slots.pin waits on what request_came returns: something while the child writes a
    file (a request sent then could reach the slot before the save does), nothing before
    the save's request goes (the save is cancelled then) nor after the file is written."""
    cache = _cache(tmp_path, max_mb=64)
    child = _Child(cache)
    child.hang = True
    child.records[0] = _record()
    saver = _saver(child, per_token=1000)
    assert saver.request_came() is None
    stopping = asyncio.create_task(saver.at_stop())
    await asyncio.wait_for(child.writing.wait(), 5)
    writing = saver.request_came()
    assert writing is not None and not writing.done()
    child.answer.set()
    await asyncio.wait_for(stopping, 5)
    assert writing.done() and saver.request_came() is None and len(cache.store.entries) == 1
