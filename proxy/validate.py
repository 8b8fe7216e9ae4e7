"""The shapes of request fields the proxy reads or passes to several models, checked before
anything starts: a malformed request gets a 400 that names the field (`param`), never a 500
from deep inside a handler, and never a model started for a request it cannot serve."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from aiohttp import web

from corral.proxy.errors import ApiError
from corral.proxy.families.shapes import CHECKS, MESSAGES_PATHS

# Deeper JSON than this is refused: nothing OpenAI-shaped needs it (tool schemas included),
# and Python's recursion limit would end the request somewhere far from the parser.
MAX_DEPTH = 64
# Arrays and objects in a body, at most. Each costs the parser about a microsecond (more when
# nested) and the depth walk some more, all on the event loop: a 25 MB body of small nested
# arrays held every other client, and every health probe of the children, for 20 s. Nothing
# OpenAI-shaped comes near: a chat of 10,000 messages with content parts has 30,000.
MAX_CONTAINERS = 500_000
# A JSON string: the brackets inside one (a prompt of code) are no containers.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Sampling fields that must be numbers when given (null means "the default", as in OpenAI).
NUMBER_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "temperature",
                 "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repeat_penalty")


def bad(message: str, param: str | None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code, param=param)


def require_json(request: web.Request) -> None:
    """A body read as JSON must say so: the content types a web page may send without asking
    the browser first (text/plain, forms) never pass (proxy/edge.py says why). No body: no
    claim to check."""
    if not request.can_read_body:
        return
    if request.content_type != "application/json":
        raise ApiError(415, f"a request body here is JSON: send it with Content-Type: "
                       f"application/json (not {request.content_type[:60]!r})",
                       "unsupported_media_type")


async def read_body(request: web.Request, idle: float) -> bytes:
    """The request's whole body, as request.read() reads it (past client_max_size: 413), with
    a deadline on the client: a body that stops coming for `idle` seconds (the config's
    client_write_timeout) is a 408, and the connection is closed. Without it, a client that
    announced a body and sends none, or a byte now and then, held its connection and the
    part it sent for as long as it liked. A Content-Length past the limit is a 413 at once."""
    limit = request.client_max_size
    length = request.content_length
    if length is not None and length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length)
    loop = asyncio.get_running_loop()
    body = bytearray()
    try:
        # One timer for the whole read, moved on with each piece that comes.
        async with asyncio.timeout(idle) as deadline:
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
                deadline.reschedule(loop.time() + idle)
    except TimeoutError as exc:
        raise ApiError(408, f"the request body stopped coming: nothing for {idle:g}s, "
                       f"{len(body)} bytes in", "request_timeout") from exc
    except web.RequestPayloadError as exc:  # e.g. a chunked body cut short
        raise ApiError(400, f"could not read the request body: {exc}", "invalid_body") from exc
    return bytes(body)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (UTF-8, no NaN/Infinity, bounded depth and size in arrays and objects)
    whose top level is an object."""
    brackets = raw.count(b"{") + raw.count(b"[")
    if brackets > MAX_CONTAINERS:
        # Counted again outside strings (a C-speed pass, only for the few bodies with this
        # many brackets), before the parse that would cost the event loop seconds.
        bare = _STRING.sub(b"", raw)
        brackets = bare.count(b"{") + bare.count(b"[")
        if brackets > MAX_CONTAINERS:
            raise ApiError(400, f"request body has more than {MAX_CONTAINERS} arrays and "
                           "objects", "invalid_json")
    try:
        body = _DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and integers past Python's 4300-digit limit.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise ApiError(400, f"request body is not valid JSON: {reason}", "invalid_json") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    # Deeper than MAX_DEPTH takes more brackets than that: most bodies are not walked.
    if brackets > MAX_DEPTH and too_deep(body):
        raise ApiError(400, f"request body is nested more than {MAX_DEPTH} levels deep",
                       "invalid_json")
    return body


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# One decoder for every request: json.loads with a keyword builds a new one each call.
_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def too_deep(value: Any) -> bool:
    """Whether `value` is nested more than MAX_DEPTH levels deep."""
    # Level by level, each level's containers in one comprehension: iterative (a recursive
    # walk would need the very stack depth we are guarding), and no tuple or generator per
    # item. A body of millions of small arrays (a few MB of "[],") took 11 s of the event
    # loop (every other client's, every health probe's) in a walk of (item, depth) pairs;
    # this takes a fifth of that.
    if not isinstance(value, (dict, list)):
        return False
    level = [value]
    for _ in range(MAX_DEPTH):
        level = [child for item in level
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def check_fields(body: dict[str, Any], path: str = "/v1/chat/completions") -> None:
    """Numbers where numbers are expected, a boolean `stream`, and `tools` as the path's API
    shapes them (llama-server answers a malformed `tools` with a 500)."""
    for field in NUMBER_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise bad(f"'{field}' must be a number", field)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list of tools", "tools")
        # OpenAI's tools each say their `type`; Anthropic's each have a `name`, and a custom
        # tool's `type` is optional (Claude Code sends none, on count_tokens too).
        key = "name" if path in MESSAGES_PATHS else "type"
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get(key), str) or (
                    not isinstance(tool.get("type", ""), str)):
                raise bad(f"tools[{i}] must be an object with a string '{key}'", f"tools[{i}]")
    family = CHECKS.get(path)
    if family is not None:  # the Responses and Messages bodies' own fields
        family(body)


def check_messages(body: dict[str, Any], *, required: bool) -> list[dict[str, Any]]:
    """Chat messages: objects with a string `role` and string or content-part-list `content`
    (absent or null only for an assistant turn, which may carry tool calls instead)."""
    messages = body.get("messages")
    if messages is None and not required:
        return []
    if not isinstance(messages, list) or (required and not messages):
        raise bad("'messages' must be a non-empty list of chat messages", "messages",
                  "invalid_messages")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]")
    return messages


def _check_message(message: object, where: str) -> None:
    if not isinstance(message, dict):
        raise bad(f"{where} must be an object with 'role' and 'content'", where,
                  "invalid_messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise bad(f"{where}.role must be a string", f"{where}.role", "invalid_messages")
    for key in ("name", "tool_call_id"):
        if key in message and not isinstance(message[key], str):
            raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_messages")
    if "tool_calls" in message and not isinstance(message["tool_calls"], list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls",
                  "invalid_messages")
    content = message.get("content")
    if content is None and role == "assistant":
        return
    if isinstance(content, list):
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content[{j}]")
    elif not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of content parts",
                  f"{where}.content", "invalid_messages")


def _check_part(part: object, where: str) -> None:
    if not isinstance(part, dict):
        raise bad(f"{where} must be an object like {{\"type\": \"text\", \"text\": ...}}",
                  where, "invalid_messages")
    for key in ("type", "text"):
        if key in part and not isinstance(part[key], str):
            raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_messages")
