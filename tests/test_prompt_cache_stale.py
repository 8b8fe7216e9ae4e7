"""Stale weights are never restored: the prompt cache's setup key is taken when a child is
spawned, from the model file it is about to map (device, inode, size, mtime and a hash of the
GGUF header and tensor index), and a file replaced under a running child turns that child's
restores off.

Real llama-server children on tiny GGUFs (conftest's `tiny_models`). The replacement file
has tiny-a's header byte for byte and tiny-b's weights: only the file's identity tells them
apart, the case a header hash alone would miss. The header hash itself is tested without
children at the end."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gguf import GGUFWriter

from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.events import EventBus
from corral.supervisor.gguf_header import header_digest, read_header
from corral.supervisor.prompt_cache import PromptCache, identity
from corral.supervisor.prompt_cache.identity import file_id

from conftest import Corral, CorralFactory, llama_server_binary, wait_until

# About 450 tokens for the tiny models' byte vocabulary: worth a file (min_tokens 64).
_SYSTEM = "You keep the valley's ledger. " + " ".join(
    f"Entry {i}: the {w} was counted." for i, w in enumerate(["mill", "well", "road"] * 6))


def _conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{topic}. {_SYSTEM}"},
            {"role": "user", "content": f"Tell me about {topic}."}]


def _next_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    # A fixed reply, not the model's: the next turn continues the saved prefix whatever the
    # tiny model wrote.
    return [*messages, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "And then?"}]


def _chat(corral: Corral, messages: list[dict[str, str]]) -> httpx.Headers:
    resp = corral.http.post("/v1/chat/completions", json={
        "model": "m", "messages": messages, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.headers


def _restored(headers: httpx.Headers) -> bool:
    return "prompt-cache" in headers.get("Server-Timing", "")


def _status(corral: Corral) -> dict[str, Any]:
    return dict(corral.http.get("/admin/prompt-cache").json())


def _setups(corral: Corral) -> list[str]:
    """Each saved file's setup key, newest first."""
    return [e["setup"] for e in _status(corral)["entries"]]


def _log(corral: Corral) -> list[dict[str, Any]]:
    records = []
    for line in corral.log_path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _unload(corral: Corral, saves: int) -> None:
    """Unload (the stop saves the slot) and wait for the `saves`-th save and the stop."""
    corral.http.post("/admin/models/m/unload").raise_for_status()
    wait_until(lambda: len(corral.log_events("prompt_cache.saved")) == saves, timeout=30)
    wait_until(lambda: corral.model("m")["state"] == "stopped", timeout=30)


def _config(model: Path, parallel: int = 1) -> dict[str, Any]:
    return {"defaults": {"ttl": 300, "stop_grace": 5},
            "prompt_cache": {"min_tokens": 64, "idle_save_after": 0},
            "models": {"m": {"model": str(model), "ctx": 2048 * parallel,
                             "parallel": parallel}}}


def _same_header_other_weights(tiny_models: dict[str, Path], to: Path) -> None:
    """tiny-a's header and tensor index (its name's length equals tiny-b's) followed by
    tiny-b's weights, written beside `to` and renamed into place, as a download does."""
    a, b = tiny_models["tiny-a"].read_bytes(), tiny_models["tiny-b"].read_bytes()
    start = read_header(tiny_models["tiny-a"]).data_start
    assert start == read_header(tiny_models["tiny-b"]).data_start and len(a) == len(b)
    beside = to.with_name(to.name + ".part")
    beside.write_bytes(a[:start] + b[start:])
    assert a[start:] != b[start:]
    os.replace(beside, to)
    # Same header, same size: only the file's identity (inode, mtime) differs.
    assert header_digest(to)[1] == header_digest(tiny_models["tiny-a"])[1]


