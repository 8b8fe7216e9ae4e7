"""The streaming relay: bytes to the child's 127.0.0.1 port and back, chunk by chunk."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from multidict import CIMultiDict

from corral.proxy import client_io
from corral.proxy.child_http import (
    ChildHttpError,
    ChildPool,
    ChildResponse,
    NotBegun,
    Silent,
)
from corral.proxy.client_io import ClientWriter
from corral.proxy.errors import (
    UpstreamFailed,
    UpstreamRejected,
    UpstreamTimeout,
    without_secrets,
)
from corral.proxy.families.numbering import EventNumbering
from corral.proxy.families.wire import StreamHead, Wire, wire_for
from corral.proxy.redact import StreamRedactor, secrets_of
from corral.proxy.rename import StreamRenamer, rename_answer, rename_request
from corral.proxy.sse import sse_headers
from corral.proxy.timing import RequestRecord
from corral.supervisor.port import Lease

log = structlog.get_logger("corral.proxy")

# Per-connection headers (RFC 9110 §7.6.1) and ones aiohttp recomputes for the new message.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "date", "server",
    # Which web pages may read an answer is corral's to say (proxy/edge.py), never a child's:
    # llama-server sends an empty Access-Control-Allow-Origin on every answer.
    "access-control-allow-origin", "access-control-allow-credentials",
    "access-control-allow-headers", "access-control-allow-methods",
    "access-control-expose-headers", "access-control-max-age",
    # A remote's cookies (a CDN's bot cookie, a session of the operator's account) are for
    # corral's own requests, which never send them back: to a client they only leak.
    "set-cookie", "set-cookie2",
    # So do the operator's account's names (OpenAI's and Anthropic's APIs send them on
    # every answer); its rate limits go with _ACCOUNT_PREFIXES.
    "openai-organization", "openai-project", "anthropic-organization-id",
})
# What is left of the operator's quota (x-ratelimit-remaining-tokens, ...): not a client's.
_ACCOUNT_PREFIXES = (b"x-ratelimit-", b"anthropic-ratelimit-")
# A whole answer held in memory, at most (the config's max_answer_mb, where callers pass it).
DEFAULT_ANSWER_LIMIT = 64 * 1024 * 1024
_HOP_BY_HOP_BYTES = frozenset(h.encode() for h in _HOP_BY_HOP)


def _child_headers(response: ChildResponse) -> CIMultiDict[str]:
    # Names compared as bytes: a child sends the same few headers on every answer, and
    # decoding each one only to drop it cost more than the rest of this.
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in response.headers:
        lower = name.lower()
        if lower not in _HOP_BY_HOP_BYTES and not lower.startswith(_ACCOUNT_PREFIXES):
            headers.add(name.decode("latin-1"), value.decode("latin-1"))
    return headers


async def open_child(pool: ChildPool, path: str, model: str, lease: Lease, body: bytes,
                     accept: str, parsed: dict[str, Any] | None = None) -> ChildResponse:
    """POST `body` to the lease's child at `path` and wait for its response head: the
    relay's way, over the ChildPool: the one client to children (groups use it too).

    The lease's auth header is sent, the model's first_byte_timeout bounds the wait for the
    head (UpstreamTimeout), its idle_timeout then bounds every silence in the body (Silent,
    read by the caller), and a request the child never began (stale kept-alive connection) is
    sent again while the child is alive. Other failures before an answer become
    UpstreamFailed. `parsed`: what `body` parses to, when known (not parsed again)."""
    url = lease.base_url + path
    # The prompt cache: the request pinned to a slot, a saved prefix restored into it.
    body = await lease.pin(url, body, parsed)
    if lease.served_name is not None:
        body = rename_request(body, lease.served_name)
    headers = {
        "Content-Type": "application/json",
        "Accept": accept,
        # Bytes corral can read (a served_name is renamed in them): a remote endpoint
        # may compress otherwise, and the relay does not decompress.
        "Accept-Encoding": "identity",
        **lease.headers,
    }
    try:
        return await _send(pool, path, model, lease, headers, body)
    except BaseException:
        # No answer (a hang-up, first_byte_timeout, a dropped connection): the child may
        # never have run it, and its slot holds what it held before (the prompt cache never
        # saves that under this request's tokens).
        lease.refused()
        raise


async def _send(pool: ChildPool, path: str, model: str, lease: Lease,
                headers: dict[str, str], body: bytes) -> ChildResponse:
    for attempt in (1, 2, 3):
        try:
            response = await pool.post(lease.base_url, path, headers, body,
                                       lease.first_byte_timeout, lease.idle_timeout)
            if response.status >= 400:
                lease.refused()  # the prompt cache: its slot may not hold this request
            return response
        except Silent as exc:
            raise UpstreamTimeout(
                f"{model} sent no response within {lease.first_byte_timeout:g}s "
                "(first_byte_timeout)") from exc
        except NotBegun as exc:
            # A remote is never sent a request twice: a POST that reached it may have been
            # done (and paid for), and a connect that failed or timed out fails again (three
            # tries made its 10 s connect timeout 30). A child of corral's closes idle
            # kept-alive connections itself.
            if attempt < 3 and lease.pid is not None and lease.child_alive():
                log.info("upstream.retry", model=model, attempt=attempt, error=str(exc))
                continue
            raise UpstreamFailed(f"{model} dropped the request: {exc}") from exc
        except ChildHttpError as exc:
            raise UpstreamFailed(f"{model} dropped the request: {exc}") from exc
    raise AssertionError("unreachable: the last attempt returns or raises")


def _child_broken(model: str, exc: ChildHttpError, what: str) -> UpstreamFailed:
    """A short reason for a child that broke off `what`."""
    if isinstance(exc, Silent):
        return UpstreamTimeout(f"{model} went silent {what} (idle_timeout)")
    return UpstreamFailed(f"{model} failed {what}: {exc}")


async def relay(request: web.Request, pool: ChildPool, body: bytes, model: str, lease: Lease,
                record: RequestRecord | None = None,
                started: ClientWriter | None = None,
                parsed: dict[str, Any] | None = None,
                answer_limit: int | None = None) -> web.StreamResponse:
    """POST `body` to the lease's child (at the request's path) and relay the answer. Raises
    UpstreamFailed before any byte of the answer was sent; after that, a broken child ends
    the stream with an SSE error event.
    A stream is written here, through proxy/client_io (a client that stops reading is cut off,
    ClientStalled); a whole answer comes back unsent, for the caller to send with
    client_io.send once the lease is back.
    `record` takes the timings and token counts; `started`: an event stream already sent to
    the client (loading progress), which the child's stream continues; `parsed`: what
    `body` parses to, when known; `answer_limit`: the bytes a whole answer may have (it is
    held in memory: a bigger or endless one is a 502).
    The request's path decides its API family (proxy/families/wire.py): where its usage and
    its model's name are, and how a broken stream ends."""
    wire = wire_for(request.path)
    upstream = await open_child(pool, request.path, model, lease, body,
                                request.headers.get("Accept", "*/*"), parsed)
    if record is not None:
        record.head()
        record.restored = lease.restored
    try:
        if upstream.content_type == "text/event-stream":
            response = await _relay_stream(request, upstream, model, record, started, lease,
                                           wire)
        else:
            try:
                payload = await upstream.read(answer_limit)
            except ChildHttpError as exc:
                raise _child_broken(model, exc, "while answering") from exc
            # A remote may quote its key, in an error some send with a 200 too.
            if upstream.status >= 300 or lease.pid is None:
                payload = without_secrets(payload, lease.headers)
            if record is not None:
                record.first_bytes()
                if lease.restored is not None:
                    record.read_usage(payload)  # now, once: the prompt cache checks its restore
                    lease.reused(record.cache_n)
                else:
                    record.answer = payload  # its usage is read once it is sent (finish)
            if lease.served_name is not None:
                payload = rename_answer(payload, lease.served_name, lease.model, wire)
            if upstream.status == 200:  # what the family's type requires and the child left out
                payload = wire.whole(payload, lease.model)
            if started is not None:
                response = await _end_with_answer(started, upstream.status, payload, model,
                                                  wire)
            else:
                response = web.Response(status=upstream.status, body=payload,
                                        headers=_child_headers(upstream))
                if record is not None:
                    response.headers["Server-Timing"] = record.server_timing()
    except BaseException:
        # Cancelled (client gone) or broken: drop the upstream connection so the child
        # sees the hang-up and frees its slot, instead of keeping it for the next request.
        upstream.close()
        raise
    upstream.release()
    return response


