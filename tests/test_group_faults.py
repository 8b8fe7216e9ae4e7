"""Groups under faults and changes while they run: a member's blue/green switch-over, a
synthesizer that fails after the members spent their tokens, a client that hangs up. Members
are scripted `backend: command` children (tests/scripted_member.py): they start in a blink,
answer a set text after a set delay, and a test can tell what they were asked."""

from __future__ import annotations

import copy
import json
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Corral, sse_lines, wait_until

SCRIPT = Path(__file__).resolve().parent / "scripted_member.py"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def member(name: str, reply: str = "ok", delay: float = 0.0, *more: str) -> dict[str, Any]:
    argv = [sys.executable, "-S", str(SCRIPT), "--port", "${PORT}", "--reply", reply,
            "--delay", str(delay), *more]
    return {"backend": "command", "command": argv, "start_timeout": 20}


def in_background(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_group_keeps_holding_a_member_switched_over_to_a_new_child(start_corral):
    """A member whose settings change while its group runs switches to a new child
    (blue/green): the group's hold moves to the new child, which is then never evicted for
    another model's start while the group still runs (it was: the hold stayed on the old
    child, which stopped, and the new one was the least recently used idle model)."""
    config = {"defaults": {"ttl": 300, "stop_grace": 5}, "policy": {"max_loaded": 3},
              "models": {"slow": member("slow", "Slow", 8), "quick": member("quick", "Quick"),
                         "c": member("c", "C"), "d": member("d", "D")},
              "groups": {"pair": {"models": ["slow", "quick"], "member_timeout": 60}}}
    corral = start_corral(config)
    assert corral.http.post("/admin/models/quick/load").status_code == 200
    run, out = in_background(lambda: corral.http.post("/v1/batch/execute", json={
        "group": "pair", "messages": QUESTION}, timeout=60))
    wait_until(lambda: corral.model("slow")["in_flight"] == 1, timeout=20)
    old_pid = corral.model("quick")["pid"]
    assert corral.model("quick")["held"] == 1

    changed = copy.deepcopy(config)
    changed["models"]["quick"]["command"] += ["--gap", "0.5"]
    attempt = corral.reload_with(changed)
    assert attempt["changes"]["restarted"] == {"quick": ["command"]}, attempt
    wait_until(lambda: corral.model("quick")["pid"] not in (None, old_pid), timeout=20)
    assert corral.log_events("daemon.switched_over")
    assert run.is_alive(), "the slow member should still be answering"
    assert corral.model("quick")["held"] == 1  # the hold followed the model to its new child

    assert corral.chat("c", max_tokens=2).status_code == 200  # loaded: slow, quick, c
    assert corral.chat("d", max_tokens=2).status_code == 200  # one must go: not quick
    assert run.is_alive()
    states = {n: m["state"] for n, m in corral.models().items()}
    assert states["quick"] == "ready" and states["c"] == "stopped", states
    run.join(60)
    assert out[0].status_code == 200 and out[0].json()["complete"], out[0].text
    wait_until(lambda: all(m["held"] == 0 for m in corral.models().values()))


def group_runs(corral: Corral) -> dict[tuple[str, str], float]:
    """corral_group_requests_total by (group, result)."""
    text = corral.http.get("/metrics").text
    return {(s.labels["group"], s.labels["result"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "corral_group_requests_total"}


@pytest.mark.expect_log("proxy.start_failed", "proxy.group_failed", "instance.start_failed",
                        allow=r"scripted failure of start")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_synthesizer_that_fails_is_a_failed_group_run(start_corral, tmp_path: Path,
                                                         stream: bool):
    """The members answered, the synthesizer did not: a 502 with what the members spent,
    and the run is counted failed (the `group` event, corral_group_requests_total), as any
    failed run is. It was counted nowhere: the metric missed every such failure."""
    config = {"defaults": {"ttl": 300, "stop_grace": 5},
              "models": {"a": member("a", "Paris"), "b": member("b", "Paris"),
                         "scribe": member("scribe", "x", 0, "--fail-starts", "1000000",
                                          "--starts", str(tmp_path / "scribe.starts"))},
              "groups": {"council": {"models": ["a", "b"], "type": "consensus",
                                     "synthesizer": "scribe", "expose_as_model": True}}}
    corral = start_corral(config)
    resp = corral.http.post("/v1/chat/completions", json={
        "model": "council", "messages": QUESTION, "stream": stream})
    # Streamed too: nothing went out before the synthesizer's first byte, so a plain 502.
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert "synthesizer scribe failed" in error["message"], error
    assert [m["status"] for m in resp.json()["group"]["responses"]] == ["ok", "ok"]
    record = corral.http.get("/admin/requests", params={"limit": 1}).json()["requests"][0]
    assert (record["model"], record["status"], record["tokens_in"]) == ("council", 502, 6)
    assert group_runs(corral) == {("council", "failed"): 1}


def test_a_backup_a_reload_removed_is_a_member_error_not_the_groups(start_corral):
    """replace_with's backup was removed by a reload while the group ran: the member that
    needed it reports the error and the others' answers come back (not complete). The missing
    backup was raised out of the whole run: a 404 model_not_found for the group."""
    config = {"defaults": {"ttl": 300, "stop_grace": 5},
              "models": {"hang": member("hang", "Late", 30), "slow": member("slow", "Slow", 1),
                         "spare": member("spare", "Spare")},
              "groups": {"g": {"models": ["hang", "slow"], "member_timeout": 4,
                               "fallback": "replace_with", "replace_with": {"hang": "spare"}}}}
    corral = start_corral(config)
    run, out = in_background(lambda: corral.http.post("/v1/batch/execute", json={
        "group": "g", "messages": QUESTION}, timeout=60))
    wait_until(lambda: corral.model("hang")["in_flight"] == 1, timeout=20)
    smaller = copy.deepcopy(config)
    del smaller["models"]["spare"]
    smaller["groups"]["g"] = {"models": ["hang", "slow"], "member_timeout": 4,
                              "fallback": "partial"}
    corral.reload_with(smaller)
    run.join(60)
    resp = out[0]
    assert resp.status_code == 200, resp.text
    result = resp.json()
    assert not result["complete"]
    assert [m["status"] for m in result["responses"]] == ["timeout", "ok"], result
    assert "spare" in result["responses"][0]["error"]
    models = corral.models()
    assert all(m["in_flight"] == 0 and m["held"] == 0 for m in models.values()), models


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_hangs_up_mid_consensus_never_starts_the_synthesizer(start_corral,
                                                                          stream: bool):
    config = {"defaults": {"ttl": 300, "stop_grace": 5},
              "models": {"a": member("a", "Paris", 30), "b": member("b", "Paris", 30),
                         "scribe": member("scribe", "Synthesized")},
              "groups": {"council": {"models": ["a", "b"], "type": "consensus",
                                     "synthesizer": "scribe", "expose_as_model": True}}}
    corral = start_corral(config)
    with pytest.raises(httpx.TimeoutException), \
            httpx.Client(base_url=corral.url, timeout=httpx.Timeout(60, read=1)) as http:
        http.post("/v1/chat/completions", json={
            "model": "council", "messages": QUESTION, "stream": stream})
    # Every member's request is cancelled, the hold given back, nothing left in flight.
    wait_until(lambda: all(m["in_flight"] == 0 and m["held"] == 0 and m["queue"] == 0
                           for m in corral.models().values()), timeout=10)
    assert corral.model("scribe")["state"] == "stopped" and not corral.model("scribe")["starts"]
    record = corral.http.get("/admin/requests", params={"limit": 1}).json()["requests"][0]
    assert record["model"] == "council" and record["status"] == 499, record
    # The run is counted as what it was, beside its 499: it was in no group metric nor event.
    assert group_runs(corral) == {("council", "cancelled"): 1}
    with httpx.stream("GET", corral.url + "/admin/events?kinds=group&last=1",
                      timeout=10) as events:
        run = json.loads(next(line for line in sse_lines(events) if line.startswith("data:"))[5:])
    assert run["result"] == "cancelled", run
    assert [m["status"] for m in run["members"]] == ["cancelled", "cancelled"], run


def test_twenty_runs_of_two_groups_over_the_same_single_slot_members_all_end(start_corral):
    """Two groups that hold the same one-slot members in opposite orders, asked 20 times at
    once: each member request queues for its slot on its own, so no run waits on another's
    hold (no deadlock), and every run answers."""
    config = {"defaults": {"ttl": 300, "stop_grace": 5, "parallel": 1},
              "models": {"a": member("a", "A", 0.05), "b": member("b", "B", 0.05)},
              "groups": {"ab": {"models": ["a", "b"], "expose_as_model": True},
                         "ba": {"models": ["b", "a"], "type": "fan_out",
                                "selector": "longest", "expose_as_model": True}}}
    corral = start_corral(config)
    results: list[httpx.Response] = []

    def ask(group: str) -> None:
        with httpx.Client(base_url=corral.url, timeout=120) as http:
            results.append(http.post("/v1/chat/completions", json={
                "model": group, "messages": QUESTION}))

    threads = [threading.Thread(target=ask, args=("ab" if i % 2 else "ba",), daemon=True)
               for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 20
    # 40 member requests of 50 ms on two slots: well within queue_timeout and max_queue.
    assert [r.status_code for r in results] == [200] * 20, [r.text for r in results]
    assert all(m["in_flight"] == 0 and m["held"] == 0 and m["queue"] == 0
               for m in corral.models().values())
