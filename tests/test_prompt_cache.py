"""The prompt cache with real llama-server children (SmolLM2): slots saved when a child stops
(eviction, unload, TTL, shutdown), restored on the conversation's next turn (the child's own
`timings.prompt_n` shows the prefill it did not redo), never restored into another setup, a
corrupt file skipped, two slots keeping two conversations. The store's bookkeeping (index,
budget, truncated files) is tested without children at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import yaml

from corral.supervisor.backends.binaries import find_executable
from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.events import EventBus
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.prompt_cache.store import SUFFIX, Entry, Store, fingerprint

from conftest import Corral, CorralFactory, wait_until

# ~380 tokens of system prompt: a conversation worth a file (min_tokens 64 below), its whole
# prefill well over the 300 tokens `_cold` asks for, and no longer: every SmolLM2 prefill of
# it costs ~2.5 CPU-seconds (single-threaded: a second compute thread only spins beside the
# suite's other workers).
_FACTS = " ".join(f"Fact {i}: the {w} of the valley is kept in a ledger by its clerk." for i, w
                  in enumerate(["river", "orchard", "mill", "bridge", "well", "road", "school",
                                "market", "forge", "chapel"] * 2))


def _conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You answer questions about {topic}. {_FACTS}"},
            {"role": "user", "content": f"Tell me one thing about {topic}."}]


def _chat(corral: Corral, model: str, messages: list[dict[str, str]],
          ) -> tuple[dict[str, Any], httpx.Headers]:
    resp = corral.http.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json(), resp.headers


def _next_turn(messages: list[dict[str, str]], answer: dict[str, Any],
               question: str) -> list[dict[str, str]]:
    reply = answer["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": reply},
            {"role": "user", "content": question}]


def _restored(answer: dict[str, Any], headers: httpx.Headers) -> bool:
    """The child prefilled only the new turn: a few dozen tokens of hundreds."""
    timings = answer["timings"]
    total = timings["prompt_n"] + timings["cache_n"]
    return timings["prompt_n"] < 60 < total \
        and "prompt-cache" in headers.get("Server-Timing", "")


def _cold(answer: dict[str, Any]) -> bool:
    return answer["timings"]["cache_n"] == 0 and answer["timings"]["prompt_n"] > 300


def _files(corral: Corral) -> list[dict[str, Any]]:
    status = corral.http.get("/admin/prompt-cache").json()
    return list(status["entries"])


def _config(smol: Path, tiny: Path | None = None, **cache: Any) -> dict[str, Any]:
    models: dict[str, Any] = {"smol": {"model": str(smol), "ctx": 2048, "threads": 1}}
    if tiny is not None:
        models["tiny"] = {"model": str(tiny), "ctx": 512}
    return {"defaults": {"ttl": 300, "stop_grace": 5}, "policy": {"max_loaded": 1},
            "prompt_cache": {"min_tokens": 64, **cache}, "models": models}


def _restart(factory: CorralFactory, corral: Corral, config: dict[str, Any]) -> Corral:
    """Stop the daemon (SIGTERM: its shutdown saves the slots) and start another on the same
    state dir."""
    corral.proc.send_signal(signal.SIGTERM)
    corral.proc.wait(30)
    return factory(config)


def test_a_conversation_survives_eviction_unload_and_restart(start_corral, smol_model,
                                                             tiny_models):
    config = _config(smol_model, tiny_models["tiny-a"])
    corral = start_corral(config)
    messages = _conversation("the valley")
    first, _ = _chat(corral, "smol", messages)
    assert _cold(first)

    # Evicted (max_loaded 1) by another model: saved before the child went.
    corral.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                              "max_tokens": 2}).raise_for_status()
    saved = wait_until(lambda: corral.log_events("prompt_cache.saved"))
    assert saved[0]["tokens"] > 300
    assert len(_files(corral)) == 1

    messages = _next_turn(messages, first, "And another?")
    second, headers = _chat(corral, "smol", messages)
    assert _restored(second, headers), (second["timings"], headers.get("Server-Timing"))
    assert corral.model("smol")["prompt_cache"]["files"] == 1

    # Unloaded: saved again; the longer save supersedes the first file.
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: len(corral.log_events("prompt_cache.saved")) == 2)
    assert len(_files(corral)) == 1

    messages = _next_turn(messages, second, "One more?")
    third, headers = _chat(corral, "smol", messages)
    assert _restored(third, headers)

    # A corral restart: the shutdown saves, the next daemon finds the index.
    corral = _restart(start_corral, corral, config)
    assert len(_files(corral)) == 1
    messages = _next_turn(messages, third, "Last one?")
    fourth, headers = _chat(corral, "smol", messages)
    assert _restored(fourth, headers)
    metrics = corral.http.get("/metrics").text
    assert 'corral_prompt_cache_restores_total{model="smol"} 1.0' in metrics
    assert corral.http.get("/admin/prompt-cache").json()["hits"] == 1


def test_another_setup_is_never_restored_and_a_corrupt_file_is_dropped(start_corral,
                                                                       smol_model):
    config = _config(smol_model)
    corral = start_corral(config)
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    messages = _conversation("the mill")
    first, _ = _chat(corral, "smol", messages)
    messages = _next_turn(messages, first, "More?")

    def saves() -> list[dict[str, Any]]:
        return corral.log_events("prompt_cache.saved")

    def reload(**smol: Any) -> None:
        config["models"]["smol"].update(smol)
        corral.config_path.write_text(yaml.safe_dump(config))
        assert corral.http.post("/admin/reload").status_code == 200

    # A reload to another context size: the child is saved on its way out; the next one has
    # another KV layout, so the file stays, unused.
    reload(ctx=1024)
    wait_until(lambda: len(saves()) == 1, timeout=20)
    (saved_2048,) = _files(corral)
    answer, headers = _chat(corral, "smol", messages)
    assert _cold(answer) and "prompt-cache" not in headers["Server-Timing"]

    # Back to the setup the file was saved with, but the file was overwritten on disk (same
    # size): skipped and deleted, and the request answered as if there were no cache.
    with open(folder / saved_2048["file"], "r+b") as f:
        f.write(os.urandom(4096))
    reload(ctx=2048, ttl=1)
    wait_until(lambda: len(saves()) == 2, timeout=20)  # the ctx 1024 child's slot
    answer, headers = _chat(corral, "smol", messages)
    assert _cold(answer)
    assert not (folder / saved_2048["file"]).exists()
    assert [e["file"] for e in corral.log_events("prompt_cache.dropped")] == [saved_2048["file"]]

    # A TTL stop saves too, and the next turn is restored from it.
    wait_until(lambda: len(saves()) == 3, timeout=20)
    assert any("ttl" in e.get("reason", "") for e in corral.log_events("instance.stop"))
    messages = _next_turn(messages, answer, "And then?")
    answer, headers = _chat(corral, "smol", messages)
    assert _restored(answer, headers)


def test_two_slots_keep_two_conversations(start_corral, smol_model):
    config = _config(smol_model)
    config["models"]["smol"].update(parallel=2, ctx=4096)
    corral = start_corral(config)
    a, b = _conversation("the river"), _conversation("the forge")
    first_a, _ = _chat(corral, "smol", a)
    first_b, _ = _chat(corral, "smol", b)
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: len(corral.log_events("prompt_cache.saved")) == 2)
    slots = sorted(e["slot"] for e in corral.log_events("prompt_cache.saved"))
    assert slots == [0, 1]

    b = _next_turn(b, first_b, "And the forge's clerk?")
    a = _next_turn(a, first_a, "And the river's clerk?")
    for messages in (b, a):
        answer, headers = _chat(corral, "smol", messages)
        assert _restored(answer, headers), answer["timings"]
    restored = corral.log_events("prompt_cache.restored")
    assert sorted(e["slot"] for e in restored) == [0, 1]
    assert len({e["file"] for e in restored}) == 2

    # The disk budget: lowered (a reload) below what both conversations take, the next saves
    # keep the newest file only.
    largest = max(e["bytes"] for e in _files(corral))
    config["prompt_cache"]["max_mb"] = largest * 1.5 / (1 << 20)
    corral.config_path.write_text(yaml.safe_dump(config))
    assert corral.http.post("/admin/reload").status_code == 200
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: len(corral.log_events("prompt_cache.saved")) == 4)
    (kept,) = _files(corral)
    assert kept["bytes"] <= largest * 1.5
    assert any("budget" in e["reason"] for e in corral.log_events("prompt_cache.dropped"))


# -- the store, without children -----------------------------------------------------------------

def _entry(store: Store, name: str, tokens: list[int], size: int, used: float,
           key: str = "k") -> Entry:
    path = store.dir / f"{name}{SUFFIX}"
    path.write_bytes(os.urandom(size))
    nbytes, digest = fingerprint(path)
    return Entry(file=path.name, key=key, model="m", tokens=tokens, n_tokens=len(tokens),
                 bytes=nbytes, fingerprint=digest, saved_at=used, last_used=used)


def test_store_keeps_its_budget_and_drops_what_does_not_check_out(tmp_path):
    budget = [3 << 20]
    store = Store(tmp_path, lambda: budget[0])
    store.add(_entry(store, "a", [1, 2, 3], 1 << 20, 1.0))
    store.add(_entry(store, "b", [7, 8, 9], 1 << 20, 2.0))
    store.add(_entry(store, "c", [4, 5, 6], 1 << 20, 3.0))
    store.add(_entry(store, "d", [1, 2, 3, 4], 1 << 20, 4.0))  # supersedes a
    assert sorted(store.entries) == [f"{n}{SUFFIX}" for n in "bcd"]
    assert not (tmp_path / f"a{SUFFIX}").exists()
    store.add(_entry(store, "e", [9], 1 << 20, 5.0))  # over budget: b, the oldest, goes
    assert sorted(store.entries) == [f"{n}{SUFFIX}" for n in "cde"]
    assert store.best("k", [1, 2, 3, 4, 5], 2) == (store.entries[f"d{SUFFIX}"], 4)
    assert store.best("other", [1, 2, 3, 4, 5], 2) is None
    assert store.best("k", [1, 2, 3, 4, 5], 5) is None

    # A new daemon on the same dir: a truncated file, a rewritten one and an orphan go; the
    # rest is found again. A lower budget applies at once.
    with open(tmp_path / f"c{SUFFIX}", "r+b") as f:
        f.truncate(1000)
    (tmp_path / f"e{SUFFIX}").write_bytes(os.urandom(1 << 20))
    (tmp_path / f"orphan{SUFFIX}").write_bytes(b"x")
    again = Store(tmp_path, lambda: budget[0])
    assert sorted(again.entries) == [f"d{SUFFIX}"]
    assert sorted(p.name for p in tmp_path.glob(f"*{SUFFIX}")) == [f"d{SUFFIX}"]
    assert again.entries[f"d{SUFFIX}"].tokens == [1, 2, 3, 4]
    budget[0] = 1000
    assert Store(tmp_path, lambda: budget[0]).entries == {}

    (tmp_path / "index.json").write_text("{not json")
    (tmp_path / f"x{SUFFIX}").write_bytes(b"x")
    assert Store(tmp_path, lambda: budget[0]).entries == {}  # unreadable index: a fresh start
    assert not (tmp_path / f"x{SUFFIX}").exists()


def test_cache_key_changes_with_what_makes_a_kv_cache_compatible(tmp_path, smol_model):
    asyncio.run(_cache_keys(tmp_path, smol_model))


async def _key(cache: PromptCache, spec: ModelSpec, binary: str) -> str:
    return (await cache.setup(spec, binary)).key


async def _cache_keys(tmp_path: Path, smol_model: Path) -> None:
    cache = PromptCache(tmp_path, PromptCacheConfig, EventBus())
    binary = find_executable(None, ("llama-server",))
    spec = ModelSpec(name="m", backend="llama-server", model_path=smol_model, aliases=(),
                     ttl=0, ctx=2048, parallel=1, n_gpu_layers=0, threads=1, cache_type_k=None,
                     cache_type_v=None, args=(), env={}, binary=None, start_timeout=10,
                     max_queue=1, queue_timeout=1, stop_grace=1)
    base = await _key(cache, spec, binary)
    assert base == await _key(cache, spec, binary)
    for change in ({"cache_type_k": "q8_0"}, {"cache_type_v": "q8_0"}, {"ctx": 4096},
                   {"parallel": 2}, {"args": ("--flash-attn", "on")}):
        assert await _key(cache, dataclasses.replace(spec, **change), binary) != base, change
    # Another model file, or the same path rewritten (size or mtime).
    copy = tmp_path / "model.gguf"
    copy.write_bytes(smol_model.read_bytes())
    other = dataclasses.replace(spec, model_path=copy)
    before = await _key(cache, other, binary)
    assert before != base
    os.utime(copy, ns=(0, 0))
    assert await _key(cache, other, binary) != before
