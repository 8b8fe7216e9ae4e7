"""Two API keys on one llama-server child (a tiny model, two slots), end to end: a request
llama-server places itself (/v1/messages: no id_slot, no cache_prompt) never lands on another
key's KV, since it is at the child only while every request there is its own key's
(supervisor/prompt_cache/gate.py; its rules in process below); and a Responses conversation
(a coding agent's) is pinned to a slot of its key's, so its next turn reuses its own KV and
nothing of another key's."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import httpx
import psutil
import pytest

from corral.supervisor.prompt_cache.gate import NamespaceGate

from conftest import Corral, CorralFactory, post_reading_little, wait_until

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
# A system prompt worth a few hundred tokens: what Bob would find reused of Alice's.
SYSTEM = "Alice's notes. " + " ".join(
    f"Fact {i}: the {w} of the valley is kept in a ledger by its clerk." for i, w in
    enumerate(["river", "orchard", "mill", "bridge", "well", "road", "school", "market"]))


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Any]) -> Corral:
    return start_corral_module({
        "defaults": {"ttl": 300, "stop_grace": 5},
        # Alice's stalled stream holds her lease for the whole test, not cut off meanwhile.
        "client_write_timeout": 120,
        "api_keys": [ALICE, BOB], "admin_api_keys": [ADMIN],
        "models": {"m": {"model": str(tiny_models["tiny-a"]), "ctx": 8192, "parallel": 2}},
    }, api_key=ADMIN)


def _child_slots(corral: Corral) -> list[dict[str, Any]]:
    """The child's own GET /slots (its port and key from its command line and environment)."""
    child = psutil.Process(corral.model("m")["pid"])
    argv = child.cmdline()
    port = argv[argv.index("--port") + 1]
    key = child.environ()["LLAMA_API_KEY"]
    slots: list[dict[str, Any]] = httpx.get(f"http://127.0.0.1:{port}/slots",
                                            headers={"Authorization": f"Bearer {key}"}).json()
    return slots


