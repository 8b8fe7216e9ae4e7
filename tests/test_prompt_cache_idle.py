"""The prompt cache off the critical path: slots saved while the child is idle (a stop then has
nothing left to write), restores checked against the child's own `timings.cache_n`, and the
per-request work (choosing a slot, looking a request up in the store) kept cheap.

With real llama-server children (SmolLM2) where the child's behaviour is the point; the slot
choice, the store's look-ups and the idle saver's cancellation without one."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_prompt_cache import _FACTS, _chat, _cold, _conversation, _files, _next_turn, _restored

from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.events import EventBus
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.prompt_cache.choice import CHAT, COMPLETIONS, Choice, Record, shared
from corral.supervisor.prompt_cache.saver import Saver
from corral.supervisor.prompt_cache.store import Store

from conftest import Corral, wait_until


def _config(smol: Path, **cache: Any) -> dict[str, Any]:
    return {"defaults": {"ttl": 300, "stop_grace": 5}, "policy": {"max_loaded": 1},
            "prompt_cache": {"min_tokens": 64, **cache},
            "models": {"smol": {"model": str(smol), "ctx": 2048, "threads": 1}}}


def _saves(corral: Corral) -> list[dict[str, Any]]:
    return corral.log_events("prompt_cache.saved")


def _unload(corral: Corral) -> None:
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)


def _reused(answer: dict[str, Any], headers: httpx.Headers) -> None:
    """Restored, and the child's answer says it took (nearly) all of it from its cache."""
    assert _restored(answer, headers), (answer["timings"], headers.get("Server-Timing"))
    restored = int(headers["Server-Timing"].split('desc="restored ')[1].split()[0])
    assert answer["timings"]["cache_n"] >= restored - 1, (answer["timings"], restored)


# -- with a child ----------------------------------------------------------------------------------


def test_an_idle_child_is_saved_and_its_stop_writes_nothing(start_corral, smol_model):
    corral = start_corral(_config(smol_model, idle_save_after=0.5))
    messages = _conversation("the orchard")
    first, _ = _chat(corral, "smol", messages)
    pid = corral.model("smol")["pid"]

    # Saved once its turn is over, while the child runs on (nothing stopped it).
    (saved,) = wait_until(lambda: _saves(corral))
    assert saved["when"] == "idle" and saved["tokens"] > 300
    smol = corral.model("smol")
    assert smol["state"] == "ready" and smol["pid"] == pid and smol["in_flight"] == 0
    assert len(_files(corral)) == 1

    # The unload finds the slot unchanged since: no second file.
    _unload(corral)
    assert len(_saves(corral)) == 1 and len(_files(corral)) == 1

    # The next turn is restored from the idle save, and the child did reuse it.
    messages = _next_turn(messages, first, "And the orchard's clerk?")
    second, headers = _chat(corral, "smol", messages)
    _reused(second, headers)
    assert corral.http.get("/admin/prompt-cache").json()["unused_restores"] == 0
    assert not corral.log_events("prompt_cache.restore_unused")

    # That turn is saved at idle too (superseding the first file), and the stop writes none.
    wait_until(lambda: len(_saves(corral)) == 2)
    _unload(corral)
    assert len(_saves(corral)) == 2 and len(_files(corral)) == 1


def test_a_request_during_the_debounce_puts_the_save_off(start_corral, smol_model):
    # A debounce far longer than the gap between two turns: the first turn's save is put off
    # by the second, and the one save there is holds the second turn.
    corral = start_corral(_config(smol_model, idle_save_after=4))
    messages = _conversation("the well")
    first, _ = _chat(corral, "smol", messages)
    messages = _next_turn(messages, first, "And the well's clerk?")
    second, _ = _chat(corral, "smol", messages)
    assert not _saves(corral)  # the first turn's debounce was not over: nothing yet
    (saved,) = wait_until(lambda: _saves(corral), timeout=20)
    assert saved["when"] == "idle"
    total = second["timings"]["prompt_n"] + second["timings"]["cache_n"]
    assert saved["tokens"] == total, (saved, second["timings"])


