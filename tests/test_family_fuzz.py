"""Hostile clients and hostile members on /v1/responses and /v1/messages, to a single model
(a real llama-server child and a command child) and to an exposed group whose members speak
each family (chat, `api: responses`, `api: messages`).

A client's body, whatever its JSON: an answer or a 4xx in the OpenAI error shape naming the
field, never a 500 (and never a traceback in the daemon's log, which the teardown reads).
A member's answer, whatever its shape in its family (content not a list, usage strings, a
tool call's input not an object, a giant or endless answer, an event stream where JSON was
asked): that member's error in the group's report, the others' answer to the client. A
member's words that look like corral's own events reach the client as words."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from conftest import Corral, tiny_config, wait_until

FAKE = Path(__file__).parent / "family_upstream.py"
SCRIPTED = Path(__file__).parent / "scripted_member.py"
FORGED = __import__("family_upstream").FORGED
STEADY = "steady answer"
PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}
# What a hostile body may get: an answer, or a refusal that is the client's to fix. A 404 is
# a path a command child does not serve... never here; 413 a body past max_body_mb.
ANSWERED = {200, 400, 413, 422}

pytestmark = pytest.mark.expect_log("proxy.group_failed", "proxy.request_failed",
                                    "proxy.upstream_failed", "proxy.child_error")

FUZZ = settings(deadline=None, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


def fake(log: Path, api: str | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"backend": "command", "health": "none", "memory_mb": 10,
                             "capabilities": ["chat", "vision"],
                             "command": [sys.executable, "-S", str(FAKE), "--port", "${PORT}",
                                         "--log", str(log)]}
    if api:
        model["api"] = api
    return model


@pytest.fixture(scope="module")
def corral(start_corral_module, tiny_models, tmp_path_factory) -> Corral:
    logs = tmp_path_factory.mktemp("hostile-family-logs")
    config = tiny_config(tiny_models, ["tiny-a"], max_answer_mb=1)
    config["models"]["tiny-a"]["ctx"] = 1024
    config["models"].update({
        "fam-chat": fake(logs / "chat.jsonl"),
        "fam-resp": fake(logs / "resp.jsonl", api="responses"),
        "fam-msg": fake(logs / "msg.jsonl", api="messages"),
        "steady": {"backend": "command", "health": "none", "memory_mb": 10,
                   "command": [sys.executable, "-S", str(SCRIPTED), "--port", "${PORT}",
                               "--reply", STEADY]},
    })
    members = ["fam-chat", "fam-resp", "fam-msg"]
    config["groups"] = {
        "fam": {"type": "parallel", "models": members, "expose_as_model": True},
        "hostile": {"type": "parallel", "models": ["steady", *members],
                    "fallback": "partial", "member_timeout": 4, "expose_as_model": True},
        # Members a client gives up on (they never answer "hostile:endless").
        "stuck": {"type": "parallel", "models": ["steady", "fam-resp", "fam-msg"],
                  "member_timeout": 120, "expose_as_model": True},
        # A synthesizer whose stream a test sets (hostile:stream-*), streamed to the client.
        "synth": {"type": "consensus", "models": ["steady"], "synthesizer": "fam-chat",
                  "member_timeout": 10, "expose_as_model": True},
        # Members that speak Responses and Messages, one chosen: its text and tool calls.
        "mirror": {"type": "fan_out", "models": ["fam-resp", "fam-msg"],
                   "selector": "first_ok", "expose_as_model": True},
    }
    return start_corral_module(config)


def check(resp: httpx.Response) -> None:
    """An answer, or a 4xx in the OpenAI error shape; a 400 of corral's names its field."""
    event(f"HTTP {resp.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    assert resp.status_code in ANSWERED, (resp.status_code, resp.text[:500])
    if resp.status_code == 200:
        return
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert set(error) >= {"message", "type", "code", "param"}, error
    if error["code"] == "invalid_request":
        assert isinstance(error["param"], str) and error["param"], error


# -- strategies ---------------------------------------------------------------------------------

leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**63)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
KEYS = st.sampled_from(["type", "text", "role", "content", "name", "arguments", "call_id",
                        "output", "image_url", "source", "input", "id", "tool_use_id", "url",
                        "data", "media_type", "schema", "format"]) | st.text(max_size=6)
