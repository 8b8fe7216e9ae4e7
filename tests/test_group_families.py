"""Exposed groups as models on /v1/responses and /v1/messages, read with the official SDKs
(their stream helpers accumulate the events, so a wrong shape fails here): every group type
answers in the client's family under the group's name, with usage and the right stop reason;
tool calls come back as the family's own; members that speak only Responses or only Messages
(`api:`) are asked in their family; a stream broken mid-way ends in the family's error.

Tiny random models answer noise: the tests read the protocol, never the wording."""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from conftest import Corral, llama_server_binary, tiny_config

FAKE = Path(__file__).parent / "family_upstream.py"
MAX = 8
TOOL = {"name": "weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}
# The groups of tiny llama-server members, one of each type.
TYPES = ["par", "fan", "vote", "council", "pipe"]

pytestmark = pytest.mark.expect_log(
    "proxy.group_failed", allow=[r"breaker broke off its stream", r"synthesizer breaker"])


def fake(log: Path, *extra: str, api: str | None = None) -> dict[str, Any]:
    model: dict[str, Any] = {"backend": "command", "health": "none", "memory_mb": 10,
                             "capabilities": ["chat", "vision"],
                             "command": [sys.executable, "-S", str(FAKE), "--port", "${PORT}",
                                         "--log", str(log), *extra]}
    if api:
        model["api"] = api
    return model


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family-logs")


@pytest.fixture(scope="module")
def corral(start_corral_module, tiny_models, logs: Path) -> Corral:
    config = tiny_config(tiny_models, ["tiny-a", "tiny-b", "tiny-a2"])
    # The tiny members write their whole max_tokens on every path (a random model may end at
    # its first token: a stream with no text, a synthesis not streamed token by token).
    for name in ("tiny-a", "tiny-b", "tiny-a2"):
        config["models"][name]["request"] = {"set": {"ignore_eos": True}}
    config["models"].update({
        "tools-chat": fake(logs / "chat.jsonl"),
        "tools-resp": fake(logs / "resp.jsonl", api="responses"),
        "tools-msg": fake(logs / "msg.jsonl", api="messages"),
        "breaker": fake(logs / "breaker.jsonl", "--break"),
        # llama-server itself, asked only on Anthropic's Messages path. That path honours no
        # `ignore_eos` in the body, so the flag makes the tiny model write its whole max_tokens
        # (its random weights end early on some CPUs' numerics).
        "llama-msg": {"backend": "command", "api": "messages",
                      "command": [llama_server_binary(), "--model", str(tiny_models["tiny-b"]),
                                  "--host", "127.0.0.1", "--port", "${PORT}",
                                  "--ctx-size", "2048", "--threads", "1", "--ignore-eos"]},
    })
    exposed = {"expose_as_model": True}
    config["groups"] = {
        "par": {"type": "parallel", "models": ["tiny-a", "tiny-b"], **exposed},
        "fan": {"type": "fan_out", "models": ["tiny-a", "tiny-b"], "selector": "longest",
                **exposed},
        "vote": {"type": "fan_out", "models": ["tiny-b", "tiny-a", "tiny-a2"],
                 "selector": "majority", "compare": "exact", "quorum": 2, **exposed},
        "council": {"type": "consensus", "models": ["tiny-a", "tiny-b"],
                    "synthesizer": "tiny-a", **exposed},
        "pipe": {"type": "chain", "models": ["tiny-a", "tiny-b"], **exposed},
        "tooly": {"type": "fan_out", "models": ["tools-chat"], **exposed},
        "tool-chain": {"type": "chain", "models": ["tiny-a", "tools-msg"], **exposed},
        "foreign": {"type": "parallel", "models": ["tools-resp", "tools-msg"], **exposed},
        "real-msg": {"type": "fan_out", "models": ["llama-msg", "tiny-a"],
                     "selector": "longest", **exposed},
        "broken": {"type": "consensus", "models": ["tiny-a"], "synthesizer": "breaker",
                   **exposed},
        "fake-council": {"type": "consensus", "models": ["tools-chat"],
                         "synthesizer": "tools-chat", **exposed},
    }
    return start_corral_module(config)


def oa(corral: Corral) -> openai.OpenAI:
    return corral.client(timeout=60)


def an(corral: Corral) -> anthropic.Anthropic:
    return corral.claude(timeout=60)


def sent(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def expected_end(details: dict[str, Any]) -> bool:
    """Whether the group's answer was cut at MAX tokens: the answering member's was (a
    parallel group's joined answers never are)."""
    if details["type"] == "parallel":
        return False
    if details["type"] == "consensus":
        return details["usage"]["completion_tokens"] - sum(
            m["usage"]["completion_tokens"] for m in details["responses"]) >= MAX
    if details["type"] == "chain":
        source = details["responses"][-1]
    else:
        source = details["responses"][details["selected"]["index"]]
    return source["usage"]["completion_tokens"] >= MAX


@pytest.mark.parametrize("group", TYPES)
def test_responses_create_whole_and_streamed(corral: Corral, group: str) -> None:
    client = oa(corral)
    whole = client.responses.create(model=group, input="hi", instructions="Be brief.",
                                    max_output_tokens=MAX, temperature=0)
    details = whole.model_extra["corral_group"]
    assert whole.model == group and details["group"] == group and details["complete"]
    assert whole.output_text == details.get("final", whole.output_text)
    assert whole.usage.input_tokens == details["usage"]["prompt_tokens"] > 0
    assert whole.usage.output_tokens == details["usage"]["completion_tokens"] > 0
    assert whole.status == ("incomplete" if expected_end(details) else "completed")

    with client.responses.stream(model=group, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}]}], max_output_tokens=MAX,
            temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    details = final.model_extra["corral_group"]
    assert final.model == group and final.usage.output_tokens > 0
    assert final.output_text == details.get("final", final.output_text)
    assert final.status == ("incomplete" if expected_end(details) else "completed")


