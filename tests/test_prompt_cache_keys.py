"""The prompt cache per API key, with a real llama-server child (SmolLM2, two slots): one key's
saved conversation is never restored for another, its slot's KV never reused by another
(`timings.cache_n` of the other's answer shows nothing of it), an unload by a user key opens
nothing, and the key's own next turn still restores. No keys configured: restores as before
(tests/test_prompt_cache.py::test_a_conversation_survives_eviction_unload_and_restart)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_prompt_cache import _next_turn, _restored

from corral.proxy.errors import shape_of
from corral.supervisor.config.load import parse_config
from corral.supervisor.config.schema import PromptCacheConfig
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.errors import QueueTimeout, SlotNotCleared
from corral.supervisor.events import EventBus
from corral.supervisor.port import CALLER, Lease
from corral.supervisor.prompt_cache import PromptCache
from corral.supervisor.prompt_cache.choice import CHAT, COMPLETIONS, Choice, Record
from corral.supervisor.prompt_cache.identity import Setup
from corral.supervisor.prompt_cache.namespace import SALT, Namespaces
from corral.supervisor.prompt_cache.salt import PrefixSalts
from corral.supervisor.prompt_cache.slots import Slots
from corral.supervisor.prompt_cache.store import SUFFIX, Entry, Store, fingerprint

from conftest import Corral, CorralFactory, wait_until

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
# ~380 tokens of system prompt: a conversation worth a file (min_tokens 64 below), its whole
# prefill well over the 300 tokens `_nothing_reused` asks for (each SmolLM2 prefill of it
# costs ~2.5 CPU-seconds).
_FACTS = " ".join(f"Fact {i}: the {w} of the valley is kept in a ledger by its clerk." for i, w
                  in enumerate(["river", "orchard", "mill", "bridge", "well", "road", "school",
                                "market", "forge", "chapel"] * 2))


def _conversation(secret: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{secret} {_FACTS}"},
            {"role": "user", "content": "Tell me one thing."}]


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, smol_model: Path) -> Corral:
    config = {"defaults": {"ttl": 300, "stop_grace": 5},
              "api_keys": [ALICE, BOB], "admin_api_keys": [ADMIN],
              "prompt_cache": {"min_tokens": 64},
              "models": {"smol": {"model": str(smol_model), "ctx": 4096, "threads": 1,
                                  "parallel": 2}},
              # A group's members are leased in the caller's namespace too.
              "groups": {"solo": {"models": ["smol"], "type": "parallel",
                                  "expose_as_model": True}}}
    return start_corral_module(config, api_key=ADMIN)


@pytest.fixture(scope="module")
def clients(corral: Corral) -> Iterator[dict[str, httpx.Client]]:
    made = {key: httpx.Client(base_url=corral.url, timeout=120,
                              headers={"Authorization": f"Bearer {key}"})
            for key in (ALICE, BOB)}
    yield made
    for client in made.values():
        client.close()


def _chat(client: httpx.Client, messages: list[dict[str, str]],
          ) -> tuple[dict[str, Any], httpx.Headers]:
    resp = client.post("/v1/chat/completions", json={
        "model": "smol", "messages": messages, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json(), resp.headers




def _nothing_reused(answer: dict[str, Any], headers: httpx.Headers) -> bool:
    """The child prefilled the whole prompt: nothing of anyone's KV or save was used."""
    return answer["timings"]["cache_n"] == 0 and answer["timings"]["prompt_n"] > 300 \
        and "prompt-cache" not in headers.get("Server-Timing", "")


def _unload_and_wait_saved(corral: Corral) -> None:
    saves = len(corral.log_events("prompt_cache.saved"))
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    assert len(corral.log_events("prompt_cache.saved")) > saves


def _hits(corral: Corral) -> int:
    hits: int = corral.http.get("/admin/prompt-cache").json()["hits"]
    return hits


def test_one_keys_save_is_never_restored_for_another(corral, clients):
    alice = _conversation("Alice's secret: the vault code is 4417.")
    first, _ = _chat(clients[ALICE], alice)
    _unload_and_wait_saved(corral)
    namespaces = {e["namespace"] for e in corral.http.get("/admin/prompt-cache").json()["entries"]}
    assert None not in namespaces  # each file is a key's, none in the shared namespace

    # Bob guesses Alice's whole conversation: a cold child, nothing restored, nothing reused.
    hits = _hits(corral)
    guess, headers = _chat(clients[BOB], alice)
    assert _nothing_reused(guess, headers), (guess["timings"], headers.get("Server-Timing"))
    assert _hits(corral) == hits

    # Alice's own next turn: restored from her save (the child was started for Bob, her
    # conversation goes to the empty slot).
    answer, headers = _chat(clients[ALICE], _next_turn(alice, first, "And another?"))
    assert _restored(answer, headers), (answer["timings"], headers.get("Server-Timing"))
    assert _hits(corral) == hits + 1