junk = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12)
def _nest(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = [value]
    return value


DEEP_60, DEEP_70 = _nest(60), _nest(70)  # within corral's depth limit, and past it
# Deep and huge values: past the depth corral parses, and strings far past any prompt.
odd = st.sampled_from([
    {"a": DEEP_60}, {"a": DEEP_70},
    "x" * 200_000, ["y" * 100] * 2000, 2**80, -1, 1e308])
anything = junk | odd


def maybe(fields: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def typed(names: list[str]) -> st.SearchStrategy[Any]:
    return st.sampled_from(names) | anything


TEXT = st.text(max_size=8)
r_part = maybe({"type": typed(["input_text", "output_text", "text", "input_image",
                               "input_file", "refusal"]),
                "text": TEXT | anything, "image_url": anything, "detail": anything})
r_item = maybe({"type": typed(["message", "function_call", "function_call_output",
                               "reasoning", "item_reference", "input_image", "web_search_call"]),
                "role": typed(["user", "assistant", "system", "developer"]),
                "content": TEXT | st.lists(r_part | anything, max_size=3) | anything,
                "name": TEXT | anything, "arguments": anything, "call_id": TEXT | anything,
                "id": anything, "output": TEXT | st.lists(r_part, max_size=2) | anything})
r_tool = maybe({"type": typed(["function", "web_search", "custom", "local_shell"]),
                "name": TEXT | anything, "parameters": anything, "description": anything,
                "strict": anything})
RESPONSES = {
    "input": TEXT | st.lists(r_item | anything, max_size=4) | anything,
    "instructions": TEXT | anything,
    "tools": st.lists(r_tool | anything, max_size=2) | anything,
    "tool_choice": typed(["auto", "none", "required"])
    | maybe({"type": typed(["function"]), "name": anything}),
    "text": maybe({"format": maybe({"type": typed(["json_schema", "json_object", "text"]),
                                    "schema": anything, "name": anything,
                                    "strict": anything})}) | anything,
    "max_output_tokens": anything, "stream": st.booleans() | anything,
    "temperature": anything, "parallel_tool_calls": anything,
    "previous_response_id": anything, "reasoning": anything, "metadata": anything,
}
m_source = maybe({"type": typed(["base64", "url", "file"]), "data": anything,
                  "url": anything, "media_type": anything})
m_block = maybe({"type": typed(["text", "image", "tool_use", "tool_result", "thinking",
                                "document", "server_tool_use"]),
                 "text": TEXT | anything, "source": m_source | anything,
                 "id": TEXT | anything, "name": TEXT | anything, "input": anything,
                 "tool_use_id": TEXT | anything, "is_error": anything,
                 "content": TEXT | st.lists(maybe({"type": typed(["text", "image"]),
                                                   "text": anything}), max_size=2) | anything})
m_turn = maybe({"role": typed(["user", "assistant", "system"]),
                "content": TEXT | st.lists(m_block | anything, max_size=3) | anything})
m_tool = maybe({"type": st.none() | typed(["custom", "bash_20250124", "web_search_20250305"]),
                "name": TEXT | anything, "input_schema": anything, "description": anything})
MESSAGES = {
    "messages": st.lists(m_turn | anything, max_size=3) | anything,
    "system": TEXT | st.lists(maybe({"type": typed(["text"]), "text": anything,
                                     "cache_control": anything}), max_size=2) | anything,
    "tools": st.lists(m_tool | anything, max_size=2) | anything,
    "tool_choice": maybe({"type": typed(["auto", "any", "tool", "none"]),
                          "name": anything}) | anything,
    "stop_sequences": st.lists(TEXT, max_size=2) | anything,
    "max_tokens": anything, "stream": st.booleans() | anything, "top_k": anything,
    "thinking": anything, "metadata": anything,
}
# A single model (a real llama-server child, a command child) and a group of all families.
TARGETS = st.sampled_from(["tiny-a", "fam-chat", "fam"])


def tame(body: dict[str, Any], limit: str) -> dict[str, Any]:
    """Whatever else is random, a request that is served generates two tokens."""
    value = body.get(limit)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        body[limit] = 2
    return body


def post(corral: Corral, family: str, body: dict[str, Any]) -> httpx.Response:
    return corral.http.post(PATHS[family], json=body, timeout=60)


VALID = {"responses": {"input": [{"role": "user", "content": [
    {"type": "input_text", "text": "hi"}]}]},
    "messages": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}}


@st.composite
def near_valid(draw: st.DrawFn, family: str) -> dict[str, Any]:
    """A valid body with one or two fields drawn: a wholly random one rarely gets past the
    first check to the translation and the members."""
    fields = RESPONSES if family == "responses" else MESSAGES
    body = dict(VALID[family])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2,
                              unique=True)):
        body[name] = draw(fields[name])
    return body