def test_a_restore_the_child_did_not_reuse_turns_that_setups_restores_off(start_corral,
                                                                          smol_model):
    """A file whose tokens were recorded wrong (the index says it holds another
    conversation): the child restores it, finds almost none of it matches the prompt and
    prefills again (the same outcome as llama.cpp #26676, a restore that reuses nothing).
    The answer's cache_n shows it: a miss, an event, no more restores of that setup."""
    config = _config(smol_model, idle_save_after=0.3)
    corral = start_corral(config)
    river, forge = _conversation("the river"), _conversation("the forge")
    first_river, _ = _chat(corral, "smol", river)
    wait_until(lambda: len(_saves(corral)) == 1)
    _unload(corral)
    # Another conversation on a fresh child: its first message is no saved file's, so the
    # child is not even asked for its tokens (a miss, no restore).
    first_forge, headers = _chat(corral, "smol", forge)
    assert _cold(first_forge) and "prompt-cache" not in headers["Server-Timing"]
    wait_until(lambda: len(_saves(corral)) == 2)
    assert not corral.log_events("prompt_cache.restored")

    # Each file now said to hold the other conversation.
    folder = Path(start_corral.folder) / "state" / "prompt-cache"
    corral.proc.send_signal(signal.SIGTERM)
    corral.proc.wait(30)
    index = json.loads((folder / "index.json").read_text())
    a, b = index["entries"]
    for field in ("file", "bytes", "fingerprint"):
        a[field], b[field] = b[field], a[field]
    (folder / "index.json").write_text(json.dumps(index))
    corral = start_corral(config)

    forge = _next_turn(forge, first_forge, "And the forge's clerk?")
    answer, headers = _chat(corral, "smol", forge)
    assert "prompt-cache" in headers["Server-Timing"]  # restored, by the index's word
    assert answer["timings"]["cache_n"] < 100, answer["timings"]  # but not reused
    (unused,) = wait_until(lambda: corral.log_events("prompt_cache.restore_unused"))
    assert unused["cache_n"] == answer["timings"]["cache_n"] and unused["tokens"] > 300
    status = corral.http.get("/admin/prompt-cache").json()
    assert status["unused_restores"] == 1 and status["restores_off"] == 1
    metrics = corral.http.get("/metrics").text
    assert 'corral_prompt_cache_unused_restores_total{model="smol"} 1.0' in metrics

    # No more restores of that setup: the other conversation's next turn is prefilled.
    _unload(corral)
    river = _next_turn(river, first_river, "And the river's clerk?")
    answer, headers = _chat(corral, "smol", river)
    assert _cold(answer) and "prompt-cache" not in headers["Server-Timing"]
    assert len(corral.log_events("prompt_cache.restored")) == 1


# -- without a child -------------------------------------------------------------------------------


def _reference_choose(records: list[Record | None], free: list[int], path: str,
                      conv: list[Any] | str) -> tuple[int, str]:
    """The scan over every free slot that Choice replaced, kept as the rule to match: the
    slot, and which rule chose it."""
    best, best_len, whole = None, 0, False
    for i in free:
        rec = records[i]
        old = rec.body.get("messages" if rec.path == CHAT else "prompt") if rec else None
        if old is None or rec is None or rec.path != path:
            continue
        n, all_of_it = shared(old, conv)
        if (all_of_it, n) > (whole, best_len) and n > 0:
            best, best_len, whole = i, n, all_of_it
    if best is not None and whole:
        return best, "continued"
    empty = next((i for i in free if records[i] is None), None)
    if empty is not None:
        return empty, "empty"
    if best is not None:
        return best, "most shared"
    return min(free, key=lambda i: r.used if (r := records[i]) else 0.0), "least used"