def test_a_user_key_that_unloads_the_model_reads_nothing_of_others(corral, clients):
    alice = _conversation("Alice's other secret: the password is swordfish.")
    _chat(clients[ALICE], alice)
    # Idle, not pinned: a user key may unload it (the stop saves Alice's slot).
    saves = len(corral.log_events("prompt_cache.saved"))
    resp = clients[BOB].post("/models/unload", json={"model": "smol"})
    assert resp.status_code == 200, resp.text
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    assert len(corral.log_events("prompt_cache.saved")) > saves

    hits = _hits(corral)
    for guess in (alice, alice[:1]):  # the whole conversation, the system prompt alone
        answer, headers = _chat(clients[BOB], guess)
        assert _nothing_reused(answer, headers), answer["timings"]
    assert _hits(corral) == hits


def test_another_keys_slot_is_erased_before_it_is_reused(corral, clients):
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    alice = _conversation("Alice's third secret: the meeting is at noon.")
    bob = _conversation("Bob's own chat about the weather.")
    _chat(clients[ALICE], alice)  # slot A
    _chat(clients[BOB], bob)  # the other slot: Bob's
    erased = len(corral.log_events("prompt_cache.slot_erased"))
    # Bob sends Alice's conversation: none of his slots shares its beginning, none is empty;
    # the least recently used (Alice's) is erased before it serves him.
    answer, headers = _chat(clients[BOB], alice)
    assert _nothing_reused(answer, headers), answer["timings"]
    assert len(corral.log_events("prompt_cache.slot_erased")) == erased + 1

    # Alice's next message of the same conversation finds her slot gone to Bob (erased
    # again, then her own save of it, if any, restored): never Bob's KV either.
    again, headers = _chat(clients[ALICE], alice)
    assert again["timings"]["cache_n"] == 0 or _restored(again, headers), again["timings"]
    assert len(corral.log_events("prompt_cache.slot_erased")) == erased + 2


def test_an_unpinned_request_never_reuses_another_keys_slot(corral, clients):
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    # /v1/messages: llama-server picks the slot itself (the one most like the prompt) and
    # takes no cache_prompt there; Alice's idle slot is erased before Bob's request goes.
    alice = _conversation("Alice's fourth secret: the boat leaves at dawn.")
    _chat(clients[ALICE], alice)
    resp = clients[BOB].post("/v1/messages", json={
        "model": "smol", "system": alice[0]["content"], "max_tokens": 4,
        "messages": [{"role": "user", "content": alice[1]["content"]}]})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage.get("cache_read_input_tokens", 0) == 0 and usage["input_tokens"] > 300, usage
    # Alice's unpinned request (a prompt array: corral reads no conversation from it) leaves
    # her KV on a slot of llama-server's choosing (sent with cache_prompt false, it reuses
    # nothing itself): every idle slot may hold it now, and Bob's next pinned request gets
    # one of them only erased.
    again = clients[ALICE].post("/v1/completions", json={
        "model": "smol", "prompt": [alice[0]["content"]], "max_tokens": 4})
    assert again.status_code == 200, again.text
    erased = len(corral.log_events("prompt_cache.slot_erased"))
    answer, headers = _chat(clients[BOB], alice)
    assert _nothing_reused(answer, headers), answer["timings"]
    assert len(corral.log_events("prompt_cache.slot_erased")) == erased + 1


def test_a_groups_members_run_in_the_callers_namespace(corral, clients):
    corral.http.post("/admin/models/smol/unload").raise_for_status()
    wait_until(lambda: corral.model("smol")["state"] == "stopped", timeout=30)
    before = {e["file"] for e in corral.http.get("/admin/prompt-cache").json()["entries"]}
    for key, secret in ((ALICE, "Alice's group secret."), (BOB, "Bob's group question.")):
        resp = clients[key].post("/v1/chat/completions", json={
            "model": "solo", "messages": _conversation(secret), "max_tokens": 4,
            "temperature": 0})
        assert resp.status_code == 200, resp.text
    _unload_and_wait_saved(corral)
    new = [e for e in corral.http.get("/admin/prompt-cache").json()["entries"]
           if e["file"] not in before]
    # One file each, under two namespaces, neither the shared one of a keyless daemon.
    assert len(new) == 2 and None not in {e["namespace"] for e in new}
    assert len({e["namespace"] for e in new}) == 2


