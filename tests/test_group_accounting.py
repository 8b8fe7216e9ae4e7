"""An exposed group asked as a model is accounted like a model request: its /admin/requests
entry and the token counters of /metrics say the group's summed usage (what its answer's usage
says), under the group's name only (members' calls are not counted again under theirs), with a
time to first token for streams; and a consensus group whose synthesizer's child is killed
mid-stream ends each family's stream in an error each SDK raises, recorded as a failure, after
which the next request gets a fresh child.

Tiny random models answer noise: the tests read the accounting, never the wording."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from conftest import Corral, CorralFactory, gone, tiny_config, wait_until

MAX = 8
LONG = 4000  # the synthesizer writes all of it (ignore_eos): a stream long enough to break
HI = [{"role": "user", "content": "hi"}]
MEMBERS = ("tiny-a", "tiny-b")
# A synthesizer killed mid-stream: its health check may find it gone before its exit is seen;
# the group's failure is logged as such.
pytestmark = pytest.mark.expect_log(
    "instance.health_failed", "proxy.group_failed",
    allow=[r"synthesizer tiny-a2 failed", r"tiny-a2 broke off its stream"])


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b", "tiny-a2"])
    # Every member writes its whole max_tokens, whatever the family asked (the filter reaches
    # the child on every path): a random tiny model may end at its first token, leaving a
    # stream no text and no time to first token. The doomed group's synthesizer needs it for
    # a stream long enough to break.
    for name in MEMBERS:
        config["models"][name]["request"] = {"set": {"ignore_eos": True}}
    config["models"]["tiny-a2"].update(ctx=16384, request={"set": {"ignore_eos": True}})
    exposed = {"expose_as_model": True}
    config["groups"] = {
        "council": {"type": "consensus", "models": list(MEMBERS), "synthesizer": "tiny-a",
                    **exposed},
        "par": {"type": "parallel", "models": list(MEMBERS), **exposed},
        "doomed": {"type": "consensus", "models": ["tiny-b"], "synthesizer": "tiny-a2",
                   **exposed},
    }
    return start_corral_module(config)


def oai(corral: Corral) -> openai.OpenAI:
    return corral.client(timeout=120)


def claude(corral: Corral) -> anthropic.Anthropic:
    return corral.claude(timeout=120)


def record_of(corral: Corral, group: str, endpoint: str, stream: bool) -> dict[str, Any]:
    """The group's latest /admin/requests entry of this kind (tests run one by one)."""
    requests = corral.http.get("/admin/requests?limit=1000").json()["requests"]
    found = [r for r in requests
             if r["model"] == group and r["endpoint"] == endpoint and r["stream"] is stream]
    assert found, requests
    return found[-1]


def counters(corral: Corral) -> dict[str, tuple[float, float]]:
    """Prompt and completion tokens counted under each label of /metrics."""
    text = corral.http.get("/metrics").text

    def value(name: str, model: str) -> float:
        found = re.search(rf'^{name}_total{{model="{re.escape(model)}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    return {model: (value("corral_prompt_tokens", model),
                    value("corral_completion_tokens", model))
            for model in ("council", "par", "doomed", "tiny-a", "tiny-b", "tiny-a2")}


def ask(corral: Corral, group: str, path: str, stream: bool) -> tuple[int, int]:
    """One request to `group` on `path` through its SDK: the tokens its answer's usage says."""
    if path == "/v1/chat/completions":
        if not stream:
            reply = oai(corral).chat.completions.create(model=group, messages=HI,
                                                        max_tokens=MAX)
            assert reply.model == group and reply.usage
            return reply.usage.prompt_tokens, reply.usage.completion_tokens
        usage = [c.usage for c in oai(corral).chat.completions.create(
            model=group, messages=HI, max_tokens=MAX, stream=True) if c.usage]
        assert len(usage) == 1, usage
        return usage[0].prompt_tokens, usage[0].completion_tokens
    if path == "/v1/responses":
        if not stream:
            response = oai(corral).responses.create(model=group, input="hi",
                                                    max_output_tokens=MAX)
        else:
            done = [e for e in oai(corral).responses.create(
                model=group, input="hi", max_output_tokens=MAX, stream=True)
                if e.type == "response.completed"]
            assert len(done) == 1, done
            response = done[0].response
        assert response.model == group and response.usage
        return response.usage.input_tokens, response.usage.output_tokens
    if not stream:
        message = claude(corral).messages.create(model=group, max_tokens=MAX, messages=HI)
    else:
        with claude(corral).messages.stream(model=group, max_tokens=MAX,
                                            messages=HI) as events:
            message = events.get_final_message()
    assert message.model == group
    return message.usage.input_tokens, message.usage.output_tokens


PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", ["council", "par"])
def test_a_group_request_is_accounted_like_a_model_request(corral: Corral, group: str,
                                                           path: str, stream: bool) -> None:
    before = counters(corral)
    tokens_in, tokens_out = ask(corral, group, path, stream)
    assert tokens_in > 0 and tokens_out > 0
    record = record_of(corral, group, path, stream)
    assert record["status"] == 200, record
    assert (record["tokens_in"], record["tokens_out"]) == (tokens_in, tokens_out), record
    if stream:
        assert record["ttft_ms"] is not None and 0 < record["ttft_ms"] <= record["total_ms"]
    after = counters(corral)
    assert after[group] == (before[group][0] + tokens_in, before[group][1] + tokens_out)
    # Counted once: under the group's name, not again under its members'.
    for member in MEMBERS:
        assert after[member] == before[member], member


def test_a_failed_group_stream_counts_what_its_members_spent(corral: Corral) -> None:
    """The record of a group that failed mid-stream: its error status, and the tokens its
    members did spend (their usage in the failure's report)."""
    pid = synthesizer_pid(corral)
    before = counters(corral)
    with pytest.raises(openai.APIError):
        for n, _ in enumerate(oai(corral).chat.completions.create(
                model="doomed", messages=HI, max_tokens=LONG, stream=True)):
            if n == 4:
                os.kill(pid, signal.SIGKILL)
    record = record_of(corral, "doomed", "/v1/chat/completions", True)
    assert record["status"] == 502, record
    assert record["tokens_in"] and record["tokens_out"], record
    after = counters(corral)
    assert after["doomed"][0] == before["doomed"][0] + record["tokens_in"]
    a_fresh_synthesizer_answers(corral, pid)


# -- kill -9 of the synthesizer's child mid-stream, in each family -------------------------


def synthesizer_pid(corral: Corral) -> int:
    assert corral.chat("tiny-a2", max_tokens=1).status_code == 200
    return int(corral.model("tiny-a2")["pid"])


def a_fresh_synthesizer_answers(corral: Corral, killed: int) -> None:
    wait_until(lambda: gone(killed), timeout=15)
    wait_until(lambda: corral.model("tiny-a2")["in_flight"] == 0, timeout=15)
    reply = oai(corral).chat.completions.create(model="doomed", messages=HI, max_tokens=2)
    assert reply.model == "doomed" and reply.model_extra["corral_group"]["complete"]
    pid = corral.model("tiny-a2")["pid"]
    assert pid not in (None, killed) and not gone(pid)
    assert record_of(corral, "doomed", "/v1/chat/completions", False)["status"] == 200


def test_kill_9_mid_stream_the_openai_sdk_raises_on_chat(corral: Corral) -> None:
    pid = synthesizer_pid(corral)
    seen: list[Any] = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in oai(corral).chat.completions.create(
                model="doomed", messages=HI, max_tokens=LONG, stream=True):
            seen.append(chunk)
            if len(seen) == 4:
                os.kill(pid, signal.SIGKILL)
    assert "synthesizer tiny-a2 failed" in str(raised.value), raised.value
    assert not any(c.choices and c.choices[0].finish_reason for c in seen), seen[-3:]
    assert record_of(corral, "doomed", "/v1/chat/completions", True)["status"] == 502
    a_fresh_synthesizer_answers(corral, pid)


