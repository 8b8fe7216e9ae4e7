"""What one proxied request cost: queue wait, cold-start wait, time to first byte and token,
tokens in and out. Measured in the relay, told in `Server-Timing`, one log line, the metrics
and the recent-requests list."""

from __future__ import annotations

import collections
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from corral.proxy.answer_tail import top_level_tail
from corral.proxy.families.wire import StreamHead, Wire, count, wire_for
from corral.supervisor.port import Lease, Restored

# The tail of a stream kept to read its usage from: the last few chunks, never the stream.
_TAIL_CHUNKS = 4
# A whole answer up to this size is parsed for its usage at once (microseconds); a larger one
# (embeddings) only around its usage.
_WHOLE_PARSE = 16 * 1024


@dataclass(slots=True)
class RequestRecord:
    model: str
    endpoint: str
    stream: bool = False
    arrived: float = field(default_factory=time.monotonic)
    arrived_wall: float = field(default_factory=time.time)
    queue_s: float | None = None  # waiting for a slot (and for room), not for a start
    start_s: float | None = None  # waiting for a cold model to load
    hit: bool | None = None  # the model was ready when the request came: no wait for a load
    sent_upstream: float | None = None
    ttfb_s: float | None = None  # the child's response head
    ttft_s: float | None = None  # the first body bytes (a stream's first token)
    status: int | None = None
    # Set when the request failed after its stream began (the status line said 200).
    error_status: int | None = None
    duration_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_per_s: float | None = None  # generation speed, as the child measured it
    instance: str | None = None
    pid: int | None = None
    restored: Restored | None = None  # the prompt cache restored a saved prefix for it
    prompt_ms_per_token: float | None = None  # the child's prefill speed for this request
    cache_n: int | None = None  # prompt tokens the child took from its cache (llama-server)
    tail: collections.deque[bytes] = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_CHUNKS))
    # A whole answer, kept until finish() reads its usage: after it was sent, not before.
    answer: bytes | None = None
    worker: int | None = None  # the relay worker that served it (None: the daemon itself)

    @property
    def wire(self) -> Wire:
        """The API family of the endpoint: where its answers say their usage."""
        return wire_for(self.endpoint)

    def leased(self, lease: Lease) -> None:
        """The lease is in: split the wait into start and queue. A request whose instance
        became ready after it came (a cold start, or a restart while it waited) is a miss,
        and the time until then is the start wait; otherwise a hit, all of it queue."""
        now = time.monotonic()
        waited = now - self.arrived
        self.instance, self.pid = lease.instance, lease.pid
        start = min(max(lease.ready_since - self.arrived_wall, 0.0), waited)
        self.hit = start == 0.0
        self.start_s, self.queue_s = start, waited - start
        self.sent_upstream = now

    def head(self) -> None:
        if self.sent_upstream is not None and self.ttfb_s is None:
            self.ttfb_s = time.monotonic() - self.sent_upstream

    def first_bytes(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.arrived

    def server_timing(self) -> str:
        """RFC-style `Server-Timing` (W3C): what is known when the head goes out."""
        parts = []
        for name, value, what in (("queue", self.queue_s, "waiting for a slot"),
                                  ("start", self.start_s, "waiting for the model to load"),
                                  ("ttfb", self.ttfb_s, "the model's first byte")):
            if value is not None:
                parts.append(f'{name};dur={value * 1000:.1f};desc="{what}"')
        if self.restored is not None:
            parts.append(f'prompt-cache;dur={self.restored.seconds * 1000:.1f};'
                         f'desc="restored {self.restored.tokens} prompt tokens"')
        return ", ".join(parts)

    def read_usage(self, body: bytes) -> None:
        """Token counts from a whole JSON answer (the family's `usage`, llama-server's
        `timings`).
        Only those objects are parsed, found from the end: an embeddings answer of megabytes
        is not decoded on the event loop for two numbers."""
        if len(body) <= _WHOLE_PARSE:
            # A chat answer of a few KB: its tail's members from `usage` on (2-3 µs less than
            # the whole), else one parse, cheaper than finding both objects.
            data = top_level_tail(body)
            if data is None:
                try:
                    data = json.loads(body)
                except (ValueError, RecursionError):  # a hostile upstream nests deep
                    return
            if isinstance(data, dict):
                self._take_usage(data)
            return
        found = _usage_objects(body)
        if found:
            self._take_usage(found)

    def read_stream_head(self, head: StreamHead) -> None:
        """What a stream's first event counted: Messages' input tokens (its last events
        count only the output)."""
        if head.tokens_in is not None and self.prompt_tokens is None:
            self.prompt_tokens = head.tokens_in

    def delivered(self) -> bool:
        """A stream whose last event went out whole (before finish() drops the tail)."""
        return self.stream and self.wire.ended(b"".join(self.tail))

    def read_stream_tail(self) -> None:
        """Token counts from the last events of a stream (the chunks kept in `tail`)."""
        text = b"".join(self.tail)
        for line in reversed(text.split(b"\n")):
            if not line.startswith(b"data: {") or (b'"usage"' not in line
                                                   and b'"timings"' not in line):
                continue
            try:
                data = json.loads(line[6:])
            except (ValueError, RecursionError):  # a hostile upstream nests deep
                continue
            if isinstance(data, dict):
                self._take_usage(data)
                return
        # The last event began before the tail (a Responses stream ends with the whole
        # response, its text included, in one event): its usage is at its end, near the
        # stream's.
        found = _usage_objects(text)
        if found:
            self._take_usage(found)

    def _take_usage(self, data: dict[str, Any]) -> None:
        tokens_in, tokens_out = self.wire.usage(data)
        if tokens_in is not None:
            self.prompt_tokens = tokens_in
        if tokens_out is not None:
            self.completion_tokens = tokens_out
        timings = data.get("timings")
        if isinstance(timings, dict):
            self.cache_n = count(timings.get("cache_n"))
            # llama-server's own figures: the prompt it evaluated (cache hits excluded) and
            # the tokens it generated, with its generation speed.
            if self.completion_tokens is None:
                self.completion_tokens = count(timings.get("predicted_n"))
            if self.prompt_tokens is None:
                prompt = count(timings.get("prompt_n"))
                cached = count(timings.get("cache_n")) or 0
                self.prompt_tokens = prompt + cached if prompt is not None else None
            per_token = _rate(timings.get("prompt_per_token_ms"))
            if per_token is not None:
                self.prompt_ms_per_token = per_token
            speed = _rate(timings.get("predicted_per_second"))
            if speed is not None:
                self.tokens_per_s = speed

    def finish(self, status: int) -> None:
        if self.answer is not None:
            self.read_usage(self.answer)
            self.answer = None  # kept in the recent list: no answer bytes with it
        self.status = self.error_status or status
        self.tail.clear()  # kept in the recent list: no stream bytes with it
        self.duration_s = time.monotonic() - self.arrived
        if self.tokens_per_s is None and self.completion_tokens and self.ttft_s is not None:
            generating = self.duration_s - self.ttft_s
            if self.stream and generating > 0 and self.completion_tokens > 1:
                self.tokens_per_s = (self.completion_tokens - 1) / generating

    def as_dict(self) -> dict[str, Any]:
        def ms(value: float | None) -> float | None:
            return round(value * 1000, 1) if value is not None else None

        return {
            "time": self.arrived_wall, "model": self.model, "endpoint": self.endpoint,
            "instance": self.instance, "pid": self.pid, "stream": self.stream,
            "status": self.status, "hit": self.hit,
            "queue_ms": ms(self.queue_s), "start_ms": ms(self.start_s),
            "ttfb_ms": ms(self.ttfb_s), "ttft_ms": ms(self.ttft_s),
            "total_ms": ms(self.duration_s),
            "tokens_in": self.prompt_tokens, "tokens_out": self.completion_tokens,
            "tokens_per_s": round(self.tokens_per_s, 1) if self.tokens_per_s else None,
            "prompt_cache_tokens": self.restored.tokens if self.restored else None,
            "worker": self.worker,
        }


_DECODER = json.JSONDecoder()


def _usage_objects(body: bytes) -> dict[str, Any]:
    """The last `usage` and `timings` objects in `body`, found from its end."""
    return {key: value for key in ("usage", "timings")
            if (value := _object_after(body, key)) is not None}


def _object_after(body: bytes, key: str) -> dict[str, Any] | None:
    """The JSON object that follows the last `"key":` in `body`, or None."""
    at = body.rfind(f'"{key}"'.encode())
    if at < 0:
        return None
    colon = body.find(b":", at)
    if colon < 0:
        return None
    # These objects are a few hundred bytes: never decode more than a little of the body.
    text = body[colon + 1:colon + 1 + 16384].decode("utf-8", "replace").lstrip()
    try:
        value, _ = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # a hostile upstream nests deep
        return None
    return value if isinstance(value, dict) else None


def _rate(value: object) -> float | None:
    """A speed the child measured: a positive, finite number. Python's json reads Infinity,
    which /admin/requests would write back as no JSON a browser parses."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        rate = float(value)
    except OverflowError:  # an int past a float's range
        return None
    return rate if 0 < rate < math.inf else None