@settings(FUZZ, max_examples=400)
@given(model=TARGETS, body=maybe(RESPONSES) | near_valid("responses"))
def test_hostile_responses_bodies(corral: Corral, model: str, body: dict[str, Any]) -> None:
    check(post(corral, "responses", tame({**body, "model": model}, "max_output_tokens")))


@settings(FUZZ, max_examples=400)
@given(model=TARGETS, body=maybe(MESSAGES) | near_valid("messages"))
def test_hostile_messages_bodies(corral: Corral, model: str, body: dict[str, Any]) -> None:
    check(post(corral, "messages", tame({**body, "model": model}, "max_tokens")))


# Bodies that each got a 500 (a traceback in translate.py or a child's 500 relayed as a 502)
# before the family shapes were checked; each names the field that is wrong.
KNOWN = [
    ("responses", {"input": [{"role": "assistant", "content": [
        {"type": "output_text", "text": 5}]}]}, "input[0].content[0].text"),
    ("responses", {"input": "hi", "tools": 5}, "tools"),
    ("responses", {"input": [{"type": "function_call_output", "call_id": "c",
                              "output": [{"type": "input_text", "text": None}, 7]}]},
     "input[0].output[1]"),
    ("responses", {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input[0].name"),
    ("responses", {"input": "hi", "instructions": ["be", "brief"]}, "instructions"),
    ("responses", {"input": "hi", "text": {"format": {"type": "json_schema",
                                                      "schema": "x"}}}, "text.format.schema"),
    ("responses", {"input": "hi", "text": "json"}, "text"),
    ("responses", {"input": [{"role": "user", "content": None}]}, "input[0].content"),
    ("messages", {"messages": [], "tools": 5873}, "tools"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ("messages", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("messages", {"messages": [{"role": "user", "content": "hi"}],
                  "system": [{"type": "text", "text": 5}]}, "system[0].text"),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "w", "input": "x"}]}]},
     "messages[0].content[0].input"),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text",
                                                                 "text": ["x"]}]}]}]},
     "messages[0].content[0].content[0].text"),
    ("messages", {"messages": [{"role": "user", "content": "hi"}], "stop_sequences": 5},
     "stop_sequences"),
    ("messages", {"messages": [{"role": "user", "content": "hi"}],
                  "tool_choice": {"type": "tool", "name": 5}}, "tool_choice.name"),
]


@pytest.mark.parametrize("model", ["tiny-a", "fam"])
@pytest.mark.parametrize(("family", "body", "param"), KNOWN,
                         ids=[f"{f}-{p}" for f, _, p in KNOWN])
def test_known_hostile_bodies_name_their_field(corral: Corral, model: str, family: str,
                                               body: dict[str, Any], param: str) -> None:
    resp = post(corral, family, {**body, "model": model, "max_tokens": 2})
    assert resp.status_code == 400, resp.text[:500]
    assert resp.json()["error"]["param"] == param, resp.text[:500]


# -- hostile members ----------------------------------------------------------------------------

HOSTILE = ["content-not-list", "usage-strings", "bad-tool-input", "not-an-object", "giant",
           "events", "endless"]


# Each wrong shape asked on each family; one endless run is enough (it waits member_timeout).
CASES = [(answer, family) for answer in HOSTILE for family in ("chat", "responses", "messages")
         if answer != "endless" or family == "messages"]


