"""Model groups over real llama-server children: parallel, chain, fan-out, consensus,
fallbacks with members made to fail for real, cancellation, and the policy around them."""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import httpx
import openai
import pytest

from conftest import tiny_config, wait_until

HI = [{"role": "user", "content": "hi"}]


def grouped(tiny_models, groups: dict[str, Any], names: list[str] | None = None,
            **overrides: Any) -> dict[str, Any]:
    config = tiny_config(tiny_models, names or ["tiny-a", "tiny-b", "tiny-c", "tiny-a2"],
                         **overrides)
    config["groups"] = groups
    return config


def with_smol(config: dict[str, Any], smol_model) -> dict[str, Any]:
    config["models"]["smol"] = {"model": str(smol_model), "ctx": 2048}
    return config


def batch(corral, group: str, **body: Any) -> httpx.Response:
    return corral.http.post("/v1/batch/execute",
                            json={"group": group, "messages": HI, "temperature": 0, **body})


def cancelled_in_child(corral, model: str) -> bool:
    lines = corral.http.get(f"/admin/models/{model}/logs", params={"lines": 80}).json()["lines"]
    return any("cancel task" in line for line in lines)


def test_parallel_group_runs_members_concurrently(start_corral, tiny_models):
    names = ["tiny-a", "tiny-b", "tiny-c"]
    corral = start_corral(grouped(tiny_models, {"core": {"models": names, "type": "parallel"}}))
    for name in names:
        corral.http.post(f"/admin/models/{name}/load")
    outcome: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: outcome.append(
        batch(corral, "core", max_tokens=4000, ignore_eos=True)))
    worker.start()
    # Concurrent, seen directly: every member has its request in flight at the same moment
    # (one after another, at most one would). One reading of all three per poll (three
    # readings straddled a member's start or end: 1,500 tokens took only 0.7 s here).
    def in_flight() -> list[int]:
        models = corral.models()
        return [models[n]["in_flight"] for n in names]
    all_busy = wait_until(lambda: in_flight() == [1, 1, 1], timeout=20, interval=0.02)
    worker.join()
    assert all_busy
    resp = outcome[0]
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert (result["group"], result["type"], result["complete"]) == ("core", "parallel", True)
    members = result["responses"]
    assert [m["model"] for m in members] == names
    assert all(m["status"] == "ok" and m["content"] and m["error"] is None for m in members)
    assert all(m["usage"]["completion_tokens"] == 4000 for m in members)
    latencies = [m["latency_ms"] for m in members]
    # The group takes as long as its slowest member, not the sum of them.
    assert max(latencies) <= result["wall_ms"] < sum(latencies), (result["wall_ms"], latencies)


def test_chain_feeds_each_step_the_previous_output(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"pipe": {
        "models": ["tiny-a", "tiny-b", "tiny-c"], "type": "chain"}}))
    # ignore_eos: a random tiny model may end at its first token, and a step fed "" would
    # show nothing of what the chain carries.
    resp = corral.http.post("/v1/chain/execute", json={
        "group": "pipe", "messages": HI, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200
    result = resp.json()
    steps = result["steps"]
    assert [s["model"] for s in steps] == ["tiny-a", "tiny-b", "tiny-c"]
    assert steps[0]["input"] == "hi"
    assert all(s["usage"]["completion_tokens"] == 12 for s in steps), steps
    assert steps[1]["input"] == steps[0]["content"]  # the second step saw the first's text
    assert steps[2]["input"] == steps[1]["content"]
    assert result["final"] == steps[2]["content"] and result["complete"]
    assert all(s["latency_ms"] > 0 and s["usage"]["prompt_tokens"] > 0 for s in steps)

    shaped = corral.http.post("/v1/chain/execute", json={
        "models": ["tiny-b", "tiny-a"], "messages": HI, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "template": "Q: {input}\nDraft: {previous}\nImprove it."}).json()
    first, second = shaped["steps"]
    assert second["input"] == f"Q: hi\nDraft: {first['content']}\nImprove it."
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]

    bad = corral.http.post("/v1/chain/execute", json={
        "models": ["tiny-a", "tiny-b"], "messages": HI, "template": "{nope}"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_template"


def test_fan_out_majority_picks_the_answer_most_members_gave(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"vote": {
        "models": ["tiny-b", "tiny-a", "tiny-a2"], "type": "fan_out", "selector": "majority"}}))
    # ignore_eos: two random models that each end at their first token would agree on "".
    result = batch(corral, "vote", max_tokens=16, ignore_eos=True).json()
    b, a, a2 = (m["content"] for m in result["responses"])
    assert a == a2 != b  # tiny-a2 has tiny-a's weights: at temperature 0, the same answer
    assert result["selected"]["index"] == 1 and result["selected"]["model"] == "tiny-a"
    assert "2 of 3" in result["selected"]["reason"]
    assert result["final"] == a


def test_fan_out_judge_picks_a_valid_answer(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"judged": {
        "models": ["tiny-a", "tiny-b"], "type": "fan_out", "selector": "judge",
        "judge": "tiny-c"}}))
    result = batch(corral, "judged", max_tokens=16).json()
    selected = result["selected"]
    assert selected["index"] in (0, 1)
    assert selected["reason"].startswith("judge tiny-c picked answer ")
    assert result["final"] == result["responses"][selected["index"]]["content"]
    # The judge's tokens are part of the bill.
    member_tokens = sum(m["usage"]["total_tokens"] for m in result["responses"])
    assert result["usage"]["total_tokens"] > member_tokens