async def _end_with_answer(started: ClientWriter, status: int, payload: bytes,
                           model: str, wire: Wire) -> web.StreamResponse:
    """The child answered a stream already under way with a whole body (an error): said in
    the stream, as the family's error events."""
    message = payload[:300].decode(errors="replace")
    await started.write(wire.broken(f"{model} answered HTTP {status}: {message}",
                                    "upstream_error", model, None) + wire.end)
    await started.finish()
    return started.response


async def _relay_stream(request: web.Request, upstream: ChildResponse,
                        model: str, record: RequestRecord | None,
                        started: ClientWriter | None, lease: Lease,
                        wire: Wire) -> web.StreamResponse:
    if started is not None:
        out = started
    else:
        headers = _child_headers(upstream)
        headers.update(sse_headers())
        if record is not None:
            headers["Server-Timing"] = record.server_timing()
        out = client_io.writer(request, web.StreamResponse(status=upstream.status,
                                                           headers=headers), model)
        await out.prepare()
    tail = record.tail if record is not None else None
    renamer = StreamRenamer(lease.served_name, lease.model, wire) \
        if lease.served_name is not None else None
    # A Responses stream without its events' indexes (llama-server's) gets them; one that
    # has them is known by its first event, and then relayed as it comes.
    numbering = wire.numbering(lease.model)
    # The stream's first event, read from its first chunks only (Messages' input tokens, the
    # Responses id its failure must name).
    head = wire.head()
    # Once the head is out (with the first chunk) and its first event read, a stream that
    # needs no rename goes from the child's connection straight into the client's transport,
    # in the connection's callback: no task wakes per chunk. This task then waits for the
    # end, a failure, or a client that is behind (it waits for the client, then the child is
    # read again).
    # A remote may quote its key in an error event of a stream it began: its chunks are looked
    # at on the way (so not relayed directly). A child of corral's has a key of corral's.
    secrets = secrets_of(lease.headers) if lease.pid is None else []
    redactor = StreamRedactor(secrets) if secrets else None
    direct = renamer is None and redactor is None  # the first chunk is yet to go out as usual
    sink: Callable[[bytes], bool] | None = None
    held = b""  # a start that waits for its first event (wire.holds_start)
    try:
        while True:
            # Only the read from the child is the child's fault; a failed write to the client
            # (it hung up, or took nothing for client_write_timeout: ClientStalled) propagates
            # as it is and cancels nothing but this relay.
            try:
                if sink is not None:
                    if await upstream.pump(sink, tail):
                        await out.drain()
                        continue
                    chunk = b""
                else:
                    chunk = await upstream.chunk()
            except ChildHttpError as exc:
                await _end_broken(out, upstream, lease, record, wire, head,
                                  _child_broken(model, exc, "mid-stream"), numbering)
                break
            if redactor is not None:
                if chunk:
                    chunk = redactor.feed(chunk)
                    if not chunk:
                        continue  # all held: the next chunk says whether a key goes on
                else:  # the end: what was held goes out, then the end is read again
                    chunk, redactor = redactor.flush(), None
            if not chunk:
                if held:  # a stream too short to show its first event
                    await out.write(renamer.feed(held) if renamer is not None else held)
                if numbering is not None:
                    rest = numbering.flush()
                    if renamer is not None:
                        rest = renamer.feed(rest)
                    if rest:
                        await out.write(rest)
                if renamer is not None:
                    rest = renamer.flush()
                    if rest:
                        await out.write(rest)
                if tail is not None and wire.cut_short(b"".join(tail)):
                    await _end_broken(out, upstream, lease, record, wire, head, UpstreamFailed(
                        f"{model} ended its stream before its answer's last event"), numbering)
                break
            if tail is not None:
                if not tail and record is not None:
                    record.first_bytes()
                tail.append(chunk)  # the last few only: the usage is in the last event
            if not head.done:
                head.feed(chunk)
                if wire.holds_start:
                    if not head.done:
                        held += chunk
                        continue
                    chunk, held = wire.start(head, lease.model) + held + chunk, b""
                if head.done and record is not None:
                    record.read_stream_head(head)
            if numbering is not None:
                chunk = numbering.feed(chunk)
                if numbering.passing:
                    numbering = None
            if renamer is not None:
                chunk = renamer.feed(chunk)
            if not chunk:
                continue
            await out.write(chunk)
            if direct and head.done:
                direct = False
                sink = out.through()
                if sink is not None and numbering is not None:
                    sink = _numbered(sink, numbering)
        await out.finish()
    finally:
        # Also when the client hangs up (the handler is cancelled): the OpenAI SDK closes
        # the connection as soon as it read `[DONE]`, which may be before the child's
        # stream ended here; the tokens it got were generated and count all the same.
        if record is not None:
            record.read_stream_tail()
            if lease.restored is not None:
                lease.reused(record.cache_n)  # the prompt cache checks its restore
    return out.response