def test_kill_9_mid_stream_the_openai_sdk_raises_on_responses(corral: Corral) -> None:
    pid = synthesizer_pid(corral)
    seen: list[Any] = []
    with pytest.raises(openai.APIError) as raised:
        for event in oai(corral).responses.create(model="doomed", input="hi", stream=True,
                                                  max_output_tokens=LONG):
            seen.append(event)
            if len(seen) == 6:  # the head's four, then text
                os.kill(pid, signal.SIGKILL)
    assert "synthesizer tiny-a2 failed" in str(raised.value), raised.value
    failed = [e for e in seen if e.type == "response.failed"]
    assert len(failed) == 1 and failed[0].response.id == seen[0].response.id, seen[-3:]
    assert failed[0].response.model == "doomed"
    assert "response.completed" not in {e.type for e in seen}
    assert record_of(corral, "doomed", "/v1/responses", True)["status"] == 502
    a_fresh_synthesizer_answers(corral, pid)


def test_kill_9_mid_stream_the_anthropic_sdk_raises(corral: Corral) -> None:
    pid = synthesizer_pid(corral)
    seen: list[str] = []
    with pytest.raises(anthropic.APIError) as raised, claude(corral).messages.stream(
            model="doomed", max_tokens=LONG, messages=HI) as stream:
        for event in stream:
            seen.append(event.type)
            if len(seen) == 5:  # message_start, content_block_start, ping, then text
                os.kill(pid, signal.SIGKILL)
    assert "synthesizer tiny-a2 failed" in str(raised.value), raised.value
    assert "message_stop" not in seen, seen
    assert record_of(corral, "doomed", "/v1/messages", True)["status"] == 502
    a_fresh_synthesizer_answers(corral, pid)


LAST_EVENT = {"/v1/chat/completions": b"data: [DONE]", "/v1/responses": b"response.completed",
              "/v1/messages": b"message_stop"}


@pytest.mark.parametrize("path", PATHS)
def test_a_client_that_hangs_up_after_the_last_event_got_a_200(corral: Corral,
                                                               path: str) -> None:
    """As Codex hangs up once response.completed is in: the group's answer was whole."""
    body: dict[str, Any] = {"model": "par", "stream": True, "max_tokens": MAX, "messages": HI}
    if path == "/v1/responses":
        body = {"model": "par", "stream": True, "max_output_tokens": MAX, "input": "hi"}
    before = len(corral.http.get("/admin/requests?limit=1000").json()["requests"])
    raw = b""
    with corral.http.stream("POST", path, json=body) as response:
        for chunk in response.iter_bytes():
            raw += chunk
            if LAST_EVENT[path] in raw:
                break
    assert LAST_EVENT[path] in raw, raw[-300:]

    def recorded() -> list[dict[str, Any]]:
        requests = corral.http.get("/admin/requests?limit=1000").json()["requests"]
        return [r for r in requests[before:] if r["model"] == "par" and r["endpoint"] == path]

    record = wait_until(recorded, timeout=15)[-1]
    assert record["status"] == 200 and record["tokens_out"], record


@pytest.mark.parametrize("path", ["/v1/batch/execute", "/v1/chain/execute"])
def test_batch_and_chain_execute_are_counted_under_the_group(corral: Corral, path: str) -> None:
    """The group endpoints of corral's own are accounted like a group asked as a model."""
    before = counters(corral)
    resp = corral.http.post(path, json={
        "group": "par", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Say hi."}]})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, usage
    entry = record_of(corral, "par", path, stream=False)
    assert (entry["status"], entry["tokens_in"], entry["tokens_out"]) == (
        200, usage["prompt_tokens"], usage["completion_tokens"]), entry
    after = counters(corral)
    assert after["par"][0] - before["par"][0] == usage["prompt_tokens"]
    assert after["par"][1] - before["par"][1] == usage["completion_tokens"]
    assert after["tiny-a"] == before["tiny-a"] and after["tiny-b"] == before["tiny-b"]