def test_fan_out_longest_and_shortest(start_corral, tiny_models):
    names = ["tiny-a", "tiny-b", "tiny-c"]
    orders = list(itertools.permutations(names))
    # Every order of the members, for both selectors: the test then asks the group in which
    # the expected winner sits in the middle, so no "take the first/last" shortcut passes.
    groups = {f"{sel}-{i}": {"models": list(order), "type": "fan_out", "selector": sel}
              for sel in ("longest", "shortest") for i, order in enumerate(orders)}
    corral = start_corral(grouped(tiny_models, groups))

    def answers(max_tokens: int) -> dict[str, str]:
        """What each member answers on its own (temperature 0: the same answer in a group)."""
        return {name: corral.chat(name, "hi", max_tokens=max_tokens, temperature=0,
                                  ignore_eos=True).json()["choices"][0]["message"]["content"]
                for name in names}

    # A byte-level vocabulary makes lengths close: find a length where all three differ.
    for max_tokens in range(24, 64):
        alone = answers(max_tokens)
        lengths = {name: len(text) for name, text in alone.items()}
        if len(set(lengths.values())) == 3:
            break
    else:
        raise AssertionError(f"no max_tokens gave three different answer lengths: {lengths}")
    for selector, pick in (("longest", max), ("shortest", min)):
        expected = pick(names, key=lengths.__getitem__)
        i = next(i for i, order in enumerate(orders) if order[1] == expected)
        result = batch(corral, f"{selector}-{i}", max_tokens=max_tokens, ignore_eos=True).json()
        assert [m["model"] for m in result["responses"]] == list(orders[i])
        assert {m["model"]: m["content"] for m in result["responses"]} == alone
        selected = result["selected"]
        assert (selected["index"], selected["model"]) == (1, expected), (selected, lengths)
        assert result["final"] == alone[expected]
        assert selected["reason"] == f"{selector} answer ({lengths[expected]} chars)"


def test_fan_out_first_ok_cancels_the_slower_members(start_corral, tiny_models, smol_model):
    corral = start_corral(with_smol(grouped(tiny_models, {"race": {
        "models": ["smol", "tiny-a"], "type": "fan_out", "selector": "first_ok"}},
        names=["tiny-a"]), smol_model))
    corral.http.post("/admin/models/smol/load")
    result = batch(corral, "race", max_tokens=400, ignore_eos=True).json()
    smol, tiny = result["responses"]
    assert tiny["status"] == "ok" and result["selected"]["model"] == "tiny-a"
    assert smol["status"] == "cancelled"
    wait_until(lambda: cancelled_in_child(corral, "smol"), timeout=10)