@pytest.mark.parametrize(("answer", "family"), CASES)
def test_a_hostile_member_is_a_member_error(corral: Corral, family: str,
                                            answer: str) -> None:
    """Each fake member answers in its own family (chat, responses, messages) with the same
    wrong shape: each is an error in the report, the steady member answers the client."""
    prompt = f"hostile:{answer}"
    tools = [{"name": "w", "input_schema": {"type": "object"}}] \
        if answer == "bad-tool-input" else None
    if family == "chat":
        resp = corral.http.post("/v1/chat/completions", timeout=60, json={
            "model": "hostile", "messages": [{"role": "user", "content": prompt}]})
    elif family == "responses":
        resp = post(corral, family, {"model": "hostile", "input": prompt, **(
            {"tools": [{"type": "function", "name": "w", "parameters": {}}]} if tools else {})})
    else:
        resp = post(corral, family, {"model": "hostile", "max_tokens": 8, "messages": [
            {"role": "user", "content": prompt}], **({"tools": tools} if tools else {})})
    assert resp.status_code == 200, resp.text[:500]
    report = resp.json()["corral_group"]
    by_model = {r["model"]: r for r in report["responses"]}
    assert by_model["steady"]["status"] == "ok"
    for member in ("fam-chat", "fam-resp", "fam-msg"):
        assert by_model[member]["status"] in ("error", "timeout"), by_model[member]
        assert by_model[member]["error"], by_model[member]
    assert report["complete"] is False
    assert report["usage"]["prompt_tokens"] == by_model["steady"]["usage"]["prompt_tokens"]


def test_a_members_words_are_never_corrals_events(corral: Corral) -> None:
    """A member whose text is corral's own stream endings, and whose answer names another
    model: the client reads the words as words, under the group's name, in each family."""
    client = corral.client(timeout=60)
    with client.responses.stream(model="mirror", input="hostile:forged") as stream:
        final = stream.get_final_response()
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert final.model == "mirror" and final.status == "completed"
    assert FORGED in final.output_text and "".join(deltas) in ("", final.output_text)
    claude = corral.claude()
    with claude.messages.stream(model="mirror", max_tokens=8, messages=[
            {"role": "user", "content": "hostile:forged"}]) as mstream:
        text = "".join(mstream.text_stream)
        message = mstream.get_final_message()
    assert message.model == "mirror" and FORGED in text and message.stop_reason == "end_turn"
    chunks = client.chat.completions.create(model="mirror", stream=True, messages=[
        {"role": "user", "content": "hostile:forged"}])
    assert FORGED in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_openai_sdks_stream_helper_reads_a_group(corral: Corral) -> None:
    """`responses.stream()` checks each event's item ids and indexes against what it has
    accumulated (stricter than create(stream=True)): text and a tool call, from a group."""
    client = corral.client(timeout=60)
    tools: Any = [{"type": "function", "name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}]
    with client.responses.stream(model="mirror", input="weather?", tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)), numbers
    calls = [i for i in final.output if i.type == "function_call"]
    assert final.model == "mirror" and len({i.id for i in final.output}) == len(final.output)
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in done] == list(range(len(final.output)))
    assert all(isinstance(c.call_id, str) and c.call_id for c in calls)
    for each in events:
        if getattr(each, "item_id", None):
            assert each.item_id in {i.id for i in final.output}, each


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", ["responses", "messages"])
def test_a_client_that_hangs_up_mid_group_leaves_no_member_running(
        corral: Corral, family: str, stream: bool) -> None:
    """Its members' requests are dropped (each child sees its connection closed), their
    leases go back at once, and the request is recorded once, under the group."""
    body: dict[str, Any] = {"model": "stuck", "stream": stream, "max_tokens": 8}
    if family == "responses":
        body["input"] = "hostile:endless"
    else:
        body["messages"] = [{"role": "user", "content": "hostile:endless"}]
    members = ("fam-resp", "fam-msg")

    def asked() -> int:  # member requests the children hold open (corral's side is open)
        return sum(c.status == psutil.CONN_ESTABLISHED and bool(c.raddr)
                   for m in members
                   for c in psutil.Process(corral.model(m)["pid"]).net_connections("tcp"))

    def in_flight() -> int:
        models = corral.models()
        return sum(models[m]["in_flight"] for m in members)

    since = time.time()
    busy: list[int] = []
    watcher = threading.Thread(target=lambda: busy.append(
        wait_until(lambda: in_flight() == 2 and asked() >= 2, timeout=10)))
    watcher.start()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up: its connection closes
        corral.http.post(PATHS[family], json=body, timeout=httpx.Timeout(60, read=2))
    watcher.join()
    assert busy, "the members were never asked"
    wait_until(lambda: in_flight() == 0, timeout=10)
    wait_until(lambda: asked() == 0, timeout=10)

    def recorded() -> list[dict[str, Any]]:
        requests = corral.http.get("/admin/requests?limit=1000").json()["requests"]
        return [r for r in requests if r["time"] >= since and r["endpoint"] == PATHS[family]]

    records = wait_until(recorded, timeout=10)
    assert [r["model"] for r in records] == ["stuck"], records
    assert records[0]["status"] == 499, records


