"""The streaming relay: bytes to the child's 127.0.0.1 port and back, chunk by chunk."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from corral.proxy.errors import UpstreamFailed, UpstreamRejected, sse_error_event

# Per-connection headers (RFC 9110 §7.6.1) and ones aiohttp recomputes for the new message.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "date", "server",
})
UPSTREAM_BROKE = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)


def new_upstream_session() -> aiohttp.ClientSession:
    # No overall timeout: generations run as long as they run, and a client hang-up cancels
    # them. Raw bytes both ways (no decompression, no cookie jar).
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def sse_headers() -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # tell an nginx in front of us not to buffer either
    }


def _response_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    headers = CIMultiDict((k, v) for k, v in upstream.headers.items()
                          if k.lower() not in _HOP_BY_HOP)
    return headers


async def open_upstream(session: aiohttp.ClientSession, url: str, model: str,
                        **request: Any) -> aiohttp.ClientResponse:
    """POST to a child; a connection that fails before any answer becomes UpstreamFailed."""
    try:
        return await session.post(url, **request)
    except UPSTREAM_BROKE as exc:
        raise UpstreamFailed(f"{model} dropped the request: {exc or type(exc).__name__}") from exc


async def relay(request: web.Request, session: aiohttp.ClientSession, url: str,
                body: bytes, model: str) -> web.StreamResponse:
    """POST `body` to `url` and relay the answer. Raises UpstreamFailed before any byte of the
    answer was sent; after that, a broken child ends the stream with an SSE error event."""
    upstream = await open_upstream(session, url, model, data=body, headers={
        "Content-Type": "application/json",
        "Accept": request.headers.get("Accept", "*/*"),
    })
    try:
        if upstream.content_type == "text/event-stream":
            response = await _relay_stream(request, upstream, model)
        else:
            try:
                payload = await upstream.read()
            except UPSTREAM_BROKE as exc:
                raise UpstreamFailed(f"{model} broke off its answer: {exc}") from exc
            response = web.Response(status=upstream.status, body=payload,
                                    headers=_response_headers(upstream))
    except BaseException:
        # Cancelled (client gone) or broken: drop the upstream connection so the child
        # sees the hang-up and frees its slot, instead of returning it to the pool.
        upstream.close()
        raise
    upstream.release()
    return response


async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse,
                        model: str) -> web.StreamResponse:
    headers = _response_headers(upstream)
    headers.update(sse_headers())
    response = web.StreamResponse(status=upstream.status, headers=headers)
    await response.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
    except UPSTREAM_BROKE as exc:
        await response.write(sse_error_event(
            f"{model} failed mid-stream: {exc or type(exc).__name__}"))
    await response.write_eof()
    return response


async def post_json(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                    model: str) -> dict[str, Any]:
    """A whole (non-streamed) JSON answer from a child, for callers that need its content."""
    resp = await open_upstream(session, url, model, json=payload)
    try:
        data = await resp.json(content_type=None)
    except BaseException as exc:
        resp.close()  # cancelled or broken: make the child see the hang-up
        if isinstance(exc, (*UPSTREAM_BROKE, ValueError)):
            raise UpstreamFailed(f"{model} broke off its answer: {exc}") from exc
        raise
    resp.release()
    if resp.status != 200:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else str(data)[:300]
        raise UpstreamRejected(f"{model} answered HTTP {resp.status}: {message}")
    if not isinstance(data, dict):
        raise UpstreamFailed(f"{model} answered with non-object JSON")
    return data