def _alices_stalled_stream(corral: Corral) -> socket.socket:
    """Alice's chat with SYSTEM, streamed to a socket that reads nothing: megabytes of answer,
    so corral holds her lease (blocked writing to her) long after the child generated it all
    and its slot went idle, holding her prompt's KV."""
    body = json.dumps({
        "model": "m", "stream": True, "max_tokens": 3000, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 20,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Tell me a very long story."}]}).encode()
    sock = post_reading_little(corral.url, "/v1/chat/completions", body, "alice-stalled",
                               api_key=ALICE)
    return sock


def test_a_messages_request_waits_for_another_keys_request_and_reuses_none_of_it(corral):
    alice = httpx.Client(base_url=corral.url, timeout=120,
                         headers={"Authorization": f"Bearer {ALICE}"})
    bob = httpx.Client(base_url=corral.url, timeout=120,
                       headers={"Authorization": f"Bearer {BOB}"})
    with alice, bob:
        assert alice.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        sock = _alices_stalled_stream(corral)
        try:
            # Her answer generated whole (every slot idle in the child) while corral still
            # relays it: her lease is held, her KV sits in an idle slot.
            wait_until(lambda: corral.model("m")["in_flight"] == 1, timeout=30)
            wait_until(lambda: all(not s["is_processing"] for s in _child_slots(corral)),
                       timeout=120, interval=0.2)
            assert corral.model("m")["in_flight"] == 1

            answers: list[httpx.Response] = []
            asking = threading.Thread(target=lambda: answers.append(bob.post(
                "/v1/messages", json={
                    "model": "m", "system": SYSTEM, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Tell me a very long story."}]})))
            asking.start()
            # llama-server would put Bob's request on the idle slot most like it (Alice's)
            # and reuse her prompt: corral holds it back while her request is there.
            wait_until(lambda: corral.log_events("prompt_cache.waiting_for_other_callers"),
                       timeout=30)
            assert not answers
        finally:
            sock.close()  # Alice hangs up: her lease goes back
        asking.join(60)
        assert answers, "Bob's request never came back"
        resp = answers[0]
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage.get("cache_read_input_tokens", 0) == 0 and usage["input_tokens"] > 100, usage
        waited = corral.log_events("prompt_cache.waited_for_other_callers")
        assert [e["path"] for e in waited] == ["/v1/messages"], waited
        metrics = corral.http.get("/metrics").text
        assert 'corral_prompt_cache_key_waits_total{model="m"} 1.0' in metrics, metrics
        # Alice's slot was erased before Bob's request went.
        assert corral.log_events("prompt_cache.slot_erased")

        # Bob alone on the child now: his next requests do not wait.
        again = bob.post("/v1/messages", json={
            "model": "m", "system": SYSTEM, "max_tokens": 4,
            "messages": [{"role": "user", "content": "And again."}]})
        assert again.status_code == 200, again.text
        assert len(corral.log_events("prompt_cache.waiting_for_other_callers")) == 1


def _cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    cached: int = resp.json()["usage"]["input_tokens_details"]["cached_tokens"]
    return cached


def test_a_responses_conversation_reuses_its_own_keys_kv_and_nothing_of_anothers(corral):
    """A Responses request went to the child unpinned, and on a child two keys use with
    `cache_prompt: false` (llama-server would have put it on the slot most like it, maybe
    another key's): each turn of a coding agent's session prefilled its whole input again
    (cached_tokens 0 on the second turn, measured). corral now reads its conversation
    (`instructions`, then the `input` items) and pins it to a slot as it does a chat."""
    alice = httpx.Client(base_url=corral.url, timeout=120,
                         headers={"Authorization": f"Bearer {ALICE}"})
    bob = httpx.Client(base_url=corral.url, timeout=120,
                       headers={"Authorization": f"Bearer {BOB}"})
    # A fresh child: whatever is reused below is this test's.
    corral.http.post("/admin/models/m/unload").raise_for_status()
    wait_until(lambda: corral.model("m")["state"] == "stopped", timeout=30)
    ask = {"role": "user", "content": "Tell me a story."}
    with alice, bob:
        first = {"model": "m", "instructions": SYSTEM, "input": [ask], "max_output_tokens": 4}
        turn = alice.post("/v1/responses", json=first)
        assert _cached(turn) == 0
        said = turn.json()["output"]
        # Bob sends the very same instructions: nothing of Alice's is reused for him.
        his = bob.post("/v1/responses", json={**first, "input": [ask]})
        assert _cached(his) == 0
        # Alice's next turn: her whole first turn is reused from her slot.
        again = alice.post("/v1/responses", json={
            **first, "input": [ask, *said, {"role": "user", "content": "Go on."}]})
        assert _cached(again) >= turn.json()["usage"]["input_tokens"] - 1, again.json()["usage"]
        # And Bob's, from his.
        more = bob.post("/v1/responses", json={
            **first, "input": [ask, *his.json()["output"], {"role": "user", "content": "And?"}]})
        assert _cached(more) >= his.json()["usage"]["input_tokens"] - 1, more.json()["usage"]


# -- the gate's rules, in process --------------------------------------------------------------

def test_the_gate_keeps_a_messages_request_apart_from_other_callers_only():
    async def scenario() -> None:
        gate = NamespaceGate()
        # One caller: nothing ever waits, exclusive or not.
        assert gate.enter("a1", "alice", False) is None
        assert gate.enter("a2", "alice", True) is None
        assert gate.enter("a2", "alice", True) is None  # entering twice is once
        # Another caller's request waits while Alice's exclusive one is there.
        b1 = gate.enter("b1", "bob", False)
        assert b1 is not None and not b1.done()
        gate.leave("a2")
        await asyncio.sleep(0)
        assert b1.done()  # Alice's plain request may share the child with Bob's
        # Bob's exclusive request waits for Alice's plain one; Alice's next plain one waits
        # behind it (first come, first served: it would hold Bob back for ever).
        b2 = gate.enter("b2", "bob", True)
        a3 = gate.enter("a3", "alice", False)
        assert b2 is not None and a3 is not None
        # Bob's own plain request joins his at once: it holds nobody back.
        assert gate.enter("b3", "bob", False) is None
        gate.leave("a1")
        assert b2.done() and not a3.done()
        for who in ("b1", "b2", "b3"):
            gate.leave(who)
        assert a3.done()
        gate.leave("a3")

        # A waiter that gives up frees its place for those behind it.
        assert gate.enter("x", "alice", False) is None
        waiting = gate.enter("y", "bob", True)
        behind = gate.enter("z", "carol", False)
        assert waiting is not None and behind is not None
        gate.leave("y")  # cancelled while waiting
        assert waiting.cancelled() and behind.done() and gate.waiting() == 0

    asyncio.run(scenario())