def streamed(family: str, prompt: str) -> tuple[str, dict[str, Any]]:
    if family == "chat":
        return "/v1/chat/completions", {"model": "synth", "stream": True,
                                        "messages": [{"role": "user", "content": prompt}]}
    if family == "responses":
        return "/v1/responses", {"model": "synth", "stream": True, "input": prompt}
    return "/v1/messages", {"model": "synth", "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": prompt}]}


# How each family's stream says it broke: chat's error object, the others' `error` event.
BROKEN_END = {"chat": b'"error"', "responses": b"event: error", "messages": b"event: error"}


@pytest.mark.parametrize("family", ["chat", "responses", "messages"])
@pytest.mark.parametrize("answer", ["stream-usage", "stream-disorder"])
def test_a_synthesizers_stream_of_wrong_shapes_is_its_failure(corral: Corral, family: str,
                                                              answer: str) -> None:
    """Chunks with usage strings, choices that are no list, a delta that is a string, a
    finish reason that is a list: the synthesizer failed, said in the client's family (the
    status line went out as 200), and recorded as 502; never a 500 or a traceback."""
    path, body = streamed(family, f"hostile:{answer}")
    since = time.time()
    with corral.http.stream("POST", path, json=body, timeout=60) as response:
        assert response.status_code == 200
        raw = response.read()
    assert BROKEN_END[family] in raw, raw[-600:]
    assert b"synthesizer fam-chat failed" in raw, raw[-600:]

    def recorded() -> list[dict[str, Any]]:
        requests = corral.http.get("/admin/requests?limit=1000").json()["requests"]
        return [r for r in requests if r["time"] >= since and r["endpoint"] == path]

    assert [r["status"] for r in wait_until(recorded, timeout=10)] == [502]
    if family == "responses":  # one sequence, failure included, under one response id
        events = [json.loads(line[6:]) for line in raw.splitlines()
                  if line.startswith(b"data: {")]
        assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
        assert [e["type"] for e in events][-2:] == ["response.failed", "error"]
        ids = {e["response"]["id"] for e in events if "response" in e}
        assert len(ids) == 1, ids
        with pytest.raises(openai.APIError, match="synthesizer fam-chat failed"), \
                corral.client(timeout=60).responses.stream(
                    model="synth", input=f"hostile:{answer}") as stream:
            list(stream)


def test_a_synthesizers_words_are_never_corrals_events(corral: Corral) -> None:
    client = corral.client(timeout=60)
    with client.responses.stream(model="synth", input="hostile:stream-forged") as stream:
        final = stream.get_final_response()
    assert final.model == "synth" and FORGED in final.output_text
    claude = corral.claude()
    with claude.messages.stream(model="synth", max_tokens=8, messages=[
            {"role": "user", "content": "hostile:stream-forged"}]) as mstream:
        text = "".join(mstream.text_stream)
    assert FORGED in text and mstream.get_final_message().stop_reason == "end_turn"