def test_consensus_streams_the_synthesis_through_the_sdk(start_corral, smol_model):
    smol = {"model": str(smol_model), "ctx": 2048}
    corral = start_corral({
        "models": {"smol-a": smol, "smol-b": dict(smol)},
        "groups": {"council": {"models": ["smol-a", "smol-b"], "type": "consensus",
                               "synthesizer": "smol-a", "expose_as_model": True}}})
    assert "council" in {m.id for m in corral.client().models.list()}
    stream = corral.client().chat.completions.create(
        model="council", stream=True, temperature=0, max_tokens=40,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert {c.model for c in chunks} == {"council"} and len({c.id for c in chunks}) == 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3  # streamed
    details = chunks[-1].model_extra["corral_group"]
    assert details["type"] == "consensus" and details["complete"]
    assert [m["status"] for m in details["responses"]] == ["ok", "ok"]
    assert all("Paris" in m["content"] for m in details["responses"])
    assert details["final"] == text
    assert details["synthesis"] == {
        "model": "smol-a", "reason": "smol-a wrote the final answer from the 2 member answers"}


def test_exposed_parallel_group_answers_chat_completions(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {
        "core": {"models": ["tiny-a", "tiny-b"], "expose_as_model": True},
        "hidden": {"models": ["tiny-a", "tiny-b"]}}))
    listed = {m.id: m for m in corral.client().models.list()}
    assert listed["core"].model_extra["group"] == {"type": "parallel",
                                                   "models": ["tiny-a", "tiny-b"]}
    assert "hidden" not in listed
    reply = corral.client().chat.completions.create(model="core", messages=HI, max_tokens=8)
    text = reply.choices[0].message.content
    assert text.startswith("### tiny-a\n") and "\n\n### tiny-b\n" in text
    details = reply.model_extra["corral_group"]
    assert [m["model"] for m in details["responses"]] == ["tiny-a", "tiny-b"]
    assert reply.usage.total_tokens == details["usage"]["total_tokens"] > 0

    streamed = list(corral.client().chat.completions.create(
        model="core", messages=HI, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert streamed[-1].model_extra["corral_group"]["complete"]

    with_completions = corral.http.post("/v1/completions", json={"model": "core", "prompt": "x"})
    assert with_completions.status_code == 400
    with openai_error(openai.NotFoundError):
        corral.client().chat.completions.create(model="hidden", messages=HI)


@contextlib.contextmanager
def openai_error(kind: type[Exception]) -> Any:
    try:
        yield
    except kind:
        return
    raise AssertionError(f"expected {kind.__name__}")


def test_bad_group_requests(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"core": {"models": ["tiny-a", "tiny-b"]}}))
    unknown = corral.http.post("/v1/batch/execute", json={"group": "nope", "messages": HI})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "group_not_found"
    assert "core" in unknown.json()["error"]["message"]
    no_messages = corral.http.post("/v1/batch/execute", json={"group": "core"})
    assert no_messages.status_code == 400
    no_models = corral.http.post("/v1/chain/execute", json={"messages": HI})
    assert no_models.status_code == 400
    unknown_member = corral.http.post("/v1/chain/execute",
                                      json={"models": ["tiny-a", "ghost"], "messages": HI})
    assert unknown_member.status_code == 404


# -- fallbacks, each with a member failing for real ---------------------------------------------

def broken_config(tiny_models, tmp_path, **group: Any) -> dict[str, Any]:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    config = grouped(tiny_models, {"g": {"models": ["tiny-a", "broken", "tiny-b"], **group}})
    config["models"]["broken"] = {"model": str(broken)}
    return config


@pytest.mark.expect_log("proxy.start_failed", "proxy.group_failed")
def test_strict_fails_with_every_members_status(start_corral, tiny_models, tmp_path):
    corral = start_corral(broken_config(tiny_models, tmp_path, fallback="strict"))
    resp = batch(corral, "g", max_tokens=4)
    assert resp.status_code == 502
    body = resp.json()
    assert body["error"]["code"] == "group_failed" and "broken" in body["error"]["message"]
    statuses = {m["model"]: m["status"] for m in body["group"]["responses"]}
    assert statuses == {"tiny-a": "ok", "broken": "error", "tiny-b": "ok"}
    assert "exited with code" in body["group"]["responses"][1]["error"]


@pytest.mark.expect_log("proxy.start_failed")
def test_partial_returns_what_completed(start_corral, tiny_models, tmp_path):
    corral = start_corral(broken_config(tiny_models, tmp_path, fallback="partial"))
    result = batch(corral, "g", max_tokens=4).json()
    assert result["complete"] is False
    assert [m["status"] for m in result["responses"]] == ["ok", "error", "ok"]
    assert result["responses"][1]["content"] is None


