"""What each API family says on the wire, as the relay needs it: where an answer's usage is,
which objects name the model, and how a stream that broke after its head went out ends.

Chat completions (`/v1/chat/completions` and every other OpenAI path) put the usage in
`usage.prompt_tokens`/`completion_tokens` and the model at the top. OpenAI's Responses
(`/v1/responses`) say `input_tokens`/`output_tokens`, in a whole answer's `usage` and in a
stream's last event (`response.completed`, or `response.incomplete`/`response.failed`) as
`response.usage`; its stream names the model in `response.model`. Anthropic's Messages
(`/v1/messages`) count the input at the START of a stream (`message_start.message.usage`) and the
output at its end (`message_delta.usage`), and leave the cache reads out of `input_tokens`; its
stream names the model in `message.model`."""

from __future__ import annotations

import json
import time
from typing import Any

from corral.proxy import request_id
from corral.proxy.families.lifecycle import complete_answer
from corral.proxy.families.numbering import EventNumbering
from corral.proxy.sse import DONE, error_event, typed

__all__ = ["CHAT", "MESSAGES", "RESPONSES", "StreamHead", "Tokens", "Wire", "count",
           "wire_for"]

# (tokens in, tokens out): either may be unknown.
Tokens = tuple[int | None, int | None]

# The bytes of a stream's start kept to find its first event in (an event is far smaller).
_HEAD_LIMIT = 64 * 1024
# The chunks a stream's first event may be split over before corral stops looking for it.
_HEAD_CHUNKS = 4


# The most tokens one answer may claim: far past any context, and exact as a float (the
# metrics' counters add floats; an int past a float's range makes them raise).
MAX_TOKENS = 2 ** 53 - 1


def count(value: object) -> int | None:
    """A token count an upstream reported, or None where it is none: not an int, below zero
    (a counter cannot go back) or past MAX_TOKENS (a hostile number, 10**400)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
        return value
    return None


def _dict(value: object) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


class Wire:
    """The chat completions family, and the base of the others."""

    name = "chat"
    # Objects inside an event or answer that carry their own `model` (besides the top).
    nested: tuple[str, ...] = ()
    # Whether the first event of a stream says something corral keeps (tokens, an id).
    reads_head = False
    # Whether the stream's start waits for its first event before it goes out (start()).
    holds_start = False

    def start(self, head: StreamHead, model: str) -> bytes:
        """What goes out before a stream's first event, when the child left it out."""
        return b""

    def numbering(self, model: str = "") -> EventNumbering | None:
        """What fills in the numbers a stream's events lack (Responses' indexes), if this
        family's events carry any; `model`: the name a response that names none gets."""
        return None

    def whole(self, payload: bytes, model: str) -> bytes:
        """A child's whole (200) answer, with what this family's type requires and the child
        left out filled in (a Responses `response`'s fields: lifecycle.py)."""
        return payload

    def usage(self, data: dict[str, Any]) -> Tokens:
        """The tokens an answer or a stream event reports, (None, None) when it has none."""
        usage = _dict(data.get("usage"))
        if usage is None:
            return None, None
        return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))

    def rename(self, data: Any, served_name: str, model: str) -> bool:
        """`model` for `served_name` wherever this family names the model in `data` (an
        answer, or one event of a stream); whether anything changed."""
        if not isinstance(data, dict):
            return False
        changed = False
        for holder in (data, *(data.get(key) for key in self.nested)):
            if isinstance(holder, dict) and holder.get("model") == served_name:
                holder["model"] = model
                changed = True
        return changed

    # What ends this family's stream for good after an error, where the stream would have
    # ended with it (chat's `[DONE]`; the other families have no such line).
    end = DONE

    def broken(self, message: str, code: str, model: str, head: StreamHead | None) -> bytes:
        """The events that end a stream broken after its head went out: what this family's
        clients raise on. Chat: an event carrying an `error` object (the OpenAI SDKs raise
        APIError on it)."""
        return error_event(message, code=code)

    def head(self) -> StreamHead:
        return StreamHead(self)

    # The events that end this family's stream as a whole answer.
    last_events: frozenset[bytes] = frozenset()

    def ended(self, tail: bytes) -> bool:
        """Whether `tail`, the last bytes of a stream written to the client, ends with the
        event that says the answer is whole (a client may hang up right after it: the
        OpenAI SDK after `[DONE]`, Codex after `response.completed`)."""
        text = tail.rstrip(b"\n")
        if not tail.endswith(b"\n\n"):
            return False  # the last event is not all out
        if not self.last_events:
            return text.endswith(DONE.rstrip(b"\n"))
        start = text.rfind(b"\n\n") + 2 if b"\n\n" in text else 0
        for line in text[start:].split(b"\n"):
            if line.startswith(b"event:"):
                return line[6:].strip() in self.last_events
        return False

    def read_head(self, event: dict[str, Any], head: StreamHead) -> bool:
        """Take what the stream's first event says into `head`; whether it was that event."""
        return True

    # The events after which this family's stream is over: its whole answer, or its own
    # error (the client was told). Empty for chat: not every server of it sends `[DONE]`.
    final_events: frozenset[bytes] = frozenset()

    def cut_short(self, tail: bytes) -> bool:
        """Whether a stream that ended cleanly with `tail` (its last bytes) stopped before the
        event that ends this family's answer: a server that died under an answer whose end
        is its connection's, or that closed its stream early. Said only where the tail shows
        the last event whole (a Responses stream's last event holds the whole answer, and
        may begin before the tail); a `data: [DONE]` or a comment after it is no event."""
        if not self.final_events:
            return False
        # An event ends at a blank line: what follows the last one is an event never ended,
        # which a client discards.
        blocks = tail.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]
        for n in range(len(blocks) - 1, -1, -1):
            lines = [line for line in blocks[n].split(b"\n")
                     if line and not line.startswith(b":")]
            if not lines or lines == [DONE.rstrip(b"\n")]:
                continue
            if n == 0 and not lines[0].startswith((b"event:", b"data:")):
                return False  # the tail begins inside this event: its name is not seen
            return _event_name(lines) not in self.final_events
        return not tail.strip()  # nothing at all; or comments only, after events unseen


