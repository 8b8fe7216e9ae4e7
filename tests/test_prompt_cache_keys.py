"""The prompt cache per API key, with a real llama-server child (SmolLM2, two slots): one key's
saved conversation is never restored for another, its slot's KV never reused by another
(`timings.cache_n` of the other's answer shows nothing of it), an unload by a user key opens
nothing, and the key's own next turn still restores. No keys configured: restores as before
(tests/test_prompt_cache.py::test_a_conversation_survives_eviction_unload_and_restart)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.supervisor.prompt_cache.namespace import SALT, Namespaces

from conftest import Corral, CorralFactory, wait_until

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
# ~700 tokens of system prompt: a conversation worth a file (min_tokens 64 below).
_FACTS = " ".join(f"Fact {i}: the {w} of the valley is kept in a ledger by its clerk." for i, w
                  in enumerate(["river", "orchard", "mill", "bridge", "well", "road", "school",
                                "market", "forge", "chapel"] * 4))


def _conversation(secret: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{secret} {_FACTS}"},
            {"role": "user", "content": "Tell me one thing."}]


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, smol_model: Path) -> Corral:
    config = {"defaults": {"ttl": 300, "stop_grace": 5},
              "api_keys": [ALICE, BOB], "admin_api_keys": [ADMIN],
              "prompt_cache": {"min_tokens": 64},
              "models": {"smol": {"model": str(smol_model), "ctx": 4096, "threads": 2,
                                  "parallel": 2}}}
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


def _next_turn(messages: list[dict[str, str]], answer: dict[str, Any],
               question: str) -> list[dict[str, str]]:
    reply = answer["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": reply},
            {"role": "user", "content": question}]


def _restored(answer: dict[str, Any], headers: httpx.Headers) -> bool:
    timings = answer["timings"]
    return timings["prompt_n"] < 60 < timings["prompt_n"] + timings["cache_n"] \
        and "prompt-cache" in headers.get("Server-Timing", "")


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


def test_namespaces_are_salted_per_state_dir(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    one, again, other = Namespaces(a), Namespaces(a), Namespaces(b)
    assert one.of(None) == "" == one.of("")
    assert one.of("x") == again.of("x") != one.of("y")
    assert one.of("x") != other.of("x")  # another dir's salt: unrelated names
    assert (a / SALT).stat().st_mode & 0o777 == 0o600