def _numbered(put: Callable[[bytes], bool],
              numbering: EventNumbering) -> Callable[[bytes], bool]:
    """The direct write to the client, with the events' numbers filled in on the way (in the
    connection's callback as well: no task wakes per chunk for them either)."""
    def sink(data: bytes) -> bool:
        data = numbering.feed(data)
        return put(data) if data else False  # an empty chunk would end the chunked body
    return sink


async def _end_broken(out: ClientWriter, upstream: ChildResponse, lease: Lease,
                      record: RequestRecord | None, wire: Wire, head: StreamHead,
                      failure: UpstreamFailed, numbering: EventNumbering | None = None) -> None:
    """End a stream that broke after its head went out: the family's error events, which
    its SDKs raise on (numbered after the child's where corral numbers its events)."""
    timed_out = isinstance(failure, UpstreamTimeout)
    log.warning("proxy.stream_broken", model=lease.model, error=str(failure))
    if record is not None:
        # The status line said 200: the record says what the client was told in the stream.
        record.error_status = 504 if timed_out else 502
    upstream.close()  # the child must see the hang-up (and drop the generation)
    try:  # the client first, in its family's shape
        events = wire.broken(str(failure), "upstream_timeout" if timed_out
                             else "upstream_failed", lease.model, head)
        await out.write(numbering.ending(events) if numbering is not None else events)
    finally:
        # Even when that write fails, stalls or is cancelled (the client gone too): a dead
        # child is marked failed now, a silent one probed now (and killed when it does not
        # answer), so the next request gets a fresh child.
        await lease.report_broken(timed_out=timed_out)


