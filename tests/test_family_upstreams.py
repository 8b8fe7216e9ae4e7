"""What a hostile or broken upstream can send on the Responses and Messages paths, relayed by a
real corral to a remote model in front of a raw server that misbehaves on purpose (the case
is named in the request's text): token counts that are no counts, text the renamer cannot
write back, headers that are the upstream's own. The client gets the answer whole or an error
in its family's shape, the request is accounted once, and the daemon logs no traceback."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fake_upstream import requests
from raw_server import RawServer

from conftest import Corral, CorralFactory, sse_lines, wait_until

SERVED = "upstream-name"  # the name the remote knows the model by (renamed both ways)
# Counts no child could mean: below zero, past any float (the metrics' counters take floats).
COUNTS = {"negative": -5, "huge": 10 ** 400}


def _head(content_type: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n" + extra


def _whole(body: bytes, extra: bytes = b"") -> bytes:
    return (_head(b"application/json", extra) + b"Content-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return _chunk(f"event: {kind}\ndata: ".encode() + json.dumps(payload).encode() + b"\n\n")


def _stream(events: list[bytes], extra: bytes = b"") -> bytes:
    return (_head(b"text/event-stream", extra) + b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(events) + b"0\r\n\r\n")


def _message(usage: dict[str, Any], text: str = "fine") -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": SERVED,
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": usage}


def _response(usage: dict[str, Any] | None, text: str = "fine") -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": "completed", "model": SERVED,
            "output": [{"type": "message", "id": "m", "role": "assistant", "status":
                        "completed", "content": [{"type": "output_text", "text": text,
                                                  "annotations": []}]}],
            "usage": usage}


def _messages_stream(tokens_in: Any, tokens_out: Any, text: str = "fine") -> list[bytes]:
    start = _message({"input_tokens": tokens_in, "output_tokens": 0}, "")
    start["content"] = []
    return [_event("message_start", {"type": "message_start", "message": start}),
            _event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
            _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": text}}),
            _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": tokens_out}}),
            _event("message_stop", {"type": "message_stop"})]


def _responses_stream(usage: dict[str, Any] | None, text: str = "fine") -> list[bytes]:
    head = _response(None, "")
    head["status"], head["output"] = "in_progress", []
    return [_event("response.created", {"type": "response.created", "response": head}),
            _event("response.output_text.delta", {"type": "response.output_text.delta",
                                                   "item_id": "m", "output_index": 0,
                                                   "content_index": 0, "delta": text}),
            _event("response.completed", {"type": "response.completed",
                                          "response": _response(usage, text)})]


def answer(path: str, case: str) -> bytes | Iterator[bytes | None]:
    """The raw answer to a request on `path` whose text names `case` (`kind-detail`)."""
    kind, _, detail = case.partition("-")
    messages = path == "/v1/messages"
    if kind == "cut":
        return cut(path, case)
    if kind in ("whole", "stream"):  # token counts that are no counts
        count = COUNTS[detail]
        if kind == "whole":
            body = _message({"input_tokens": count, "output_tokens": count}) if messages \
                else _response({"input_tokens": count, "output_tokens": count})
            return _whole(json.dumps(body).encode())
        return _stream(_messages_stream(count, count) if messages
                       else _responses_stream({"input_tokens": count, "output_tokens": count}))
    if kind == "surrogate":  # half of a UTF-16 pair, as a JSON escape (a JS server's split)
        text = "half \ud83d"
        if detail == "whole":
            body = _message({"input_tokens": 1, "output_tokens": 1}, text) if messages \
                else _response({"input_tokens": 1, "output_tokens": 1}, text)
            return _whole(json.dumps(body).encode())
        return _stream(_messages_stream(1, 1, text) if messages
                       else _responses_stream({"input_tokens": 1, "output_tokens": 1}, text))
    if kind == "cookie":  # the remote's own cookie, on a whole answer and on a stream
        cookie = (b"Set-Cookie: session=operators-own; Path=/; HttpOnly\r\n"
                  # The operator's account, as OpenAI's and Anthropic's APIs name it in
                  # every answer: whose key this is, and how much of its quota is left.
                  b"openai-organization: org-operators-own\r\nopenai-project: proj_own\r\n"
                  b"anthropic-organization-id: 0f3c-operators-own\r\n"
                  b"x-ratelimit-remaining-tokens: 149984\r\n"
                  b"anthropic-ratelimit-requests-remaining: 49\r\n")
        if detail == "whole":
            body = _message({"input_tokens": 1, "output_tokens": 1}) if messages \
                else _response({"input_tokens": 1, "output_tokens": 1})
            return _whole(json.dumps(body).encode(), cookie)
        return _stream(_messages_stream(1, 1) if messages
                       else _responses_stream({"input_tokens": 1, "output_tokens": 1}), cookie)
    raise AssertionError(f"no such case: {case}")


def cut(path: str, case: str) -> Iterator[bytes | None]:
    """A stream that stops after its first text, `how`: its chunked body ended cleanly
    (`clean`), its connection closed where the body is read to the connection's end (`eof`:
    no length, not chunked), or its connection cut mid-chunk (`broken`). None: close."""
    how = case.partition("-")[2]
    events = (_messages_stream(1, 1) if path == "/v1/messages"
              else _responses_stream({"input_tokens": 1, "output_tokens": 1}))[:2]
    if path == "/v1/messages":  # the text's own block began too
        events = _messages_stream(1, 1)[:3]
    if how == "eof":
        unframed = [e.split(b"\r\n", 1)[1][:-2] for e in events]  # the chunks' bytes
        yield _head(b"text/event-stream", b"Connection: close\r\n\r\n") + b"".join(unframed)
        yield None
        return
    yield _head(b"text/event-stream", b"Transfer-Encoding: chunked\r\n\r\n") + b"".join(events)
    if how == "broken":
        yield b"ff\r\nevent: content_block_delta\ndata: {"
        yield None
        return
    yield b"0\r\n\r\n"


def endless_head(_path: str, _case: str) -> Iterator[bytes]:
    """A status line, then one header that never ends (64 MB at most)."""
    yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Endless: "
    for _ in range(1024):
        yield b"a" * 65536


class HostileUpstream(RawServer):
    """Each request gets `answer(path, case)`, the case found in its body as `case:NAME`."""

    def __init__(self, answers: Callable[[str, str], bytes | Iterator[bytes | None]]) -> None:
        self.answers = answers
        self.sent = 0  # bytes written, all requests together
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        for _method, path, body in requests(conn):
            found = re.search(rb"case:([a-z0-9-]+)", body)
            answered = self.answers(path, found.group(1).decode() if found else "")
            for part in [answered] if isinstance(answered, bytes) else answered:
                if part is None:
                    return  # closed (with the connection's end, as a dead server's)
                try:
                    conn.sendall(part)
                except OSError:
                    return  # corral hung up
                self.sent += len(part)


@pytest.fixture(scope="module")
def upstream() -> Iterator[HostileUpstream]:
    made = HostileUpstream(answer)
    yield made
    made.close()


@pytest.fixture(scope="module")
def endless() -> Iterator[HostileUpstream]:
    made = HostileUpstream(endless_head)
    yield made
    made.close()


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, upstream: HostileUpstream,
           endless: HostileUpstream) -> Corral:
    corral = start_corral_module({"models": {
        "far": {"backend": "remote", "url": f"http://127.0.0.1:{upstream.port}",
                "served_name": SERVED, "aliases": ["far-alias"]},
        "endless": {"backend": "remote", "url": f"http://127.0.0.1:{endless.port}"}}})
    corral.expect("proxy.upstream_failed", "proxy.request_failed", "proxy.stream_broken")
    return corral


def _body(path: str, case: str, stream: bool) -> dict[str, Any]:
    if path == "/v1/messages":
        return {"model": "far", "max_tokens": 8, "stream": stream, "messages": [
            {"role": "user", "content": f"case:{case}"}]}
    return {"model": "far", "input": f"case:{case}", "stream": stream}


def _ask(corral: Corral, path: str, case: str, stream: bool) -> httpx.Response:
    return corral.http.post(path, json=_body(path, case, stream))


def _last_request(corral: Corral, path: str, case_count: int) -> dict[str, Any]:
    """The request log's entry for the `case_count`-th request on `path`, once it is in."""
    def logged() -> list[dict[str, Any]]:
        rows = corral.http.get("/admin/requests?limit=200").json()["requests"]
        return [r for r in rows if r["endpoint"] == path]
    rows = wait_until(lambda: len(logged()) >= case_count and logged())
    return dict(rows[-1])


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("count", sorted(COUNTS))
def test_token_counts_that_are_no_counts_are_not_counted(corral: Corral, path: str,
                                                         count: str) -> None:
    """A usage below zero, or past what a float holds, was taken as the request's tokens:
    the metrics' counter raised on it (a traceback after the answer went out) and the
    request was never accounted (no log line, no /admin/requests entry)."""
    before = len([r for r in corral.http.get("/admin/requests?limit=200").json()["requests"]
                  if r["endpoint"] == path])
    whole = _ask(corral, path, f"whole-{count}", stream=False)
    assert whole.status_code == 200, whole.text
    assert whole.json()["model"] == "far"
    row = _last_request(corral, path, before + 1)
    assert (row["status"], row["tokens_in"], row["tokens_out"]) == (200, None, None)

    with corral.http.stream("POST", path, json=_body(path, f"stream-{count}",
                                                     stream=True)) as streamed:
        lines = list(sse_lines(streamed))
    assert streamed.status_code == 200
    assert any("fine" in line for line in lines)
    row = _last_request(corral, path, before + 2)
    assert (row["status"], row["tokens_in"], row["tokens_out"]) == (200, None, None)
    assert "corral_prompt_tokens_total" not in _metric_lines(corral, "far")