@pytest.mark.parametrize("seed", [37, 38, 39])
def test_slot_choice_is_the_scans_for_a_scripted_sequence(seed):
    rng = random.Random(seed)
    systems = [f"You are assistant {i}. {_FACTS[:40 * i]}" for i in range(3)]
    prompts = ["Once upon a time", "Once upon a time there was", "x", "The valley's ledger"]
    choice = Choice(4)
    convs: list[list[dict[str, str]] | str] = []
    leased: dict[int, int] = {}  # request number -> slot
    rules = collections.Counter()
    for step in range(1500):
        if leased and (len(leased) == 4 or rng.random() < 0.45):
            choice.release(leased.pop(rng.choice(sorted(leased))))
            continue
        roll = rng.random()
        if convs and roll < 0.5:  # a conversation's next turn, or a branch of it
            old = rng.choice(convs)
            if isinstance(old, str):
                conv: list[dict[str, str]] | str = old + rng.choice([" and more", "!", ""])
            else:
                cut = rng.randint(1, len(old))
                conv = [*old[:cut], {"role": "user", "content": f"turn {step}"}]
        elif roll < 0.65:
            conv = rng.choice(prompts) + rng.choice(["", " again", " in the valley"])
        else:
            conv = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": f"question {step % 7}"}]
        path = COMPLETIONS if isinstance(conv, str) else CHAT
        free = [i for i in range(4) if i not in choice.leased]
        expected, rule = _reference_choose(choice.records, free, path, conv)
        slot = choice.choose(path, conv)
        assert slot == expected, (step, rule, conv)
        rules[rule] += 1
        body = {"prompt": conv} if isinstance(conv, str) else {"messages": conv}
        choice.take(slot, Record(path, body, used=float(step)))
        leased[step] = slot
        convs.append(conv)
    # Each rule decided (an empty slot only until each is filled, never emptied again).
    assert rules["empty"] == 4 and min(rules.values()) >= 4 and len(rules) == 4, rules
    assert len(choice._lru) <= 4 * 4 + 16  # stale entries do not pile up


def test_the_store_finds_a_setups_files_by_key_and_head(tmp_path):
    from test_prompt_cache import _entry

    store = Store(tmp_path, lambda: 1 << 30)
    entry = _entry(store, "a", [1, 2, 3, 4], 1000, 1.0, key="k1")
    entry.head = "c:system:You are a clerk"
    store.add(entry)
    store.add(_entry(store, "b", [9, 9], 1000, 2.0, key="k2"))  # head unknown: any request
    assert store.has_key("k1") and store.has_key("k2") and not store.has_key("k3")
    assert store.may_match("k1", "c:system:You are a clerk")
    assert not store.may_match("k1", "c:system:You are a miller")
    assert store.may_match("k1", None)  # a request whose head cannot be told
    assert store.may_match("k2", "c:user:anything")
    assert not store.may_match("k3", None)
    assert store.best("k1", [1, 2, 3, 5], 2) == (store.entries[entry.file], 3)

    # A restore the child did not reuse: that setup's look-ups end, the other's go on.
    store.restore_unused("k1", "a: 0 of 3 restored tokens reused")
    assert not store.may_match("k1", "c:system:You are a clerk")
    assert store.may_match("k2", None)
    assert store.status()["unused_restores"] == 1 and store.status()["restores_off"] == 1

    # An index written before heads were kept is read (any request may match its files);
    # one that loses its last file of a setup forgets the setup.
    index = json.loads((tmp_path / "index.json").read_text())
    for item in index["entries"]:
        item.pop("head")
    (tmp_path / "index.json").write_text(json.dumps(index))
    again = Store(tmp_path, lambda: 1 << 30)
    assert sorted(again.entries) == sorted(store.entries)
    assert again.may_match("k1", "c:system:You are a miller")
    again.drop(again.entries[entry.file], "test")
    assert not again.has_key("k1") and again.has_key("k2")