def _event_name(lines: list[bytes]) -> bytes:
    """An event's name: its `event:` line, else the `type` its data says (b"" for none)."""
    for line in lines:
        if line.startswith(b"event:"):
            return line[6:].strip()
    data = b"\n".join(line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:"))
    try:
        event = json.loads(data)
    except (ValueError, RecursionError):  # json's own limit: ~1000 levels
        return b""
    kind = event.get("type") if isinstance(event, dict) else None
    return kind.encode() if isinstance(kind, str) else b""


class ResponsesWire(Wire):
    """OpenAI's Responses API."""

    name = "responses"
    end = b""
    last_events = frozenset({b"response.completed", b"response.incomplete"})
    final_events = last_events | {b"response.failed", b"error"}
    nested = ("response",)
    reads_head = True  # the response's id, for the `response.failed` that may end it

    def numbering(self, model: str = "") -> EventNumbering | None:
        return EventNumbering(model)

    def whole(self, payload: bytes, model: str) -> bytes:
        return complete_answer(payload, model, int(time.time()))

    def usage(self, data: dict[str, Any]) -> Tokens:
        usage = _dict(data.get("usage"))
        if usage is None:  # a stream's final event carries the whole response
            response = _dict(data.get("response"))
            usage = _dict(response.get("usage")) if response is not None else None
        if usage is None:
            return None, None
        # input_tokens counts the cached ones too (input_tokens_details.cached_tokens).
        return count(usage.get("input_tokens")), count(usage.get("output_tokens"))

    def read_head(self, event: dict[str, Any], head: StreamHead) -> bool:
        response = _dict(event.get("response"))
        if response is None:
            return False
        if isinstance(response.get("id"), str):
            head.response_id = response["id"]
        return True

    def broken(self, message: str, code: str, model: str, head: StreamHead | None) -> bytes:
        """`response.failed` (the end Codex and the Agents SDK read: the response's status
        and its error), then an `error` event: OpenAI's `{"type": "error", ...}` that also
        carries an `error` object, which the OpenAI SDKs raise APIError on."""
        text = request_id.tagged(message)
        response_id = (head.response_id if head is not None else None) \
            or f"resp_corral_{request_id.current() or int(time.time())}"
        failed = {"type": "response.failed", "response": {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "failed", "model": model, "output": [], "usage": None,
            "error": {"code": "server_error", "message": text}, "incomplete_details": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}}
        error = {"type": "error", "code": code, "message": text, "param": None,
                 "error": {"message": text, "type": "server_error", "code": code,
                           "param": None}}
        return typed("response.failed", failed) + typed("error", error)


class MessagesWire(Wire):
    """Anthropic's Messages API."""

    name = "messages"
    end = b""
    last_events = frozenset({b"message_stop"})
    final_events = last_events | {b"error"}
    nested = ("message",)
    reads_head = True  # message_start: the input tokens

    def usage(self, data: dict[str, Any]) -> Tokens:
        usage = _dict(data.get("usage"))
        if usage is None:
            return None, None
        return self._input(usage), count(usage.get("output_tokens"))

    @staticmethod
    def _input(usage: dict[str, Any]) -> int | None:
        # Anthropic's input_tokens leave out what came from the prompt cache: the prompt is
        # all three (what OpenAI's prompt_tokens and input_tokens count).
        tokens = count(usage.get("input_tokens"))
        if tokens is None:
            return None
        return tokens + (count(usage.get("cache_read_input_tokens")) or 0) \
            + (count(usage.get("cache_creation_input_tokens")) or 0)

    # The stream's start is held until its first event is read: one that lacks message_start
    # gets it (below).
    holds_start = True

    def read_head(self, event: dict[str, Any], head: StreamHead) -> bool:
        kind = event.get("type")
        head.first = kind if isinstance(kind, str) else ""
        if kind != "message_start":
            return True  # the first event, whatever it is: the start is decided
        message = _dict(event.get("message"))
        usage = _dict(message.get("usage")) if message is not None else None
        if usage is not None:
            head.tokens_in = self._input(usage)
        return True

    def start(self, head: StreamHead, model: str) -> bytes:
        """A message_start for a stream whose first event is another one: llama-server leaves
        it out when its first token is part of a UTF-8 character (seen on 12 of 30 streams of a
        tiny model), and Anthropic's SDKs refuse any event before it ("Unexpected event
        order"). Its input tokens are unknown: 0 there, none in the request log."""
        if head.first is None or head.first == "message_start":
            return b""
        return typed("message_start", {"type": "message_start", "message": {
            "id": f"msg_corral_{request_id.current() or int(time.time())}", "type": "message",
            "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})

    def broken(self, message: str, code: str, model: str, head: StreamHead | None) -> bytes:
        """Anthropic's error event: the `event: error` line is what its SDKs raise on (an
        event without a name they skip)."""
        return typed("error", {"type": "error", "error": {
            "type": "api_error", "message": request_id.tagged(message)}})


CHAT = Wire()
RESPONSES = ResponsesWire()
MESSAGES = MessagesWire()
_BY_PATH: dict[str, Wire] = {"/v1/responses": RESPONSES, "/v1/messages": MESSAGES}


def wire_for(path: str) -> Wire:
    """The family a request path speaks (chat's rules for every other OpenAI path)."""
    return _BY_PATH.get(path, CHAT)


class StreamHead:
    """What a stream's first event says, read from its first chunks only (the relay passes
    every later chunk on unread): the Messages input tokens, the Responses id."""

    __slots__ = ("_buffer", "_chunks", "done", "first", "response_id", "tokens_in", "wire")

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.done = not wire.reads_head
        self.tokens_in: int | None = None
        self.response_id: str | None = None
        self.first: str | None = None  # the first event's type (Messages), once read
        self._buffer = b""
        self._chunks = 0

    def feed(self, chunk: bytes) -> None:
        """One more chunk of the stream's start; `done` once the first event was read (or
        the start was too long to hold one)."""
        if self.done:
            return
        self._chunks += 1
        self._buffer += chunk
        for line in self._buffer.split(b"\n")[:-1]:  # whole lines only
            if not line.startswith(b"data:"):
                continue
            try:
                event = json.loads(line[5:])
            except (ValueError, RecursionError):  # json's own limit: ~1000 levels
                continue
            if isinstance(event, dict) and self.wire.read_head(event, self):
                self._end()
                return
        if self._chunks >= _HEAD_CHUNKS or len(self._buffer) > _HEAD_LIMIT:
            self._end()

    def _end(self) -> None:
        self.done, self._buffer = True, b""