@pytest.fixture
def model_file(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    path = tmp_path / "models" / "m.gguf"
    path.parent.mkdir()
    shutil.copyfile(tiny_models["tiny-a"], path)
    return path


# -- with children -------------------------------------------------------------------------------


def test_a_replaced_model_file_is_never_restored_from_the_old_ones_saves(
        start_corral: CorralFactory, model_file: Path, tiny_models: dict[str, Path]) -> None:
    corral = start_corral(_config(model_file))
    messages = _conversation("the mill")
    assert not _restored(_chat(corral, messages))
    _unload(corral, saves=1)
    (old,) = _setups(corral)

    # The control: the same file, a new child: the next turn is restored.
    messages = _next_turn(messages)
    assert _restored(_chat(corral, messages))
    assert _status(corral)["hits"] == 1
    _unload(corral, saves=2)  # the longer save supersedes the first
    assert _setups(corral) == [old]

    # Replaced by other weights under the same header, at the same path: the next child
    # restores nothing of the old one's, and saves under a key of its own.
    _same_header_other_weights(tiny_models, model_file)
    messages = _next_turn(messages)
    assert not _restored(_chat(corral, messages))
    assert _status(corral)["hits"] == 1
    assert len(corral.log_events("prompt_cache.restored")) == 1
    _unload(corral, saves=3)
    new, kept = _setups(corral)
    assert kept == old and new != old


def test_a_touched_model_file_gets_a_new_key(start_corral: CorralFactory,
                                             model_file: Path) -> None:
    """The same bytes with another mtime: a new key. The weights are not hashed (gigabytes),
    so corral cannot tell a touched file from one rewritten in place with the same header;
    the safe answer is to restore nothing, at the cost of one cold prefill per conversation."""
    corral = start_corral(_config(model_file))
    messages = _conversation("the well")
    _chat(corral, messages)
    _unload(corral, saves=1)
    (old,) = _setups(corral)
    st = model_file.stat()
    os.utime(model_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    messages = _next_turn(messages)
    assert not _restored(_chat(corral, messages))
    _unload(corral, saves=2)
    assert set(_setups(corral)) == {old, _setups(corral)[0]} and _setups(corral)[0] != old
    assert _status(corral)["hits"] == 0


def test_a_file_replaced_under_a_running_child_gives_it_no_restores(
        start_corral: CorralFactory, model_file: Path, tiny_models: dict[str, Path]) -> None:
    corral = start_corral(_config(model_file, parallel=2))
    mill, road = _conversation("the mill"), _conversation("the road")
    _chat(corral, mill)
    _chat(corral, road)
    _unload(corral, saves=2)
    (old, _) = _setups(corral)
    assert set(_setups(corral)) == {old}

    # A child started on the file the saves were made with; then the file is replaced.
    corral.http.post("/admin/models/m/load").raise_for_status()
    wait_until(lambda: corral.model("m")["state"] == "ready", timeout=30)
    _same_header_other_weights(tiny_models, model_file)

    # Both conversations land on empty slots: neither is restored; said once.
    mill, road = _next_turn(mill), _next_turn(road)
    assert not _restored(_chat(corral, mill))
    assert not _restored(_chat(corral, road))
    assert _status(corral)["hits"] == 0
    (replaced,) = corral.log_events("prompt_cache.model_replaced")
    assert replaced["file"] == str(model_file)

    # Its saves keep the key it was spawned with (what its KV was computed with); the next
    # child, on the new file, finds none of them.
    _unload(corral, saves=4)
    assert set(_setups(corral)) == {old}
    assert not _restored(_chat(corral, _next_turn(mill)))
    assert _status(corral)["hits"] == 0
    _unload(corral, saves=5)
    assert len(set(_setups(corral))) == 2

    # Each child's key was taken before its process started, and is the one its saves have.
    order = [r["event"] for r in _log(corral) if r.get("event") in ("prompt_cache.setup",
                                                                    "child.spawned")]
    assert order == ["prompt_cache.setup", "child.spawned"] * 3
    keys = [e["key"] for e in corral.log_events("prompt_cache.setup")]
    assert keys[:2] == [old, old] and keys[2] == _setups(corral)[0] != old


# -- the header hash, without children -----------------------------------------------------------


def _gguf(path: Path, name: str = "x", shape: tuple[int, int] = (4, 8), fill: float = 0.0,
          dtype: type = np.float32) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(64)
    writer.add_tensor("t.weight", np.full(shape, fill, dtype=dtype))
    writer.add_tensor("u.weight", np.full(64, fill, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_hash_covers_metadata_and_the_tensor_index_not_the_weights(
        tmp_path: Path) -> None:
    def digest(**kw: Any) -> str:
        path = _gguf(tmp_path / f"{len(list(tmp_path.iterdir()))}.gguf", **kw)
        return header_digest(path)[1]

    base = digest()
    assert digest() == base  # another file, the same bytes
    # Only the tensor data differs: alike, by design. The weights are the file's identity's
    # to tell apart (device, inode, size, mtime in the key): hashing them reads gigabytes.
    assert digest(fill=1.0) == base
    # A metadata value, a tensor's shape (the same bytes of data), a tensor's type: differ.
    assert digest(name="y") != base
    assert digest(shape=(8, 4)) != base
    assert digest(dtype=np.float16) != base


def test_the_hash_reads_no_weights_and_is_taken_once_per_file_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _gguf(tmp_path / "m.gguf")
    start = read_header(path).data_start
    assert 0 < start < path.stat().st_size

    # The digest is of the bytes before the tensor data: garbage after them changes nothing.
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(os.urandom(path.stat().st_size - start))
    assert header_digest(path)[1] == header_digest(_gguf(tmp_path / "n.gguf"))[1]

    calls = []
    real = identity.header_digest

    def counting(p: Path) -> tuple[os.stat_result, str]:
        calls.append(p)
        return real(p)

    monkeypatch.setattr(identity, "header_digest", counting)
    first = asyncio.run(file_id(path))
    assert asyncio.run(file_id(path)) == first and len(calls) == 1  # one stat the second time
    assert first.digest == header_digest(path)[1]
    assert not first.replaced()

    # Touched: a new version (hashed again, to the same digest) and the old identity is
    # replaced; renamed over by another file: replaced too.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert first.replaced()
    touched = asyncio.run(file_id(path))
    assert len(calls) == 2 and touched.digest == first.digest and touched != first
    os.replace(_gguf(tmp_path / "other.gguf", name="other"), path)
    assert touched.replaced() and asyncio.run(file_id(path)).digest != first.digest
    path.unlink()
    assert touched.replaced()  # gone counts as replaced


def test_every_file_the_child_maps_is_in_the_key(tmp_path: Path) -> None:
    """A split model's other parts and the projector: each replaced, a new key."""
    cache = PromptCache(tmp_path / "cache", PromptCacheConfig, EventBus())
    binary = llama_server_binary()
    first = _gguf(tmp_path / "m-00001-of-00002.gguf")
    second = _gguf(tmp_path / "m-00002-of-00002.gguf", name="part two")
    mmproj = _gguf(tmp_path / "mmproj.gguf", name="projector")
    spec = ModelSpec(name="m", backend="llama-server", model_path=first, aliases=(), ttl=0,
                     ctx=2048, parallel=1, n_gpu_layers=0, threads=1, cache_type_k=None,
                     cache_type_v=None, args=(), env={}, binary=None, start_timeout=10,
                     max_queue=1, queue_timeout=1, stop_grace=1, mmproj=mmproj)
    base = asyncio.run(cache.setup(spec, binary))
    assert [f.path for f in base.files] == [str(first), str(second), str(mmproj)]
    assert asyncio.run(cache.setup(spec, binary)) == base and base.replaced() is None
    keys = {base.key}
    for path in (second, mmproj):
        os.replace(_gguf(tmp_path / "new.gguf", name=f"new {path.name}"), path)
        assert base.replaced() is not None
        again = asyncio.run(cache.setup(spec, binary))
        assert again.key not in keys
        keys.add(again.key)


def test_the_setup_bench_runs_and_prints_its_summary(tiny_models: dict[str, Path]) -> None:
    bench = Path(__file__).resolve().parent.parent / "bench" / "prompt_cache_setup.py"
    out = subprocess.run([sys.executable, str(bench), "--model", str(tiny_models["tiny-a"]),
                          "--rounds", "1"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    for line in ("first spawn, header not parsed yet", "first spawn, header parsed already",
                 "later spawns (cached)", "re-stat before a restore"):
        assert line in out, out


def test_a_file_replaced_between_the_hash_and_the_childs_open_gives_it_no_prompt_cache(
        tmp_path: Path) -> None:
    """The key is hashed just before the spawn; a file renamed into place in between is what
    the child loads. At ready its files are stat'ed once more (Launch.current_setup): changed,
    the child gets no prompt cache at all (its saves would file the new weights' KV under
    the old file's key, which a rollback of the file would restore)."""
    import types

    import structlog.testing

    from corral.supervisor.instance.launch import Launch
    from corral.supervisor.prompt_cache.identity import FileId, Setup

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF old")
    st = model.stat()
    setup = Setup("k", (FileId(str(model), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                               "d"),))
    launch = types.SimpleNamespace(setup=setup, _log=structlog.get_logger("test"))
    assert Launch.current_setup(launch) is setup  # type: ignore[arg-type]
    (tmp_path / "new").write_bytes(b"GGUF new weights")
    os.replace(tmp_path / "new", model)
    with structlog.testing.capture_logs() as logs:
        assert Launch.current_setup(launch) is None  # type: ignore[arg-type]
    assert [e["file"] for e in logs if e["event"] == "prompt_cache.model_replaced_at_start"] \
        == [str(model)]
    launch.setup = None
    assert Launch.current_setup(launch) is None  # type: ignore[arg-type]