@pytest.mark.expect_log("proxy.start_failed")
def test_replace_with_runs_the_backup(start_corral, tiny_models, tmp_path):
    corral = start_corral(broken_config(tiny_models, tmp_path, fallback="replace_with",
                                        replace_with={"broken": "tiny-c"}))
    # ignore_eos: the stand-in's answer has text even where a random model would end first.
    result = batch(corral, "g", max_tokens=4, ignore_eos=True).json()
    assert result["complete"] is True
    stand_in = result["responses"][1]
    assert (stand_in["status"], stand_in["model"], stand_in["replaced"]) == (
        "replaced", "tiny-c", "broken")
    assert stand_in["content"] and "broken failed" in stand_in["error"]


# A health check may find the killed child gone before its exit is seen.
@pytest.mark.expect_log("proxy.upstream_failed", "instance.health_failed")
def test_retry_once_survives_a_member_killed_mid_request(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"g": {
        "models": ["tiny-a", "tiny-b"], "fallback": "retry_once"}}))
    corral.http.post("/admin/models/tiny-b/load")
    victim = corral.model("tiny-b")["pid"]
    killer = corral.kill_once_busy("tiny-b")
    result = batch(corral, "g", max_tokens=3000, ignore_eos=True).json()
    killer.join()
    a, b = result["responses"]
    assert a["status"] == "ok"
    assert b["status"] == "retried" and "first attempt failed" in b["error"], b
    assert b["usage"]["completion_tokens"] == 3000 and result["complete"]
    assert corral.model("tiny-b")["pid"] != victim


def test_member_timeout_cancels_the_slow_member(start_corral, tiny_models, smol_model):
    config = with_smol(grouped(tiny_models, {"g": {
        "models": ["tiny-a", "smol"], "fallback": "partial", "member_timeout": 1.5}},
        names=["tiny-a"]), smol_model)
    # smol's own filter asks it for most of its context: more than even a many-core machine
    # writes in the 1.5 s (the group's 400 may fit in it there), while tiny-a writes the
    # group's 400 in a fraction of it.
    config["models"]["smol"]["request"] = {"set": {"max_tokens": 1900}}
    corral = start_corral(config)
    corral.http.post("/admin/models/smol/load")
    result = batch(corral, "g", max_tokens=400, ignore_eos=True).json()
    tiny, smol = result["responses"]
    assert tiny["status"] == "ok"
    assert smol["status"] == "timeout" and "1.5s" in smol["error"]
    # Cut at its timeout: not before, and well before its 1,900 tokens would have been done.
    assert 1400 < smol["latency_ms"] < 6000, smol["latency_ms"]
    assert result["complete"] is False
    wait_until(lambda: cancelled_in_child(corral, "smol"), timeout=10)
    wait_until(lambda: corral.model("smol")["in_flight"] == 0, timeout=10)


def test_client_disconnect_cancels_every_member(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"g": {"models": ["tiny-a", "tiny-b"]}}))
    corral.http.post("/admin/models/tiny-a/load")
    corral.http.post("/admin/models/tiny-b/load")
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(corral.url + "/v1/batch/execute", timeout=1, json={
            "group": "g", "messages": HI, "max_tokens": 6000, "ignore_eos": True})
    for name in ("tiny-a", "tiny-b"):
        wait_until(lambda name=name: cancelled_in_child(corral, name), timeout=10)
        wait_until(lambda name=name: corral.model(name)["in_flight"] == 0, timeout=10)


# -- policy --------------------------------------------------------------------------------------

@pytest.mark.expect_log("proxy.request_failed")
def test_group_larger_than_max_loaded_is_refused_clearly(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"core": {
        "models": ["tiny-a", "tiny-b", "tiny-c"]}}, policy={"max_loaded": 2}))
    corral.chat("tiny-a", max_tokens=1)
    resp = batch(corral, "core", max_tokens=2)
    assert resp.status_code == 503
    message = resp.json()["error"]["message"]
    assert "needs 3 models" in message and "max_loaded is 2" in message
    assert "tiny-a, tiny-b, tiny-c" in message and "loaded now: tiny-a" in message
    assert corral.model("tiny-b")["state"] == "stopped"  # nothing thrashed