async def post_json(pool: ChildPool, path: str, payload: dict[str, Any], model: str,
                    lease: Lease, limit: int = DEFAULT_ANSWER_LIMIT) -> dict[str, Any]:
    """A whole (non-streamed) JSON answer from a child, for callers that need its content
    (a group's members, the votes' embeddings): the relay's own client and rules (interim
    answers skipped, never resent once a remote may have done it, at most `limit` bytes)."""
    upstream = await open_child(pool, path, model, lease, json.dumps(payload).encode(),
                                "application/json", parsed=payload)
    try:
        raw = await upstream.read(limit)
    except ChildHttpError as exc:
        upstream.close()
        raise _child_broken(model, exc, "while answering") from exc
    except BaseException:
        upstream.close()  # cancelled: make the child see the hang-up
        raise
    upstream.release()
    failed = upstream.status != 200
    if failed or lease.pid is None:  # a remote may quote its key (in a 200 too)
        raw = without_secrets(raw, lease.headers)
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, RecursionError) as exc:  # a hostile upstream nests deep
        raise UpstreamFailed(f"{model} answered with invalid JSON: {exc}") from exc
    if failed:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(data)[:300]
        raise UpstreamRejected(f"{model} answered HTTP {upstream.status}: {message}")
    if not isinstance(data, dict):
        raise UpstreamFailed(f"{model} answered with non-object JSON")
    if lease.served_name is not None and data.get("model") == lease.served_name:
        data["model"] = lease.model
    if lease.restored is not None:  # the prompt cache checks its restore
        timings = data.get("timings")
        cache_n = timings.get("cache_n") if isinstance(timings, dict) else None
        lease.reused(cache_n if type(cache_n) is int else None)
    return data
