"""A prompt cache you can trust: a file is indexed only under tokens it holds, and only what
reached the disk whole. A save the disk cut short at its end is never indexed (a truncated
file restored makes llama-server abort); a slot whose last request the child refused (400),
or whose prompt was cut short, is not saved under that request's tokens; what changes a KV
cache's meaning through the child's environment is in the setup key.

Real llama-server children (SmolLM2), one behind a wrapper that gives it a file-size limit:
the disk is "full" at a byte count the test picks, with no root and no tmpfs. A fake child
(test_prompt_cache_files) where its behaviour is not the point."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_prompt_cache import _cold, _conversation, _files, _next_turn, _restored
from test_prompt_cache_files import _cache, _Child, _record, _saver, _spec

from corral.proxy.child_http import ChildHttpError
from corral.proxy.errors import UpstreamFailed
from corral.proxy.forward import open_child
from corral.supervisor.port import Lease
from corral.supervisor.prompt_cache.choice import Record
from corral.supervisor.prompt_cache.store import SUFFIX

from conftest import Corral, CorralFactory, llama_server_binary, wait_until


def _limited_binary(folder: Path) -> tuple[Path, Path]:
    """A llama-server that runs with RLIMIT_FSIZE (bytes) read from a file at each start and
    SIGXFSZ ignored: a write past the limit fails with EFBIG as on a full disk, instead of
    killing the child (an ignored signal stays ignored across exec)."""
    limit = folder / "limit"
    wrapper = folder / "llama-server"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, resource, signal, sys\n"
        f"limit = {str(limit)!r}\n"
        "if os.path.exists(limit):\n"
        "    n = int(open(limit).read())\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"os.execv({llama_server_binary()!r}, [{llama_server_binary()!r}, *sys.argv[1:]])\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, limit


def _turn(corral: Corral, messages: list[dict[str, str]]) -> Any:
    # ignore_eos: the slot holds the same number of tokens at every save, so the same bytes.
    return corral.http.post("/v1/chat/completions", json={
        "model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def test_a_save_cut_short_by_a_full_disk_is_never_indexed(start_corral: CorralFactory,
                                                          smol_model: Path) -> None:
    wrapper, limit = _limited_binary(Path(start_corral.folder))
    corral = start_corral({
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
        "models": {"smol": {"model": str(smol_model), "ctx": 2048, "threads": 1,
                            "binary": str(wrapper)}}})
    messages = _conversation("the forge")

    def unload_and_wait(saves: int) -> None:
        corral.http.post("/admin/models/smol/unload").raise_for_status()
        wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
        wait_until(lambda: len(corral.log_events("prompt_cache.saved")) == saves)

    assert _turn(corral, messages).status_code == 200
    unload_and_wait(1)
    (good,) = _files(corral)

    # The disk fills a few hundred bytes before the end of the next save of the same slot:
    # llama-server's last buffered write fails at its close, unchecked, and it answers 200
    # with the bytes it meant to write (`n_written`), the file on disk shorter.
    limit.write_text(str(good["bytes"] - 100))
    resp = _turn(corral, messages)
    assert resp.status_code == 200, resp.text
    assert _restored(resp.json(), resp.headers)
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    skipped = wait_until(lambda: [e for e in corral.log_events("prompt_cache.save_skipped")
                                  if "disk" in e.get("error", "")])
    assert str(good["bytes"]) in skipped[0]["error"]
    # The truncated file neither superseded the whole one nor stayed on disk.
    assert [f["file"] for f in _files(corral)] == [good["file"]]
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    assert not list(folder.glob("*.part"))

    # The next turn is restored from the whole file, by a child that lives.
    resp = _turn(corral, messages)
    assert resp.status_code == 200, resp.text
    assert _restored(resp.json(), resp.headers)
    assert corral.model("smol")["state"] == "ready"


def test_a_reload_that_changes_llama_servers_flags_in_env_gets_a_new_key(
        start_corral: CorralFactory, smol_model: Path) -> None:
    """LLAMA_ARG_ROPE_FREQ_BASE is --rope-freq-base given through the environment: the KV of
    a child started with another RoPE base is rotated under the old one, and restored into
    the new child it would be reused as if valid."""
    config: dict[str, Any] = {
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
        "models": {"smol": {"model": str(smol_model), "ctx": 2048, "threads": 1}}}
    corral = start_corral(config)
    messages = _conversation("the chapel")
    first = _turn(corral, messages)
    assert first.status_code == 200 and _cold(first.json())

    config["models"]["smol"]["env"] = {"LLAMA_ARG_ROPE_FREQ_BASE": "50000"}
    corral.config_path.write_text(yaml.safe_dump(config))
    assert corral.http.post("/admin/reload").status_code == 200
    wait_until(lambda: corral.log_events("prompt_cache.saved"), timeout=30)

    again = _turn(corral, _next_turn(messages, first.json(), "And another?"))
    assert again.status_code == 200, again.text
    assert _cold(again.json()), again.json()["timings"]
    assert "prompt-cache" not in again.headers.get("Server-Timing", "")
    assert not corral.log_events("prompt_cache.restored")


_SCRIBE = [{"role": "system", "content": "You are a scribe. " + " ".join(
    f"Line {i}: the scribe copies page {i} of the ledger by candlelight." for i in range(12))},
    {"role": "user", "content": "Which page comes first?"}]


def test_a_request_the_child_refused_is_never_saved_as_its_slot(start_corral: CorralFactory,
                                                                smol_model: Path) -> None:
    """A request llama-server answers 400 (a field of the wrong type) never touches its slot, which
    still holds the conversation before it: saved under the refused request's tokens, the
    file would claim a prefix it does not hold, its restore would go unused, and that would
    turn every restore of the setup off."""
    corral = start_corral({
        "defaults": {"ttl": 300, "stop_grace": 5},
        "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
        "models": {"smol": {"model": str(smol_model), "ctx": 2048, "threads": 1}}})
    assert _turn(corral, _conversation("the bridge")).status_code == 200
    refused = corral.http.post("/v1/chat/completions", json={
        "model": "smol", "messages": _SCRIBE, "max_tokens": 8, "n_probs": "many"})
    assert refused.status_code == 400, refused.text
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    # A file holds the prompt it is indexed under and that prompt's answer (8 tokens), not
    # another conversation's KV.
    assert all(0 <= f["tokens"] - f["prompt_tokens"] <= 8 for f in _files(corral)), \
        _files(corral)

    answer = _turn(corral, _SCRIBE)
    assert answer.status_code == 200, answer.text
    status = corral.http.get("/admin/prompt-cache").json()
    assert status["unused_restores"] == 0 and status["restores_off"] == 0, status
    assert not corral.log_events("prompt_cache.restore_unused")


class _CutShort(_Child):
    """A child whose slot holds fewer tokens than its last request's prompt: the prefill was
    cut short (the client hung up mid-way), or the context shifted."""

    async def tokens(self, record: Record) -> list[int]:
        return list(range(self.n_tokens * 2))


def test_a_slot_holding_less_than_its_last_prompt_is_not_saved_as_it(tmp_path: Path) -> None:
    async def run() -> None:
        cache = _cache(tmp_path, max_mb=64)
        child = _CutShort(cache)
        child.records[0] = _record()
        saver = _saver(child, per_token=1000)
        await saver.at_stop()
        assert child.posts == []  # nothing written: the file would not hold those tokens
        assert not cache.store.entries and not cache.store.pending
        assert not list(tmp_path.glob("*" + SUFFIX)) and not list(tmp_path.glob("*.part"))
        await saver.at_stop()  # and not asked again while the slot serves nothing new
        assert child.posts == []

    asyncio.run(run())


_FULL_DISK = """
import json, resource, sys
from pathlib import Path
from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.events import EventBus
from corral.supervisor.prompt_cache import PromptCache