@pytest.mark.parametrize("group", TYPES)
def test_messages_create_and_stream(corral: Corral, group: str) -> None:
    client = an(corral)
    whole = client.messages.create(model=group, max_tokens=MAX, system="Be brief.",
                                   extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "hi"}])
    details = whole.model_extra["corral_group"]
    assert whole.model == group and details["complete"] and whole.content[0].type == "text"
    assert whole.usage.input_tokens == details["usage"]["prompt_tokens"] > 0
    assert whole.usage.output_tokens == details["usage"]["completion_tokens"] > 0
    assert whole.stop_reason == ("max_tokens" if expected_end(details) else "end_turn")

    with client.messages.stream(
            model=group, max_tokens=MAX, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    details = final.model_extra.get("corral_group") or {}
    assert final.model == group and final.usage.output_tokens > 0
    assert final.usage.input_tokens > 0
    assert "".join(texts) == final.content[0].text
    assert final.stop_reason in ("max_tokens", "end_turn")
    if group == "council":
        assert len(texts) > 1  # the synthesizer's own tokens, streamed as written


def test_a_tool_call_comes_back_as_each_familys_own(corral: Corral) -> None:
    tools_r = [{"type": "function", **TOOL}]
    whole = oa(corral).responses.create(model="tooly", input="weather in Paris?",
                                        tools=tools_r)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather",
                                                                  {"city": "Paris"})]
    with oa(corral).responses.stream(model="tooly", input="weather?", tools=tools_r) as s:
        final = s.get_final_response()
    assert [i.name for i in final.output if i.type == "function_call"] == ["weather"]

    tools_m = [{"name": TOOL["name"], "description": TOOL["description"],
                "input_schema": TOOL["parameters"]}]
    message = an(corral).messages.create(model="tooly", max_tokens=MAX, tools=tools_m,
                                         messages=[{"role": "user", "content": "weather?"}])
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("weather", {"city": "Paris"})]
    with an(corral).messages.stream(model="tooly", max_tokens=MAX, tools=tools_m,
                                    messages=[{"role": "user", "content": "w?"}]) as stream:
        final_m = stream.get_final_message()
    assert final_m.stop_reason == "tool_use"
    assert [b.input for b in final_m.content if b.type == "tool_use"] == [{"city": "Paris"}]

    chat = oa(corral).chat.completions.create(
        model="tooly", messages=[{"role": "user", "content": "w?"}],
        tools=[{"type": "function", "function": TOOL}])
    assert chat.choices[0].finish_reason == "tool_calls"
    assert chat.choices[0].message.tool_calls[0].function.name == "weather"