def _metric_lines(corral: Corral, model: str) -> str:
    text = corral.http.get("/metrics").text
    return "\n".join(line for line in text.splitlines()
                     if f'model="{model}"' in line and "tokens_total" in line
                     and not line.endswith(" 0.0"))


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_members_count_past_any_float_is_not_an_answer(api: str) -> None:
    """A group's member claiming 10**400 tokens summed into the group's usage, and the
    group's request then raised in the metrics as above."""
    from corral.proxy.families.answers import NotAnAnswer, member_answer

    huge = 10 ** 400
    data: dict[str, Any] = {
        "chat": {"choices": [{"message": {"content": "x"}}],
                 "usage": {"prompt_tokens": huge, "completion_tokens": 1}},
        "responses": _response({"input_tokens": 1, "output_tokens": huge}),
        "messages": _message({"input_tokens": 1, "cache_read_input_tokens": huge,
                              "output_tokens": 1})}[api]
    with pytest.raises(NotAnAnswer, match="not a token count"):
        member_answer(api, data)


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_half_a_surrogate_pair_in_a_renamed_answer_goes_through(corral: Corral,
                                                                 path: str) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud83d"), which Python reads into a str
    that UTF-8 cannot encode: renaming the served name back raised UnicodeEncodeError, a
    500 for a whole answer and a stream cut off with a traceback and no error event."""
    whole = _ask(corral, path, "surrogate-whole", stream=False)
    assert whole.status_code == 200, whole.text
    assert whole.json()["model"] == "far"
    assert "half \\ud83d" in whole.text
    with corral.http.stream("POST", path, json=_body(path, "surrogate-stream",
                                                     stream=True)) as streamed:
        lines = list(sse_lines(streamed))
    assert streamed.status_code == 200
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    named = [e.get("response", e.get("message", {})).get("model") for e in events
             if isinstance(e.get("response", e.get("message")), dict)]
    assert named and set(named) == {"far"}, named
    assert events[-1]["type"] in ("message_stop", "response.completed"), events[-1]


def test_half_a_surrogate_pair_in_a_clients_body_reaches_the_model(corral: Corral) -> None:
    """The same in a client's body that corral rewrites (an alias becomes the model's name,
    the served name goes in): a 500 before the request left corral."""
    raw = json.dumps({"model": "far-alias", "max_tokens": 8, "messages": [
        {"role": "user", "content": "case:surrogate-whole, cut in an emoji \ud83d"}]})
    assert "\\ud83d" in raw  # escaped, as JSON.stringify writes it
    answered = corral.http.post("/v1/messages", content=raw,
                                headers={"Content-Type": "application/json"})
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == "far"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_remotes_cookie_and_account_headers_never_reach_the_client(corral: Corral,
                                                                     path: str) -> None:
    """corral never sends a client's cookies on, so a remote's Set-Cookie (a CDN's bot
    cookie, a session of the operator's account) only leaked to every client."""
    for stream in (False, True):
        answered = _ask(corral, path, f"cookie-{'stream' if stream else 'whole'}", stream)
        assert answered.status_code == 200, answered.text
        assert "fine" in answered.text
        assert "set-cookie" not in answered.headers, answered.headers
        # Nor the operator's account: its organization, project and what is left of its
        # quota are the operator's business, not every client's.
        assert "operators-own" not in str(answered.headers), answered.headers
        assert not [h for h in answered.headers if "ratelimit" in h or h == "openai-project"]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_response_head_that_never_ends_is_a_502_read_no_further(
        corral: Corral, endless: HostileUpstream, path: str) -> None:
    """llhttp bounds neither a header's length nor their number, and corral held what came
    until first_byte_timeout (a remote on a fast link sends gigabytes by then): a head past
    64 KiB is a broken answer now."""
    body = _body(path, "any", stream=True)
    sent = endless.sent
    answered = corral.http.post(path, json={**body, "model": "endless"})
    assert answered.status_code == 502, answered.text
    assert answered.json()["error"]["code"] == "upstream_failed"
    assert "response head passed 64 KiB" in answered.json()["error"]["message"]
    # What filled the sockets' buffers, no more (of the 64 MB it would send).
    assert endless.sent - sent < 16 * 1024 * 1024


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("how", ["clean", "eof", "broken"])
def test_a_stream_that_stops_before_its_last_event_ends_in_the_familys_error(
        corral: Corral, path: str, how: str) -> None:
    """A stream that stopped after its first text: cut mid-chunk it ended in the family's
    error, but was accounted a 200; ended cleanly, or by the connection's end where that is
    the body's (a server without framing that died), the client was told nothing at all and
    its SDK took the half answer for a whole one."""
    before = len([r for r in corral.http.get("/admin/requests?limit=200").json()["requests"]
                  if r["endpoint"] == path])
    with corral.http.stream("POST", path, json=_body(path, f"cut-{how}", stream=True)) as got:
        lines = list(sse_lines(got))
    assert got.status_code == 200
    assert any("fine" in line for line in lines), lines
    events = [line[6:].strip() for line in lines if line.startswith("event:")]
    assert events[-1] == "error", events
    last = json.loads(lines[[n for n, line in enumerate(lines)
                             if line.startswith("data:")][-1]][5:])
    message = last["error"]["message"] if path == "/v1/messages" else last["message"]
    assert "far " in message and "request id" in message, last
    if path == "/v1/responses":
        assert events[-2] == "response.failed", events
    row = _last_request(corral, path, before + 1)
    assert row["status"] == 502, row


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_whole_stream_followed_by_done_is_no_cut(corral: Corral, path: str) -> None:
    """The check above reads the stream's last event: a `data: [DONE]` a server adds after
    it, CRLF line ends, or comments are no cut."""
    from corral.proxy.families.wire import MESSAGES, RESPONSES

    wire = MESSAGES if path == "/v1/messages" else RESPONSES
    events = (_messages_stream(1, 1) if path == "/v1/messages"
              else _responses_stream({"input_tokens": 1, "output_tokens": 1}))
    stream = b"".join(e.split(b"\r\n", 1)[1][:-2] for e in events)
    for tail in (stream, stream + b"data: [DONE]\n\n", stream + b": ping\n\n",
                 stream.replace(b"\n", b"\r\n"), stream[-40:]):
        assert not wire.cut_short(tail), tail
    # Without its last event, with nothing, with its last event never ended (a client
    # discards that one).
    for tail in (stream[:stream.rindex(b"event:")], b"", stream[:-3]):
        assert wire.cut_short(tail), tail


def test_a_speed_of_infinity_is_not_kept() -> None:
    """Python's json reads Infinity: a child's speed of it went into /admin/requests, which
    then wrote no JSON a browser parses (the status page reads it)."""
    from corral.proxy.timing import RequestRecord

    record = RequestRecord("far", "/v1/chat/completions")
    record.read_usage(b'{"timings": {"predicted_per_second": Infinity, '
                      b'"prompt_per_token_ms": 1e999, "predicted_n": -3}}')
    assert (record.tokens_per_s, record.prompt_ms_per_token, record.completion_tokens) \
        == (None, None, None)