class _FakeSlots:
    """What the saver asks of a child's slots; the child's /slots listing waits on `gate`."""

    def __init__(self, cache: PromptCache):
        self.cache = cache
        self.model = self.instance = "m"
        self.spec = ModelSpec(name="m", backend="llama-server", model_path=Path("m.gguf"),
                              aliases=(), ttl=0, ctx=2048, parallel=2, n_gpu_layers=0,
                              threads=1, cache_type_k=None, cache_type_v=None, args=(), env={},
                              binary=None, start_timeout=10, max_queue=1, queue_timeout=1,
                              stop_grace=1, prompt_cache=True)
        self.records: list[Record | None] = [None, None]
        self.unsure: set[int] = set()  # slots an unpinned request may have taken (none here)
        self.gate = asyncio.Event()
        self.listed = asyncio.Event()
        self.posts: list[str] = []

    def leased(self, slot: int) -> bool:
        return False

    async def key(self) -> str:
        return "k"

    async def listing(self) -> Any:
        self.listed.set()
        await self.gate.wait()
        return [{"id": 0, "n_prompt_tokens": 500}, {"id": 1, "n_prompt_tokens": 500}]

    async def tokens(self, record: Record) -> list[int]:
        return [len(record.body["messages"])] * 500

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        self.posts.append(path)
        (self.cache.store.dir / payload["filename"]).write_bytes(b"kv" * 100)
        return 200, {"n_saved": 500}


def test_the_idle_saver_is_put_off_by_a_request_and_saves_a_slot_once(tmp_path):
    asyncio.run(_idle_saver(tmp_path))


async def _idle_saver(tmp_path: Path) -> None:
    settings = PromptCacheConfig(min_tokens=64, idle_save_after=0.01)
    cache = PromptCache(tmp_path, lambda: settings, EventBus())
    slots = _FakeSlots(cache)
    busy = [False]
    saver = Saver(slots, cache, lambda: busy[0], _Log())  # type: ignore[arg-type]
    slots.records[0] = Record(CHAT, {"messages": [{"role": "user", "content": _FACTS}]})

    # A request comes while the save is being prepared (nothing sent to the child yet).
    saver.turn_ended()
    await asyncio.wait_for(slots.listed.wait(), 5)
    task = saver._task
    assert task is not None
    saver.request_came()
    await asyncio.wait([task])
    assert task.cancelled() and slots.posts == [] and saver.changed() == [0]

    # A debounce that ends with a request in flight begins no save.
    busy[0] = True
    saver.turn_ended()
    timer = saver._timer
    assert timer is not None
    await asyncio.wait_for(_until(lambda: saver._timer is None), 5)  # it went off
    assert saver._task is task

    # Idle at last: saved once; a stop then finds nothing changed.
    busy[0] = False
    slots.gate.set()
    saver.turn_ended()
    await asyncio.wait_for(_until(lambda: saver._task is not task and saver._task is not None
                                  and saver._task.done()), 5)
    assert slots.posts == ["/slots/0?action=save"] and saver.changed() == []
    await saver.at_stop()
    assert slots.posts == ["/slots/0?action=save"]
    (entry,) = cache.store.entries.values()
    assert entry.head is not None and entry.head.startswith("c:user:Fact 0")

    # A stop that comes while an idle save is under way waits for it, and writes no more.
    slots.records[0] = Record(CHAT, {"messages": [{"role": "user", "content": _FACTS + "?"}]})
    slots.gate.clear()
    slots.listed.clear()
    saver = Saver(slots, cache, lambda: False, _Log())  # type: ignore[arg-type]
    saver.turn_ended()
    await asyncio.wait_for(slots.listed.wait(), 5)
    stop = asyncio.create_task(saver.at_stop())
    await asyncio.sleep(0)  # the stop runs up to its wait
    assert not stop.done()  # waiting for the idle save (at the child's listing)
    slots.gate.set()
    await asyncio.wait_for(stop, 5)
    assert slots.posts == ["/slots/0?action=save"] * 2 and saver.changed() == []

    # A slot that served another request since is saved at the stop, once.
    slots.records[1] = Record(CHAT, {"messages": [{"role": "user", "content": "x" * 400}]})
    saver2 = Saver(slots, cache, lambda: False, _Log())  # type: ignore[arg-type]
    saver2._saved[0] = slots.records[0]
    await saver2.at_stop()
    assert slots.posts == ["/slots/0?action=save"] * 2 + ["/slots/1?action=save"]
    saver2.turn_ended()  # closed by its stop: no timer
    assert saver2._timer is None


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


class _Log:
    def info(self, *args: Any, **kwargs: Any) -> None:
        pass

    warning = info