folder = Path(sys.argv[1])
# Every write past 64 bytes fails (EFBIG: Python ignores SIGXFSZ), as on a full disk.
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
cache = PromptCache(folder, lambda: PromptCacheConfig(max_mb=64), EventBus())
store = cache.store
room = store.reserve("next.part", 1 << 20)
print(json.dumps({"entries": sorted(store.entries), "room": room,
                  "pending": store.pending_bytes()}))
"""


def test_a_full_disk_neither_stops_a_start_nor_holds_the_budget(tmp_path: Path) -> None:
    """A start whose index write fails (the cache's disk full of other files) goes on with
    the files it checked; a save whose reservation cannot be written is skipped, its bytes
    not left counted (each failed save would have held its size of the budget until a
    restart)."""
    async def fill() -> None:
        cache = _cache(tmp_path, max_mb=64)
        child = _Child(cache)
        child.records[0] = _record()
        await _saver(child, per_token=1000).at_stop()
        assert len(cache.store.entries) == 1

    asyncio.run(fill())
    (tmp_path / "stray.slot").write_bytes(b"x")  # a start deletes it: the index must change
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert len(seen["entries"]) == 1 and seen["pending"] == 0
    assert "could not be written" in seen["room"]
    assert "prompt_cache.index_not_written" in done.stderr + done.stdout


def test_an_adapter_replaced_under_its_name_gets_a_new_key(tmp_path: Path,
                                                           smol_model: Path) -> None:
    """A LoRA adapter or control vector changes the KV as the weights do: a retrained one
    renamed into place under the same name (args unchanged) is another setup, and one
    replaced under a running child turns its restores off (Setup.replaced)."""
    async def run() -> None:
        cache = _cache(tmp_path / "cache")
        binary = llama_server_binary()
        lora, vector = tmp_path / "style.gguf", tmp_path / "calm.gguf"
        for path in (lora, vector):
            path.write_bytes(b"GGUF adapter v1")
        args = ("--lora", f"{lora}", "--control-vector-scaled", f"{vector}:0.8")
        spec = dataclasses.replace(_spec(smol_model), args=args)
        first = await cache.setup(spec, binary)
        assert {f.path for f in first.files} >= {str(lora), str(vector)}
        assert (await cache.setup(spec, binary)).key == first.key
        for path in (lora, vector):
            new = path.with_suffix(".new")
            new.write_bytes(b"GGUF adapter v2")
            os.utime(new, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
            os.replace(new, path)  # a new inode, even with the old size and mtime
            assert first.replaced() is not None
            again = await cache.setup(spec, binary)
            assert again.key != first.key, path
            first = again

    asyncio.run(run())


class _ChangedUnderTheSave(_Child):
    """A child whose slot was erased (or taken by another request) before its save ran: the
    file holds fewer tokens than the request the slot was last pinned to."""

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        status, _ = await super().post(path, payload)
        return status, {"n_saved": 0}


def test_a_save_that_holds_fewer_tokens_than_its_request_is_not_indexed(tmp_path: Path) -> None:
    async def run() -> None:
        cache = _cache(tmp_path, max_mb=64)
        child = _ChangedUnderTheSave(cache)
        child.records[0] = _record()
        await _saver(child, per_token=1000).at_stop()
        assert len(child.posts) == 1 and not cache.store.entries and not cache.store.pending
        assert not list(tmp_path.glob("*" + SUFFIX)) and not list(tmp_path.glob("*.part"))

    asyncio.run(run())


def test_a_save_of_unknown_size_over_the_budget_pushes_no_other_file_out(tmp_path: Path) -> None:
    """With no KV size known (the GGUF not read, no earlier file of the setup) a save is
    reserved as nothing; one larger than the whole budget pushed out every other file of
    every model, then itself, and was logged as saved."""
    async def run() -> None:
        cache = _cache(tmp_path, max_mb=1)
        small = _Child(cache)
        small.per_token = 100  # 50 KB: another model's
        small.records[0] = _record()
        await _saver(small, per_token=100).at_stop()
        kept = set(cache.store.entries)
        assert len(kept) == 1
        big = _Child(cache)
        big.per_token = 4000  # 2 MB, over the 1 MiB budget
        big.records[0] = _record()
        saver = _saver(big)
        saver._per_token, saver._per_token_read = None, True  # unknown
        await saver.at_stop()
        assert set(cache.store.entries) == kept and not cache.store.pending
        assert not list(tmp_path.glob("*.part")) and len(big.posts) == 1
        # Its size known now: the next save of it is skipped at its reservation.
        saver = _saver(big)
        saver._per_token, saver._per_token_read = None, True
        await saver.at_stop()
        assert len(big.posts) == 1 and set(cache.store.entries) == kept

    asyncio.run(run())


class _Refusing:
    """Prompt slots that pin to slot 0 and note a refusal."""

    def __init__(self) -> None:
        self.noted: list[Any] = []

    async def pin(self, lease: Any, url: str, body: Any, parsed: Any, caller: Any) -> Any:
        lease.slot = 0
        return body

    def refused(self, lease: Any) -> None:
        self.noted.append(lease)


class _FailingPool:
    def __init__(self, hang: bool) -> None:
        self.hang = hang

    async def post(self, *args: Any) -> Any:
        if self.hang:
            await asyncio.Event().wait()
        raise ChildHttpError("the connection was reset")


def test_a_request_the_child_never_answered_is_never_saved_as_its_slot() -> None:
    """A request pinned to a slot that got no answer (a hang-up, first_byte_timeout, a
    dropped connection) may never have run: its slot holds what it held before, a longer
    conversation of the same key as a rule, which an idle save indexed under this request's
    tokens (superseding its real file, and a restore of it reuses little: restores off)."""
    async def run() -> None:
        for hang in (False, True):
            slots = _Refusing()
            lease = Lease(object(), model="m", instance="m", pid=1, base_url="http://x",
                          headers={}, first_byte_timeout=None, idle_timeout=None,
                          ready_since=0.0, prompt_slots=slots)  # type: ignore[arg-type]
            sending = asyncio.ensure_future(open_child(
                _FailingPool(hang), "/v1/chat/completions", "m", lease,  # type: ignore[arg-type]
                b'{"messages": []}', "application/json"))
            if hang:  # the client hung up while the child had not answered
                while lease.slot is None:
                    await asyncio.sleep(0)
                sending.cancel()
            with pytest.raises((UpstreamFailed, asyncio.CancelledError)):
                await sending
            assert slots.noted == [lease], hang

    asyncio.run(run())