def test_group_members_are_not_evicted_for_each_other(start_corral, tiny_models):
    # The cold member runs first, and the loaded member is the least recently used model:
    # without holding members together, tiny-b's start would evict tiny-a, then tiny-a's
    # restart would evict something else.
    corral = start_corral(grouped(tiny_models, {"pair": {"models": ["tiny-b", "tiny-a"]}},
                                  policy={"max_loaded": 2}))
    corral.chat("tiny-a", max_tokens=1)
    corral.chat("tiny-c", max_tokens=1)  # loaded: a (least recent), c; the group needs b and a
    result = batch(corral, "pair", max_tokens=4).json()
    assert result["complete"]
    states = {n: m["state"] for n, m in corral.models().items()}
    assert states["tiny-a"] == states["tiny-b"] == "ready" and states["tiny-c"] == "stopped"
    assert corral.model("tiny-a")["starts"] == 1  # held for the group, never evicted for b


def test_pinned_group_loads_at_start_and_is_exempt_from_ttl_and_lru(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"core": {
        "models": ["tiny-a", "tiny-b"], "pinned": True}},
        defaults={"ttl": 1}, policy={"max_loaded": 3}))
    wait_until(lambda: all(corral.model(n)["state"] == "ready" for n in ("tiny-a", "tiny-b")))
    pids = {n: corral.model(n)["pid"] for n in ("tiny-a", "tiny-b")}
    assert all(corral.model(n)["pinned"] for n in pids)
    corral.chat("tiny-c", max_tokens=1)
    corral.chat("tiny-a2", max_tokens=1)  # over max_loaded: evicts tiny-c, never a pinned one
    assert corral.model("tiny-c")["state"] == "stopped"
    # TTL still applies to the rest: once it has stopped tiny-a2 (used after the pinned
    # ones), the pinned models are past their TTL too, and still running.
    wait_until(lambda: corral.model("tiny-a2")["state"] == "stopped", timeout=15)
    assert {n: corral.model(n)["pid"] for n in pids} == pids
    assert all(corral.model(n)["state"] == "ready" for n in pids)


def test_chain_longer_than_max_loaded_runs_step_by_step(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"pipe": {
        "models": ["tiny-a", "tiny-b", "tiny-c"], "type": "chain"}}, policy={"max_loaded": 2}))
    result = corral.http.post("/v1/chain/execute", json={
        "group": "pipe", "messages": HI, "max_tokens": 4}).json()
    assert result["complete"] and [s["status"] for s in result["steps"]] == ["ok"] * 3
    assert corral.model("tiny-a")["state"] == "stopped"  # evicted for tiny-c, its step done


@pytest.mark.expect_log("proxy.group_failed")
def test_a_member_refused_by_its_child_fails_fast(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {"g": {
        "models": ["tiny-a", "tiny-b"], "fallback": "partial"}}))
    corral.http.post("/admin/models/tiny-a/load")
    corral.http.post("/admin/models/tiny-b/load")
    # An unparsable grammar: each child answers HTTP 400 at once. It is alive, so no time
    # goes to waiting for it to exit.
    resp = batch(corral, "g", max_tokens=4, grammar="root ::= (")
    assert resp.status_code == 502
    members = resp.json()["group"]["responses"]
    assert all("answered HTTP 400" in m["error"] for m in members)
    assert all(m["latency_ms"] < 450 for m in members), members  # the old wait was 500
    assert all(corral.model(n)["state"] == "ready" for n in ("tiny-a", "tiny-b"))


@pytest.mark.expect_log("proxy.request_failed")
def test_capacity_check_counts_other_groups_pinned_models(start_corral, tiny_models):
    corral = start_corral(grouped(tiny_models, {
        "held": {"models": ["tiny-a"], "pinned": True},
        "pair": {"models": ["tiny-b", "tiny-c"]}}, policy={"max_loaded": 2}))
    wait_until(lambda: corral.model("tiny-a")["state"] == "ready")
    resp = batch(corral, "pair", max_tokens=2)
    assert resp.status_code == 503
    assert "and 1 kept loaded (tiny-a) but max_loaded is 2" in resp.json()["error"]["message"]