@pytest.mark.parametrize("group", ["tooly", "tool-chain", "fake-council"])
def test_a_stop_string_ends_as_messages_says_it(corral: Corral, group: str) -> None:
    """An answer that ended on one of the request's stop strings is Messages'
    `stop_reason: stop_sequence` naming it, whole and streamed, where the answering member
    said which: a chat member's `stop_reason` (vLLM's; tooly's fan-out), a Messages member's
    `stop_sequence` (tool-chain's last step), a consensus synthesizer's stream's."""
    request: dict[str, Any] = {
        "model": group, "max_tokens": MAX, "stop_sequences": ["END", "FIN"],
        "messages": [{"role": "user", "content": "hi"}]}
    whole = an(corral).messages.create(**request)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "END"), whole
    with an(corral).messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END"), final
    # Without stop strings: an end of turn, no stop_sequence.
    plain = an(corral).messages.create(model=group, max_tokens=MAX,
                                       messages=request["messages"])
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None), plain


def test_a_conversation_with_tool_results_reaches_a_messages_member(corral: Corral,
                                                                     logs: Path) -> None:
    """A chain's last step speaks only Messages: the client's Responses conversation (a call
    and its output) reaches it as tool_use and tool_result blocks, and its tool_use comes
    back as a function_call."""
    whole = oa(corral).responses.create(model="tool-chain", max_output_tokens=MAX, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "and tomorrow?"}], tools=[{"type": "function", **TOOL}])
    assert [i.type for i in whole.output][-1] == "function_call"
    body = sent(logs / "msg.jsonl")[-1]
    assert body["path"] == "/v1/messages"
    turns = body["body"]["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"] == [{"type": "tool_use", "id": "call_1", "name": "weather",
                                    "input": {"city": "Paris"}}]
    assert turns[2]["content"][0] == {"type": "tool_result", "tool_use_id": "call_1",
                                      "content": "sunny"}
    assert body["body"]["tools"][0]["input_schema"] == TOOL["parameters"]
    assert body["body"]["max_tokens"] == MAX


def test_a_failed_tools_result_reaches_the_member_marked(corral: Corral, logs: Path) -> None:
    """Messages' `is_error: true` on a tool_result (the tool failed: its content is the
    error) has no chat field: the member's tool message says it in its content."""
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "service unavailable"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": False,
             "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_3"}]}]
    an(corral).messages.create(model="tooly", max_tokens=MAX, messages=turns)
    tool_turns = [m for m in sent(logs / "chat.jsonl")[-1]["body"]["messages"]
                  if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_turns] == [
        ("toolu_1", "Error: service unavailable"), ("toolu_2", "sunny"), ("toolu_3", "")]


