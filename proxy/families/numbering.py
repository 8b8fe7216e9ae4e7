"""The numbers a Responses stream's events carry, put in where the server left them out.

OpenAI's Responses events say where they belong: `sequence_number` on every event,
`output_index` (which item of the response's `output`) on the item's events, `content_index`
(which part of the item's `content`) on a part's. The OpenAI SDK's `responses.stream()` helper
(and any client that builds the response up by index) looks items and parts up by them.
llama-server's `/v1/responses` stream leaves all three out, and `logprobs` of its text events:
through corral they are filled in, counted the way OpenAI counts them (items in the order they
were added, a part's index within its item). A stream whose first event already carries a
`sequence_number` (vLLM's, transformers', OpenAI's own) numbers its own events and passes
through untouched, byte for byte. The `response` object of its lifecycle events gets the
fields OpenAI's `Response` requires that llama-server leaves out (lifecycle.py).

The missing numbers are appended at each event's end (its own bytes are kept); an event is
parsed only where it may move them (a delta like the one before it, and an event of no item,
are not): O(1) per event, and the memory held is one partial line and a bounded map of item
ids."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from corral.proxy.families.lifecycle import LIFECYCLE, complete_response
from corral.proxy.sse import Lines
from corral.supervisor.json_bytes import compact

__all__ = ["EventNumbering"]

# The items whose ids are remembered (a response has a few; a hostile stream may add any
# number): past this the oldest is forgotten, and its later events take the latest item's index.
_ITEMS_LIMIT = 256

# The events that name a content part of their item (`content_index`).
_PART_EVENTS = frozenset({
    "response.content_part.added", "response.content_part.done",
    "response.output_text.delta", "response.output_text.done",
    "response.output_text.annotation.added",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.refusal.delta", "response.refusal.done",
})
# The keys an event may have of its own (then left as they are), and their quoted names.
_KEYS = tuple((key, b'"%s"' % key.encode()) for key in (
    "sequence_number", "output_index", "content_index", "logprobs"))
# Events that change nothing but their item's text: one like the one before (same kind, same
# item) is numbered like it, without being parsed.
_DELTAS = frozenset({b"response.output_text.delta", b"response.function_call_arguments.delta",
                     b"response.reasoning_text.delta", b"response.refusal.delta"})
# Events that move where the next delta goes.
_PLACING = frozenset({"response.output_item.added", "response.content_part.added"})
_DELTA = re.compile(rb'\{"type":"([a-z_.]+)","item_id":"([^"\\]+)"')
# Text events, whose `logprobs` list the SDK's types require (empty: none were asked for).
_TEXT_EVENTS = frozenset({"response.output_text.delta", "response.output_text.done"})


class EventNumbering:
    """A Responses stream's chunks, with `sequence_number`, `output_index`, `content_index`
    (and a text event's `logprobs`) added to every `data:` event that lacks them, once the
    first event showed the stream does not number its own (`passing` otherwise: then every
    chunk goes out as it came). Chunks split events anywhere: whole lines go out, the last
    partial line waits for the next chunk."""

    __slots__ = ("_created", "_filled", "_items", "_last", "_last_numbers", "_lines", "_model",
                 "_next_output", "_sequence", "decided", "passing")

    def __init__(self, model: str = "") -> None:
        self._lines = Lines()  # a line with no end past its limit goes out as it is
        self.decided = False  # the first event was read
        self.passing = False  # the stream numbers its own events
        self._sequence = 0
        self._next_output = 0
        # item id -> [output index, index of its latest content part (-1: none yet)]
        self._items: dict[str, list[int]] = {}
        # The last delta's (kind, item id), and the numbers it got after its sequence_number.
        self._last: tuple[bytes, bytes] | None = None
        self._last_numbers = b""
        # What a lifecycle event's response lacks is filled in with the model corral serves,
        # and the time the response was created (the child's own, once it says one).
        self._model = model
        self._created: int | None = None
        # The last lifecycle event as it came, and completed (without its sequence_number):
        # llama-server repeats the same one before each delta of some models.
        self._filled: tuple[bytes, bytes] = (b"", b"")

    def feed(self, chunk: bytes) -> bytes:
        if self.passing:
            return chunk
        data, whole = self._lines.feed(chunk)
        if not whole:
            return data
        if self.decided:
            return b"".join([self._line(line) if line.startswith(b"data:") else line
                             for line in data.splitlines(keepends=True)])
        out: list[bytes] = []
        at = 0
        for line in data.splitlines(keepends=True):
            out.append(self._line(line))
            at += len(line)
            if self.passing:  # the rest of what came is the child's, untouched
                out.append(data[at:] + self._lines.flush())
                break
        return b"".join(out)

    def flush(self) -> bytes:
        rest = self._lines.flush()
        return self._line(rest) if rest and not self.passing else rest

    def ending(self, events: bytes) -> bytes:
        """corral's own events that end a stream the child broke off (response.failed,
        error), numbered after the child's. A partial line of the child's is dropped: its
        event never ended, and a client discards it."""
        self._lines.flush()
        return self.feed(events)

    def _line(self, line: bytes) -> bytes:
        if not line.startswith(b"data:"):
            return line
        body = line[5:].strip()
        ending = line[len(line.rstrip(b"\r\n")):]
        # A delta like the one before it (the same item and kind, the same keys of its own:
        # most of a stream) takes the same numbers but its sequence_number, unparsed.
        delta = _DELTA.match(body)
        if delta is not None and (delta[1], delta[2]) == self._last and _bare(body):
            self._sequence += 1
            return (b"data: " + body[:-1] + b',"sequence_number":%d' % (self._sequence - 1)
                    + self._last_numbers + b"}" + ending)
        # An event of no item (the response's own: llama-server repeats response.created and
        # response.in_progress before each delta of some models; its last event holds the
        # whole answer) takes a sequence_number alone, unparsed too.
        if self.decided and b'"item' not in body and body.startswith(b'{"') and _bare(body):
            if b'"response"' in body:  # a lifecycle event (its key: no event type is it)
                body = self._completed(body)
            self._sequence += 1
            return (b"data: " + body[:-1] + b',"sequence_number":%d}' % (self._sequence - 1)
                    + ending)
        try:
            event = json.loads(body)
        except (ValueError, RecursionError):  # a hostile upstream nests deep
            return line
        if not isinstance(event, dict):
            return line
        if not self.decided:
            self.decided = True
            if "sequence_number" in event:
                self.passing = True
                return line
        # (Its response's own output may hold logprobs: the event's own keys decide.)
        if event.get("type") in LIFECYCLE and "sequence_number" not in event:
            body = self._completed(body)
        added = self._numbers(event)
        if delta is not None and delta.group(1) in _DELTAS and _bare(body):
            self._last = (delta[1], delta[2])
            self._last_numbers = added[added.find(b",", 1):] if b"," in added[1:] else b""
        elif event.get("type") in _PLACING:
            self._last = None  # an item or a part began: the next delta is placed anew
        if not added:
            return line
        head = body[:-1] + b"," if event else b"{"
        return b"data: " + head + added[1:] + b"}" + ending

    def _completed(self, body: bytes) -> bytes:
        """A lifecycle event's JSON (an object without its numbers) with its response's
        missing fields filled in; the event as it came when it lacks none, or is another."""
        if body == self._filled[0]:
            return self._filled[1]
        try:
            event = json.loads(body)
        except (ValueError, RecursionError):  # a hostile upstream nests deep
            return body
        if not isinstance(event, dict) or event.get("type") not in LIFECYCLE \
                or not isinstance(event.get("response"), dict):
            return body
        response = event["response"]
        own = response.get("created_at")
        if self._created is None:
            self._created = own if type(own) is int else int(time.time())
        # One response, created once: llama-server's last event says when it ended instead.
        moved = own is not None and own != self._created
        if moved:
            response["created_at"] = self._created
        filled = complete_response(response, self._model, self._created)
        done = compact(event) if filled or moved else body
        self._filled = (body, done)
        return done

    def _numbers(self, event: dict[str, Any]) -> bytes:
        """What `event` lacks, as `,"key":value` pairs."""
        added = b""
        if "sequence_number" not in event:
            added += b',"sequence_number":%d' % self._sequence
        self._sequence += 1
        kind = event.get("type")
        item = event.get("item")
        item_id = item.get("id") if isinstance(item, dict) else event.get("item_id")
        if kind == "response.output_item.added":
            own = event.get("output_index")
            index = own if type(own) is int else self._next_output
            self._next_output = max(self._next_output, index + 1)
            if isinstance(item_id, str):
                self._remember(item_id, index)
            place = [index, -1]
        elif item is None and item_id is None:
            return added  # not an item's event (the response's own, an error)
        else:
            found = self._items.get(item_id) if isinstance(item_id, str) else None
            # An item never added, or forgotten: the latest one's.
            place = found if found is not None else [max(self._next_output - 1, 0), -1]
        if "output_index" not in event:
            added += b',"output_index":%d' % place[0]
        if kind in _PART_EVENTS:
            if kind == "response.content_part.added":
                place[1] += 1
            if "content_index" not in event:
                added += b',"content_index":%d' % max(place[1], 0)
            if kind in _TEXT_EVENTS and "logprobs" not in event:
                added += b',"logprobs":[]'
        return added

    def _remember(self, item_id: str, index: int) -> None:
        if len(self._items) >= _ITEMS_LIMIT:
            del self._items[next(iter(self._items))]
        self._items[item_id] = [index, -1]


def _bare(body: bytes) -> bool:
    """Whether an event's JSON has none of the numbers of its own (found by their quoted
    names, which a string's text cannot hold: its quotes are escaped) and ends as an object."""
    return (b'"sequence_number"' not in body and b'"output_index"' not in body
            and b'"content_index"' not in body and b'"logprobs"' not in body
            and body.endswith(b"}"))