def test_namespaces_are_salted_per_state_dir(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    one, again, other = Namespaces(a), Namespaces(a), Namespaces(b)
    assert one.of(None) == "" == one.of("")
    assert one.of("x") == again.of("x") != one.of("y")
    assert one.of("x") != other.of("x")  # another dir's salt: unrelated names
    assert (a / SALT).stat().st_mode & 0o777 == 0o600


# -- without a child -------------------------------------------------------------------------

def test_a_vllm_request_carries_its_callers_own_cache_salt(tmp_path):
    """vLLM reuses any earlier prompt's prefix, whoever sent it: each caller's requests carry
    a `cache_salt` of its own (prompt_cache/salt.py), secret, stable for the dir, and a
    client's own salt only divides its key's cache further."""
    salts = PrefixSalts(Namespaces(tmp_path))
    url = BASE + CHAT
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    alice = json.loads(salts.apply(url, body, None, "alice"))
    bob = json.loads(salts.apply(url, body, None, "bob"))
    salt = alice["cache_salt"]
    assert salt != bob["cache_salt"] and len(salt) == 64 and int(salt, 16) >= 0
    assert {k: v for k, v in alice.items() if k != "cache_salt"} == json.loads(body)
    assert json.loads(salts.apply(url, body, None, "alice")) == alice  # stable
    again = PrefixSalts(Namespaces(tmp_path))  # another daemon on the same dir
    assert json.loads(again.apply(url, body, None, "alice")) == alice
    (tmp_path / "other").mkdir()
    assert json.loads(PrefixSalts(Namespaces(tmp_path / "other")).apply(
        url, body, None, "alice"))["cache_salt"] != salt  # another dir's secret
    # A client's own salt: hashed within its key's, never replacing it.
    theirs = b'{"model": "m", "cache_salt": "shared", "messages": []}'
    mine = json.loads(salts.apply(url, theirs, None, "alice"))["cache_salt"]
    his = json.loads(salts.apply(url, theirs, None, "bob"))["cache_salt"]
    assert len({mine, his, salt, "shared"}) == 4 and len(mine) == 64
    # Its name written with escapes is the same field (vLLM's parser takes the last of two
    # members of one name: a client's own would replace its key's).
    escaped = b'{"model": "m", "cache\\u005fsalt": "shared", "messages": []}'
    members = json.loads(salts.apply(url, escaped, None, "alice"), object_pairs_hook=list)
    assert [v for k, v in members if k == "cache_salt"] == [mine]
    # Every family vLLM salts; a dict body (a group's member request) too.
    for path in ("/v1/completions", "/v1/responses", "/v1/messages"):
        assert json.loads(salts.apply(BASE + path, body, None, "alice"))["cache_salt"] == salt
    assert salts.apply(url, {"model": "m"}, None, "alice") == {"model": "m", "cache_salt": salt}
    assert json.loads(salts.apply(url, b" {}", None, "alice")) == {"cache_salt": salt}
    # As sent: no keys, a path without a prefix cache, what is not a JSON object.
    assert salts.apply(url, body, None, None) is body
    assert salts.apply(BASE + "/v1/embeddings", body, None, "alice") is body
    for odd in (b"[1, 2]", b"not json", b'"cache_salt"'):
        assert salts.apply(url, odd, None, "alice") == odd


def test_a_salted_lease_asks_for_a_pin_only_for_a_caller(tmp_path):
    """A relay worker asks the daemon to pin a request only when the pin may change it: a
    vLLM child's lease salts for a caller, and with no keys configured there is none."""
    lease = Lease(object(), model="m", instance="m", pid=1, base_url=BASE, headers={},
                  first_byte_timeout=None, idle_timeout=None, ready_since=0.0,
                  salts=PrefixSalts(Namespaces(tmp_path)))
    assert not lease.pins_requests()
    token = CALLER.set("alice")
    try:
        assert lease.pins_requests()
        assert asyncio.run(lease.pin(BASE + CHAT, b'{"model": "m"}')) != b'{"model": "m"}'
    finally:
        CALLER.reset(token)
    unsalted = Lease(object(), model="m", instance="m", pid=1, base_url=BASE, headers={},
                     first_byte_timeout=None, idle_timeout=None, ready_since=0.0)
    assert not unsalted.pins_requests()


def _chat_record(messages: list[dict[str, str]], namespace: str) -> Record:
    return Record(CHAT, {"messages": messages}, used=time.monotonic(), namespace=namespace)


def test_slot_choice_matches_only_the_callers_own_slots():
    choice = Choice(2)
    alice = _conversation("Alice's.")
    choice.take(0, _chat_record(alice, "a"))
    choice.release(0)
    # Bob's copy of Alice's conversation: not her slot (an empty one is there).
    assert choice.choose(CHAT, alice, "b") == 1
    assert choice.choose(CHAT, alice, "a") == 0
    choice.take(1, _chat_record(_conversation("Bob's."), "b"))
    choice.release(1)
    # No empty slot, none of Bob's shares anything: the least recently used, Alice's (the
    # caller erases it), never found as "the one sharing most".
    assert choice.choose(CHAT, [*alice, {"role": "user", "content": "more"}], "b") == 0
    assert choice.choose(CHAT, [*alice, {"role": "user", "content": "more"}], "a") == 0


def test_the_store_sees_one_namespace_at_a_time(tmp_path):
    store = Store(tmp_path, lambda: 1 << 30)
    tokens = list(range(300))

    def entry(name: str, namespace: str, n: int) -> Entry:
        path = tmp_path / f"{name}{SUFFIX}"
        path.write_bytes(name.encode() * 100)
        size, digest = fingerprint(path)
        return Entry(file=path.name, key="k", model="m", tokens=tokens[:n], n_tokens=n,
                     bytes=size, fingerprint=digest, saved_at=1.0, last_used=1.0, head="h",
                     namespace=namespace)

    store.add(entry("alice", "a", 200))
    assert store.has_key("k", "a") and not store.has_key("k", "b") and not store.has_key("k")
    assert store.may_match("k", "h", "a") and not store.may_match("k", "h", "b")
    assert store.best("k", tokens, 64, "b") is None and store.best("k", tokens, 64) is None
    found = store.best("k", tokens, 64, "a")
    assert found is not None and found[0].file == f"alice{SUFFIX}"
    # Bob's longer save of the same tokens supersedes nothing of Alice's.
    store.add(entry("bob", "b", 300))
    assert {e.namespace for e in store.entries.values()} == {"a", "b"}
    found = store.best("k", tokens, 64, "b")
    assert found is not None and found[0].file == f"bob{SUFFIX}"
    # Read again from the index: the namespaces survive a restart.
    again = Store(tmp_path, lambda: 1 << 30)
    assert {e.namespace for e in again.entries.values()} == {"a", "b"}


class _Child(Slots):
    """Slots over a fake child: its /slots actions recorded, erases answered with `status`."""

    def __init__(self, cache: PromptCache, parallel: int, status: int = 200):
        spec = ModelSpec(name="m", backend="llama-server", model_path=Path("m.gguf"),
                         aliases=(), ttl=0, ctx=2048, parallel=parallel, n_gpu_layers=0,
                         threads=1, cache_type_k=None, cache_type_v=None, args=(), env={},
                         binary=None, start_timeout=10, max_queue=1, queue_timeout=1,
                         stop_grace=1, prompt_cache=True)
        super().__init__(cache, model="m", instance="m", spec=spec,
                         setup=Setup("k", ()), base_url=BASE, headers={},
                         session=None)  # type: ignore[arg-type]
        self.posts: list[str] = []
        self.status = status

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        self.posts.append(path)
        return self.status, {}


BASE = "http://127.0.0.1:1"


class _Lease:
    def __init__(self) -> None:
        self.slot: int | None = None
        self.restored = None


async def _send(child: _Child, caller: str | None, messages: list[dict[str, str]],
                path: str = CHAT) -> dict[str, Any]:
    lease = _Lease()
    body = json.dumps({"model": "m", "messages": messages}).encode()
    sent = await child.pin(lease, BASE + path, body, caller=caller)  # type: ignore[arg-type]
    child.unpin(lease)  # type: ignore[arg-type]
    result: dict[str, Any] = json.loads(sent)
    return result


def test_a_slot_changing_hands_is_erased_first(tmp_path):
    asyncio.run(_changing_hands(tmp_path))


async def _changing_hands(tmp_path: Path) -> None:
    cache = PromptCache(tmp_path, PromptCacheConfig, EventBus())
    alice, bob = _conversation("Alice's."), _conversation("Bob's.")
    child = _Child(cache, parallel=2)
    more = [*alice, {"role": "user", "content": "?"}]
    assert (await _send(child, "alice", alice))["id_slot"] == 0
    assert (await _send(child, "bob", alice))["id_slot"] == 1  # an empty slot, not hers
    assert (await _send(child, "bob", more))["id_slot"] == 1  # his own, continued
    assert child.posts == []
    # Bob's new conversation: the least recently used slot, Alice's, erased before it
    # serves him (the child is told nothing else: the body is as usual).
    sent = await _send(child, "bob", bob)
    assert sent["id_slot"] == 0 and child.posts == ["/slots/0?action=erase"]
    assert "cache_prompt" not in sent
    # Alice's next turn: her slot is gone to Bob, and neither of his is reused for her.
    sent = await _send(child, "alice", more)
    assert sent["id_slot"] == 1 and child.posts[1:] == ["/slots/1?action=erase"]
    # Her own slot again: nothing erased.
    sent = await _send(child, "alice", [*more, {"role": "user", "content": "!"}])
    assert sent["id_slot"] == 1 and len(child.posts) == 2

    # An unpinned generation on a child two keys use: sent with cache_prompt false, and the
    # slots it may have taken are erased before a pinned request uses them.
    # /v1/messages takes neither id_slot nor cache_prompt: Bob's idle slot is erased first
    # (Alice's own is kept for her).
    child.posts.clear()
    sent = await _send(child, "alice", alice, path="/v1/messages")
    assert sent["cache_prompt"] is False and child.posts == ["/slots/0?action=erase"]
    assert child.records[0] is None
    # Where llama-server honours cache_prompt (a prompt array corral cannot pin): nothing
    # erased.
    sent = await _send(child, "alice", alice, path=COMPLETIONS)
    assert sent["cache_prompt"] is False and "id_slot" not in sent and len(child.posts) == 1
    sent = await _send(child, "bob", _conversation("Bob's third."))
    assert sent["id_slot"] == 0 and child.posts[1:] == ["/slots/0?action=erase"]

    # No keys (one namespace): nothing erased, bodies as before.
    plain = _Child(PromptCache(tmp_path / "plain", PromptCacheConfig, EventBus()), parallel=2)
    for messages in (alice, bob, alice, _conversation("third"), bob):
        sent = await _send(plain, None, messages)
        assert "cache_prompt" not in sent
    assert (await _send(plain, None, alice, path="/v1/messages")) == {
        "model": "m", "messages": alice}
    assert plain.posts == []

    # An erase the child refuses: the request goes with cache_prompt false.
    one = _Child(PromptCache(tmp_path / "one", PromptCacheConfig, EventBus()), parallel=1,
                 status=500)
    await _send(one, "alice", alice)
    sent = await _send(one, "bob", alice)
    assert one.posts == ["/slots/0?action=erase"] and sent["cache_prompt"] is False
    # Where cache_prompt is ignored (/v1/messages), nothing goes onto the other key's KV: a
    # 503 the client may retry (Retry-After), its lease given back.
    lease = _Lease()
    with pytest.raises(SlotNotCleared) as refused:
        await one.pin(lease, BASE + "/v1/messages", _body(alice),  # type: ignore[arg-type]
                      caller="alice")
    assert refused.value.retry_after and one.posts[1:] == ["/slots/0?action=erase"]
    one.unpin(lease)  # type: ignore[arg-type]
    assert shape_of(refused.value).status == 503


def test_an_unpinned_request_may_land_on_a_leased_slot_idle_in_the_child(tmp_path):
    asyncio.run(_leased_but_idle(tmp_path))


async def _leased_but_idle(tmp_path: Path) -> None:
    """A slot is idle in the child once its answer is generated, while corral may still
    relay that answer: an unpinned request of another key may land there (llama-server picks
    the idle slot most like it), and the slot's next request of its own key must not reuse
    what that left."""
    child = _Child(PromptCache(tmp_path, PromptCacheConfig, EventBus()), parallel=2)
    bob = _conversation("Bob's.")
    await _send(child, "alice", _conversation("Alice's."))  # two keys on the child
    streaming = _Lease()  # Bob's answer, generated, relayed to a slow reader
    await child.pin(streaming, BASE + CHAT, _body(bob), caller="bob")  # type: ignore[arg-type]
    slot = streaming.slot
    assert slot is not None
    stray = _Lease()  # Alice's prompt array: no conversation to pin
    sent = json.loads(await child.pin(  # type: ignore[arg-type]
        stray, BASE + COMPLETIONS, b'{"model": "m", "prompt": ["Alice\'s secret"]}',
        caller="alice"))
    assert sent["cache_prompt"] is False and "id_slot" not in sent
    child.unpin(stray)  # type: ignore[arg-type]
    child.unpin(streaming)  # type: ignore[arg-type]
    assert slot in child.unsure  # never saved under Bob's tokens
    child.posts.clear()
    sent = await _send(child, "bob", [*bob, {"role": "user", "content": "?"}])
    assert sent["id_slot"] == slot and child.posts == [f"/slots/{slot}?action=erase"]


def test_a_failed_erase_is_not_forgotten_when_its_request_never_ran(tmp_path):
    asyncio.run(_failed_erase_remembered(tmp_path))


async def _failed_erase_remembered(tmp_path: Path) -> None:
    one = _Child(PromptCache(tmp_path, PromptCacheConfig, EventBus()), parallel=1, status=500)
    alice = _conversation("Alice's.")
    await _send(one, "alice", alice)
    # Bob's request: the erase refused, sent with cache_prompt false; the child may never
    # run it (refused with a 400, or the client hung up), and the slot holds Alice's KV.
    assert (await _send(one, "bob", alice))["cache_prompt"] is False
    one.status = 200
    one.posts.clear()
    sent = await _send(one, "bob", [*alice, {"role": "user", "content": "?"}])
    assert one.posts == ["/slots/0?action=erase"] and "cache_prompt" not in sent


def test_a_request_waits_for_a_file_the_child_is_writing(tmp_path):
    asyncio.run(_waits_for_the_write(tmp_path))


async def _waits_for_the_write(tmp_path: Path) -> None:
    """A request sent right after a save's own request (on another connection) may be
    queued first in llama-server: its erase or restore, or its prompt, would then be what the
    file holds, indexed under the saved conversation's tokens (another key's KV restored
    for this one later). It waits until the file is written."""
    child = _Child(PromptCache(tmp_path, PromptCacheConfig, EventBus()), parallel=2)
    await _send(child, "alice", _conversation("Alice's."))
    child.saver._writing_began()
    lease = _Lease()
    task = asyncio.create_task(child.pin(  # type: ignore[arg-type]
        lease, BASE + CHAT, _body(_conversation("Bob's.")), caller="bob"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done() and lease.slot is None and child.posts == []
    child.saver._writing_ended()
    sent = json.loads(await asyncio.wait_for(task, 5))
    assert sent["id_slot"] == lease.slot == 1
    child.unpin(lease)  # type: ignore[arg-type]
    # Cancelled while it waits: nothing held, the write's end still seen by the next.
    child.saver._writing_began()
    waiting = asyncio.create_task(child.pin(  # type: ignore[arg-type]
        _Lease(), BASE + CHAT, _body(_conversation("Bob's.")), caller="bob"))
    for _ in range(5):
        await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert child.saver.request_came() is not None
    child.saver._writing_ended()
    assert child.saver.request_came() is None


def test_an_admin_key_beside_one_user_key_turns_the_ram_cache_off(tiny_models):
    # Two callers of /v1 (the user key and the admin key), each its own namespace: the
    # child's RAM cache, shared by every caller, is off by default (auto).
    def cache_ram(top: str) -> int | None:
        text = f"{top}models:\n  m:\n    model: {tiny_models['tiny-a']}\n    ctx: 4096\n"
        value: int | None = parse_config(text).models["m"].cache_ram_mb
        return value

    assert cache_ram("api_keys: [alice]\nadmin_api_keys: [root]\n") == 0
    assert cache_ram("api_keys: [alice]\nadmin_api_keys: [alice]\n") is None  # one caller
    assert cache_ram("api_keys: [alice]\n") is None
    assert cache_ram("admin_api_keys: [root, other]\n") is None  # /v1 open: one namespace


class _Slow(_Child):
    """Its restores reach the child, then hang until cancelled (a client that hung up), while
    `hang`."""

    hang = True

    async def _restore(self, lease: Any, slot: int, record: Record) -> None:
        if not self.hang:
            return await super()._restore(lease, slot, record)
        self.posts.append(f"/slots/{slot}?action=restore")
        await asyncio.Event().wait()


async def _cut_short(child: _Child, caller: str, messages: list[dict[str, str]]) -> None:
    lease = _Lease()
    body = json.dumps({"model": "m", "messages": messages}).encode()
    task = asyncio.create_task(child.pin(lease, BASE + CHAT, body,  # type: ignore[arg-type]
                                         caller=caller))
    await wait_async(lambda: any("restore" in p for p in child.posts))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    child.unpin(lease)  # type: ignore[arg-type]


async def wait_async(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


def test_a_restore_cut_short_leaves_a_slot_nobody_reuses(tmp_path):
    asyncio.run(_restore_cut_short(tmp_path))


async def _restore_cut_short(tmp_path: Path) -> None:
    # Only Alice has used the child yet: the restore may have reached it all the same.
    one = _Slow(PromptCache(tmp_path / "one", PromptCacheConfig, EventBus()), parallel=1)
    await _cut_short(one, "alice", _conversation("Alice's."))
    assert 0 in one.unsure  # never saved under her request's tokens
    one.hang = False
    one.posts.clear()
    sent = await _send(one, "bob", _conversation("Bob's."))
    assert one.posts == ["/slots/0?action=erase"] and "cache_prompt" not in sent
    # Two slots: Bob's new conversation takes the least recently used one, hers.
    two = _Slow(PromptCache(tmp_path / "two", PromptCacheConfig, EventBus()), parallel=2)
    await _cut_short(two, "alice", _conversation("Alice's."))
    two.hang = False
    assert (await _send(two, "bob", _conversation("Bob's.")))["id_slot"] == 1
    two.posts.clear()
    sent = await _send(two, "bob", _conversation("Bob's second."))
    assert sent["id_slot"] == 0 and two.posts == ["/slots/0?action=erase"]


def test_a_slot_given_back_while_an_unpinned_request_waits_may_hold_it(tmp_path):
    asyncio.run(_given_back(tmp_path))


async def _given_back(tmp_path: Path) -> None:
    for parallel in (1, 2):
        child = _Child(PromptCache(tmp_path / str(parallel), PromptCacheConfig, EventBus()),
                       parallel=parallel)
        alice = _conversation("Alice's.")
        await _send(child, "bob", _conversation("Bob's."))  # two keys on the child
        await _send(child, "alice", alice)
        mine = _Lease()
        await child.pin(mine, BASE + CHAT, _body(alice), caller="alice")  # type: ignore[arg-type]
        # Every slot leased: Bob's request waits in llama-server's queue for any slot.
        busy = []
        for _ in range(parallel - 1):
            busy.append(_Lease())
            await child.pin(busy[-1], BASE + CHAT, _body(_conversation("Alice's other.")),
                            caller="alice")  # type: ignore[arg-type]
        waiting = _Lease()
        sent = json.loads(await child.pin(waiting, BASE + CHAT,  # type: ignore[arg-type]
                                          _body(_conversation("Bob's.")), caller="bob"))
        assert sent["cache_prompt"] is False and "id_slot" not in sent
        slot = mine.slot
        assert slot is not None
        child.unpin(mine)  # type: ignore[arg-type]  # Bob's request runs there now
        assert slot in child.unsure  # never saved under Alice's tokens
        child.posts.clear()
        more = [*alice, {"role": "user", "content": "?"}]
        sent = await _send(child, "alice", more)
        assert child.posts == [f"/slots/{slot}?action=erase"], parallel
        assert sent.get("id_slot", 0) == slot and "cache_prompt" not in sent
        child.unpin(waiting)  # type: ignore[arg-type]
        for lease in busy:
            child.unpin(lease)  # type: ignore[arg-type]


def _body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_a_messages_request_waits_for_other_keys_within_the_queue_timeout(tmp_path):
    asyncio.run(_messages_wait(tmp_path))


async def _messages_wait(tmp_path: Path) -> None:
    """Bob's /v1/messages request waits while Alice's request is at the child (gate.py), and
    is a 503 queue_timeout after the model's queue_timeout (1 s here) if hers lasts longer;
    once she is done, his next one goes, her slot erased first."""
    child = _Child(PromptCache(tmp_path, PromptCacheConfig, EventBus()), parallel=2)
    alices = _Lease()
    await child.pin(alices, BASE + CHAT, _body(_conversation("Alice's.")),  # type: ignore[arg-type]
                    caller="alice")
    bobs = _Lease()
    with pytest.raises(QueueTimeout) as waited:
        await child.pin(bobs, BASE + "/v1/messages",  # type: ignore[arg-type]
                        _body(_conversation("Bob's.")), caller="bob")
    assert shape_of(waited.value).status == 503 and "queue_timeout" in str(waited.value)
    child.unpin(bobs)  # type: ignore[arg-type]
    assert child.posts == []  # nothing erased under her request
    child.unpin(alices)  # type: ignore[arg-type]
    sent = await _send(child, "bob", _conversation("Bob's."), path="/v1/messages")
    assert "id_slot" not in sent and child.posts == ["/slots/0?action=erase"]


def test_messages_erase_only_other_keys_slots(tmp_path):
    asyncio.run(_messages_own(tmp_path))


async def _messages_own(tmp_path: Path) -> None:
    child = _Child(PromptCache(tmp_path, PromptCacheConfig, EventBus()), parallel=4)
    await _send(child, "alice", _conversation("Alice's."))  # slot 0
    await _send(child, "bob", _conversation("Bob's."))  # slot 1
    for turn in range(3):
        child.posts.clear()
        await _send(child, "bob", _conversation("Bob's messages."), path="/v1/messages")
        # Alice's slot (then nothing more): Bob's own, and the empty ones only his unpinned
        # requests may have filled, are kept.
        assert child.posts == (["/slots/0?action=erase"] if turn == 0 else []), turn
    assert child.records[1] is not None and child.records[0] is None
    # His own pinned conversation is still matched to its slot, nothing erased.
    sent = await _send(child, "bob", [*_conversation("Bob's."), {"role": "user", "content": "!"}])
    assert sent["id_slot"] == 1 and child.posts == []
    # Alice's next request gets none of the slots Bob's requests may have used unerased.
    sent = await _send(child, "alice", _conversation("Alice's."))
    assert child.posts == [f"/slots/{sent['id_slot']}?action=erase"]


class _Erasing(_Child):
    """Its erases answered with the next of `answers` (then 200), the first one only once
    `go` is set (None: at once); `erased` lists those answered 200."""

    def __init__(self, cache: PromptCache, parallel: int) -> None:
        super().__init__(cache, parallel)
        self.go: asyncio.Event | None = None
        self.answers: list[int] = []
        self.erased: list[str] = []

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        self.posts.append(path)
        go, self.go = self.go, None
        if go is not None:
            await go.wait()
        status = self.answers.pop(0) if self.answers else 200
        if status == 200:
            self.erased.append(path)
        return status, {}


def test_a_messages_request_never_goes_while_its_own_keys_slot_still_holds_anothers(tmp_path):
    asyncio.run(_own_slot_not_cleared(tmp_path))


async def _own_slot_not_cleared(tmp_path: Path) -> None:
    """Bob's chat takes Alice's last slot and erases it first; until that erase is done (or
    when it failed, the chat going with cache_prompt false) the slot is idle in the child with
    her KV, though leased to Bob's request. Bob's /v1/messages request (llama-server puts it on
    the idle slot most like it) must not go before that slot holds nothing of hers: it was
    sent at once, the slot taken for its own key's."""
    for failed in (False, True):
        await _own_slot_case(tmp_path, failed)


async def _own_slot_case(tmp_path: Path, failed: bool) -> None:
    child = _Erasing(PromptCache(tmp_path / str(failed), PromptCacheConfig, EventBus()),
                     parallel=2)
    await _send(child, "alice", _conversation("Alice's."))  # slot 0
    await _send(child, "alice", [{"role": "system", "content": "Other."},
                                 {"role": "user", "content": "?"}])  # slot 1
    child.posts.clear()
    chat = _Lease()
    go = asyncio.Event()
    if failed:
        # The erase fails (the child busy past restore_timeout): the chat goes with
        # cache_prompt false, her KV still in its slot until the child runs it.
        child.answers = [500]
        sent = json.loads(await child.pin(chat, BASE + CHAT,  # type: ignore[arg-type]
                                          _body(_conversation("Bob's.")), caller="bob"))
        assert sent["cache_prompt"] is False and sent["id_slot"] == 0
    else:
        child.go = go
        pinning = asyncio.create_task(child.pin(chat, BASE + CHAT,  # type: ignore[arg-type]
                                                _body(_conversation("Bob's.")),
                                                caller="bob"))
        await wait_async(lambda: child.posts == ["/slots/0?action=erase"])
    messages = _Lease()
    sending = asyncio.create_task(child.pin(
        messages, BASE + "/v1/messages",  # type: ignore[arg-type]
        _body(_conversation("Bob's.")), caller="bob"))
    if not failed:
        for _ in range(20):
            await asyncio.sleep(0)
        assert not sending.done(), "sent while Alice's KV was still in slot 0"
        go.set()
        await pinning
    await sending
    assert "/slots/0?action=erase" in child.erased, failed
    assert "/slots/1?action=erase" in child.erased, failed
    child.unpin(messages)  # type: ignore[arg-type]
    child.unpin(chat)  # type: ignore[arg-type]


def test_a_reloaded_queue_timeout_bounds_a_messages_requests_wait(tmp_path):
    asyncio.run(_reloaded_wait(tmp_path))


async def _reloaded_wait(tmp_path: Path) -> None:
    """A reload applies queue_timeout at once (the door's waits use it): so does the wait of a
    /v1/messages request for other keys' requests, not the value the child started with."""
    cache = PromptCache(tmp_path, PromptCacheConfig, EventBus())
    started = dataclasses.replace(_Child(cache, parallel=2).spec, queue_timeout=300)
    now = dataclasses.replace(started, queue_timeout=0.2)
    child = cache.slots(model="m", instance="m", spec=started, setup=Setup("k", ()),
                        base_url=BASE, headers={}, session=None,  # type: ignore[arg-type]
                        live=lambda: now)
    alices = _Lease()
    await child.pin(alices, BASE + CHAT, _body(_conversation("Alice's.")),  # type: ignore[arg-type]
                    caller="alice")
    bobs = _Lease()
    with pytest.raises(QueueTimeout) as waited:
        async with asyncio.timeout(5):
            await child.pin(bobs, BASE + "/v1/messages",  # type: ignore[arg-type]
                            _body(_conversation("Bob's.")), caller="bob")
    assert "0.2s" in str(waited.value)
    child.unpin(bobs)  # type: ignore[arg-type]
    child.unpin(alices)  # type: ignore[arg-type]