def test_members_that_speak_responses_or_messages_are_asked_in_it(corral: Corral,
                                                                  logs: Path) -> None:
    reply = oa(corral).chat.completions.create(
        model="foreign", max_tokens=MAX, temperature=0.5,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [
                      {"type": "text", "text": "hi"},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    details = reply.model_extra["corral_group"]
    assert [m["content"] for m in details["responses"]] == ["fake answer", "fake answer"]
    assert reply.usage.prompt_tokens == 14 and reply.usage.completion_tokens == 6
    resp, msg = sent(logs / "resp.jsonl")[-1], sent(logs / "msg.jsonl")[-1]
    assert resp["path"] == "/v1/responses" and msg["path"] == "/v1/messages"
    assert resp["body"]["max_output_tokens"] == MAX and resp["body"]["temperature"] == 0.5
    assert resp["body"]["store"] is False  # a Responses server keeps nothing of a member call
    assert resp["body"]["input"] == [
        {"type": "message", "role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "hi"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
             "detail": "auto"}]}]
    assert msg["body"]["system"] == "Be brief." and msg["body"]["max_tokens"] == MAX
    assert msg["body"]["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "hi"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]


def test_one_call_at_a_time_and_strictness_translate(corral: Corral, logs: Path) -> None:
    """Messages' `disable_parallel_tool_use` is chat's `parallel_tool_calls: false`, and back
    out to a Messages member; a Responses member gets it as is, and each chat tool with the
    `strict: false` chat means (the Responses API takes an absent `strict` as true)."""
    tools_m = [{"name": TOOL["name"], "description": TOOL["description"],
                "input_schema": TOOL["parameters"]}]
    an(corral).messages.create(
        model="tooly", max_tokens=MAX, tools=tools_m,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "weather?"}])
    chat = sent(logs / "chat.jsonl")[-1]["body"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False, chat

    oa(corral).chat.completions.create(
        model="foreign", max_tokens=MAX, parallel_tool_calls=False,
        tools=[{"type": "function", "function": TOOL}],
        messages=[{"role": "user", "content": "weather?"}])
    resp, msg = sent(logs / "resp.jsonl")[-1]["body"], sent(logs / "msg.jsonl")[-1]["body"]
    assert resp["parallel_tool_calls"] is False, resp
    assert resp["tools"] == [{"type": "function", "strict": False, **TOOL}], resp
    assert msg["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}, msg


def _event_types(union: Any) -> dict[str, type]:
    """The SDK's model of each event in a stream union, by its `type`."""
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    return {typing.get_args(model.model_fields["type"].annotation)[0]: model
            for model in typing.get_args(union)}


def _events(corral: Corral, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with corral.http.stream("POST", path, json={**body, "stream": True}) as stream:
        return [json.loads(line[5:]) for line in stream.iter_lines()
                if line.startswith("data:")]


def test_every_object_and_event_validates_against_the_sdks_types(corral: Corral) -> None:
    """The SDKs read answers leniently (a missing field is an AttributeError later, in the
    client's code): each whole answer and each event of a group's stream, text, tool calls
    or broken, is checked here against their models strictly, every required field."""
    responses_events = _event_types(ResponseStreamEvent)
    messages_events = _event_types(RawMessageStreamEvent)
    tools_r = [{"type": "function", **TOOL}]
    tools_m = [{"name": TOOL["name"], "input_schema": TOOL["parameters"]}]
    for group, tools in (("foreign", False), ("tooly", True), ("broken", False)):
        body: dict[str, Any] = {"model": group, "input": "hi", "max_output_tokens": MAX}
        if tools:
            body["tools"] = tools_r
        if group != "broken":
            Response.model_validate(corral.http.post("/v1/responses", json=body).json())
        for event in _events(corral, "/v1/responses", body):
            responses_events[event["type"]].model_validate(event)
        body = {"model": group, "max_tokens": MAX, "messages": [{"role": "user",
                                                                 "content": "hi"}]}
        if tools:
            body["tools"] = tools_m
        if group != "broken":
            Message.model_validate(corral.http.post("/v1/messages", json=body).json())
        for event in _events(corral, "/v1/messages", body):
            if event["type"] == "error":
                ErrorResponse.model_validate(event)
            elif event["type"] != "ping":  # a keep-alive the SDKs skip
                messages_events[event["type"]].model_validate(event)


def test_an_item_reference_is_refused_as_previous_response_id_is(corral: Corral) -> None:
    """corral keeps no responses: an item_reference names nothing, and leaving it out would
    give the members another conversation than the client's."""
    refused = corral.http.post("/v1/responses", json={"model": "tooly", "input": [
        {"type": "item_reference", "id": "msg_1"}, {"role": "user", "content": "and?"}]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "input" and "item_reference" in error["message"], error


def test_llama_server_asked_on_messages_as_a_member(corral: Corral) -> None:
    """llama-server as a command child with `api: messages`: the member is ok only if its
    answer was a Messages one (a chat completion has no `content` blocks to read), and its
    usage is read in that family's fields."""
    message = an(corral).messages.create(model="real-msg", max_tokens=MAX,
                                         messages=[{"role": "user", "content": "hi"}])
    details = message.model_extra["corral_group"]
    first = details["responses"][0]
    assert first["model"] == "llama-msg" and first["status"] == "ok", first
    assert first["usage"]["prompt_tokens"] > 0 and first["usage"]["completion_tokens"] == MAX
    # The group's usage is its members' summed (tiny-a's filter sets ignore_eos too).
    members = sum(m["usage"]["completion_tokens"] for m in details["responses"])
    assert message.model == "real-msg" and message.usage.output_tokens == members == 2 * MAX


def test_a_broken_group_stream_ends_in_the_familys_error(corral: Corral) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised, an(corral).messages.stream(
            model="broken", max_tokens=MAX,
            messages=[{"role": "user", "content": "hi"}]) as stream:
        for _ in stream:
            pass
    assert "breaker" in str(raised.value)

    kinds: list[str] = []
    with pytest.raises(openai.APIError) as failed, \
            oa(corral).responses.stream(model="broken", input="hi",
                                        max_output_tokens=MAX) as rstream:
        for event in rstream:
            kinds.append(event.type)
    assert "response.failed" in kinds and "breaker" in str(failed.value)

    with pytest.raises(openai.APIError):
        for _ in oa(corral).chat.completions.create(
                model="broken", stream=True, max_tokens=MAX,
                messages=[{"role": "user", "content": "hi"}]):
            pass


def test_group_requests_the_translation_refuses(corral: Corral) -> None:
    unknown_item = corral.http.post("/v1/responses", json={
        "model": "par", "input": [{"type": "computer_call_output", "call_id": "x"}]})
    assert unknown_item.status_code == 400 and unknown_item.json()["error"]["param"] == "input"
    stored = corral.http.post("/v1/responses", json={
        "model": "par", "input": "hi", "previous_response_id": "resp_1"})
    assert stored.status_code == 400
    no_messages = corral.http.post("/v1/messages", json={"model": "par", "max_tokens": 4})
    assert no_messages.status_code == 400
    other_path = corral.http.post("/v1/completions", json={"model": "par", "prompt": "x"})
    assert other_path.json()["error"]["code"] == "group_endpoint"


def test_ids_are_new_per_request_and_usage_is_the_groups(corral: Corral) -> None:
    """Each answer has its own `resp_…`/`msg_…` id, and the group's summed usage (one member
    here: its 7 in, 3 out), in both families."""
    answers = [oa(corral).responses.create(model="tooly", input="hi") for _ in range(2)]
    assert len({a.id for a in answers}) == 2 and all(a.id.startswith("resp_") for a in answers)
    assert [(a.usage.input_tokens, a.usage.output_tokens) for a in answers] == [(7, 3)] * 2
    messages = [an(corral).messages.create(model="tooly", max_tokens=MAX, messages=[
        {"role": "user", "content": "hi"}]) for _ in range(2)]
    assert len({m.id for m in messages}) == 2 and all(m.id.startswith("msg_") for m in messages)
    assert [(m.usage.input_tokens, m.usage.output_tokens) for m in messages] == [(7, 3)] * 2
