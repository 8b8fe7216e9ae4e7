"""The OpenAI SDK's `responses.stream()` helper through corral, on every kind of Responses
stream: llama-server's (a real child, and a stand-in with a function call) lacks its events'
`sequence_number`, `output_index` and `content_index`, which corral fills in; a stream that has
them (vLLM's, transformers serve's, OpenAI's) passes through byte for byte. Also
proxy/families/numbering.py on its own: events split anywhere, memory bounded."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response
from responses_upstream import ARGS, TEXT, USAGE, stream_bytes

from corral.proxy.families.numbering import _ITEMS_LIMIT, EventNumbering
from corral.proxy.families.wire import RESPONSES

from conftest import Corral, CorralFactory

STAND_IN = Path(__file__).parent / "responses_upstream.py"
SERVED = "served-fake"  # what the bare stand-in calls its model; corral calls it bare
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def stand_in(*flags: str) -> dict[str, Any]:
    return {"backend": "command", "health": "none", "memory_mb": 10,
            "command": [sys.executable, "-S", str(STAND_IN), "--port", "${PORT}", *flags]}


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, tiny_models: dict[str, Path]) -> Corral:
    return start_corral_module({
        "defaults": {"ttl": 600, "stop_grace": 5},
        "models": {
            "tiny": {"model": str(tiny_models["tiny-a"]), "ctx": 2048},
            "bare": {**stand_in(), "served_name": SERVED},
            "complete": stand_in("--complete"),
        },
    })


def helper(corral: Corral, model: str, **kwargs: Any) -> tuple[Any, list[Any]]:
    """The SDK helper's final response and every event it gave."""
    client = corral.client(timeout=120)
    with client.responses.stream(model=model, input="hi", **kwargs) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def test_the_sdks_stream_helper_reads_a_llama_server_childs_stream(corral: Corral) -> None:
    final, events = helper(corral, "tiny", max_output_tokens=12,
                           extra_body={"ignore_eos": True})
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and final.output_text == "".join(deltas)
    # The helper's own snapshots: the text so far, built up by the indexes corral put in.
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert snapshots[-1] == final.output_text
    assert final.model == "tiny" and final.status == "completed"
    assert final.usage is not None and final.usage.output_tokens == 12
    assert final.usage.input_tokens > 0
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_streamed_without_indexes_reaches_the_helper(corral: Corral) -> None:
    final, events = helper(corral, "bare", tools=TOOLS)
    assert final.model == "bare"  # the served_name renamed after the numbers went in
    message, call = final.output
    assert message.type == "message" and final.output_text == "".join(TEXT)
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    snapshots = [e.snapshot for e in events
                 if e.type == "response.function_call_arguments.delta"]
    assert snapshots == [ARGS[0], "".join(ARGS)]
    assert final.usage is not None and final.usage.output_tokens == USAGE["output_tokens"]
    raw = corral.http.post("/v1/responses", json={"model": "bare", "input": "hi",
                                                  "stream": True, "tools": TOOLS}).text
    data = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
    assert [(e.get("output_index"), e.get("content_index")) for e in data] == [
        (None, None), (None, None), (0, None), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, None),
        (1, None), (1, None), (1, None), (1, None), (None, None)]


LIFECYCLE = ("response.created", "response.in_progress", "response.completed",
             "response.failed", "response.incomplete")


def lifecycle_responses(corral: Corral, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each lifecycle event's type and its response, validated strictly against the SDK's
    Response type (every required field), in the stream's order."""
    with corral.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines()
                  if line.startswith("data:")]
    return [(e["type"], Response.model_validate(e["response"])) for e in events
            if e["type"] in LIFECYCLE]


@pytest.mark.parametrize("model", ["tiny", "bare"])
def test_every_response_object_validates_against_the_sdks_type(corral: Corral,
                                                                model: str) -> None:
    """llama-server's `response.created`/`in_progress` say only id, object and status, and
    none of its responses the tool settings or the usage's details: corral fills in what
    OpenAI's Response type requires, in every lifecycle event and the whole answer, under
    the name corral serves (a served_name's too), one created_at throughout."""
    body: dict[str, Any] = {"model": model, "input": "hi", "max_output_tokens": 8,
                            "ignore_eos": True}
    if model == "bare":  # the stand-in of llama-server's stream, with a function call
        body = {"model": model, "input": "hi", "tools": TOOLS}
    seen = lifecycle_responses(corral, body)
    kinds = [kind for kind, _ in seen]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] == "response.completed", kinds
    first, last = seen[0][1], seen[-1][1]
    assert first.output == [] and last.output, seen
    assert {r.model for _, r in seen} == {model}
    assert {r.id for _, r in seen} == {first.id} and {r.created_at for _, r in seen} == {
        first.created_at}
    assert last.usage is not None and last.usage.output_tokens > 0
    if model == "tiny":  # (the stand-in only streams)
        whole = Response.model_validate(corral.http.post("/v1/responses", json=body).json())
        assert whole.model == model and whole.output and whole.usage is not None


def test_a_stream_that_numbers_its_own_events_passes_byte_for_byte(corral: Corral) -> None:
    with httpx.stream("POST", corral.url + "/v1/responses", timeout=60, json={
            "model": "complete", "input": "hi", "stream": True, "tools": TOOLS}) as answer:
        got = answer.read()
    assert got == b"".join(stream_bytes("complete", "get_weather", complete=True))
    final, _ = helper(corral, "complete", tools=TOOLS)
    assert final.output_text == "".join(TEXT) and final.output[1].arguments == "".join(ARGS)


# -- the numbering on its own ------------------------------------------------------------------


def events_of(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in data.splitlines() if line.startswith(b"data:")]


def test_events_split_anywhere_get_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stand-in's responses carry no created_at: each numbering takes the clock's, and a
    # second's edge between two of them differed by one (CI saw it).
    import types

    from corral.proxy.families import numbering as module
    monkeypatch.setattr(module, "time", types.SimpleNamespace(time=lambda: 1_800_000_000.5))
    raw = b"".join(stream_bytes("m", "f", complete=False)).replace(b"\n", b"\r\n", 40)
    whole = EventNumbering()
    want = whole.feed(raw) + whole.flush()
    for size in (1, 7, 64):
        numbering = EventNumbering()
        got = b"".join(numbering.feed(raw[at:at + size]) for at in range(0, len(raw), size))
        assert got + numbering.flush() == want
    numbered = events_of(want)
    complete = [json.loads(json.dumps(e)) for e in
                events_of(b"".join(stream_bytes("m", "f", complete=True)))]
    for mine, theirs in zip(numbered, complete, strict=True):
        for key in ("sequence_number", "output_index", "content_index"):
            assert mine.get(key) == theirs.get(key), (mine, theirs)


def test_a_numbered_stream_is_left_alone_from_its_first_event() -> None:
    raw = b": comment\n\n" + b"".join(stream_bytes("m", None, complete=True))
    numbering = EventNumbering()
    out = numbering.feed(raw[:30]) + numbering.feed(raw[30:]) + numbering.flush()
    assert out == raw and numbering.passing


def test_the_item_ids_remembered_are_bounded() -> None:
    numbering = EventNumbering()
    numbering.feed(b'data: {"type":"response.created","response":{"id":"r"}}\n\n')
    for n in range(_ITEMS_LIMIT * 4):
        numbering.feed(b'data: {"type":"response.output_item.added","item":{"id":"i%d"}}\n'
                       % n)
    assert len(numbering._items) == _ITEMS_LIMIT
    out = numbering.feed(b'data: {"type":"response.output_text.delta","item_id":"i0",'
                         b'"delta":"x"}\n')  # forgotten: the latest item's index
    assert events_of(out)[0]["output_index"] == _ITEMS_LIMIT * 4 - 1


def test_corrals_own_events_that_end_a_broken_stream_are_numbered_after_the_childs() -> None:
    numbering = EventNumbering()
    raw = b"".join(stream_bytes("m", None, complete=False)[:4])
    sent = numbering.feed(raw + b'data: {"type":"response.output_te')  # cut mid-event
    ending = numbering.ending(RESPONSES.broken("m died", "upstream_failed", "m", None))
    assert b"response.output_te" not in ending
    assert [e["sequence_number"] for e in events_of(sent + ending)] == list(range(6))
    assert [e["type"] for e in events_of(ending)] == ["response.failed", "error"]


def test_deltas_between_repeated_lifecycle_events_keep_their_places() -> None:
    # llama-server repeats response.created and response.in_progress before each delta of
    # some models (a tiny one's, measured): the deltas' numbers must not drift from them.
    events = stream_bytes("m", "f", complete=False)
    lifecycle = events[:2]
    mixed = [event for e in events for event in
             ([*lifecycle, e] if b".delta\n" in e else [e])]
    numbering = EventNumbering()
    got = events_of(b"".join(numbering.feed(e) for e in mixed) + numbering.flush())
    assert [e["sequence_number"] for e in got] == list(range(len(mixed)))
    places = [(e["type"], e.get("output_index"), e.get("content_index")) for e in got
              if e["type"].endswith(".delta")]
    assert places == [("response.output_text.delta", 0, 0)] * len(TEXT) + [
        ("response.function_call_arguments.delta", 1, None)] * len(ARGS)
    assert all(e["logprobs"] == [] for e in got if e["type"] == "response.output_text.delta")
