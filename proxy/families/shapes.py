"""The shapes of a Responses or Messages request's own fields, checked before anything starts,
for a single model (llama-server answers some malformed bodies with a 500, or loads a model
for a request it then refuses) and for a group (whose translation reads these fields): a wrong
type is a 400 naming the field, as the family's own API would answer it.

Only types are checked, and only of what the family defines: an item, part or tool of a type
corral does not know passes to a single model as is (a server may know it); a group refuses it
when it translates. Absent and null fields are the API's defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from corral.proxy.errors import ApiError


def bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request", param=param)


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    # JSON's true and false are ints to Python: never a number or a string here.
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str,
          what: str, required: bool = False) -> None:
    """`obj[key]`, when given and not null, is of `kind` (`what` says it to the client);
    a `required` one must be given (the SDKs' types say which)."""
    value = obj.get(key)
    if (value is None and required) or (value is not None and not _is(value, kind)):
        raise bad(f"{where}.{key} must be {what}", f"{where}.{key}")


def _objects(value: Any, where: str, what: str) -> list[dict[str, Any]]:
    """A list of objects (each with a string `type` when it says one)."""
    if not isinstance(value, list):
        raise bad(f"{where} must be {what}", where)
    for n, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad(f"{where}[{n}] must be an object", f"{where}[{n}]")
        _need(item, "type", str, f"{where}[{n}]", "a string")
    return value


def _each(value: Any, where: str, what: str, check: Callable[[dict[str, Any], str], None],
          required: bool = True) -> None:
    """A string, or a list of objects each passed to `check` (a content list); null only
    when not `required`."""
    if value is None:
        if required:
            raise bad(f"{where} must be {what}", where)
        return
    if not isinstance(value, str):
        for n, part in enumerate(_objects(value, where, what)):
            check(part, f"{where}[{n}]")


def _need_top(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> None:
    value = body.get(key)
    if value is not None and not _is(value, kind):
        raise bad(f"'{key}' must be {what}", key)


# -- Responses ------------------------------------------------------------------------------

def check_responses(body: dict[str, Any]) -> None:
    source = body.get("input")
    if source is not None and not isinstance(source, str):
        for n, item in enumerate(_objects(source, "input", "a string or a list of input "
                                                            "items")):
            _response_item(item, f"input[{n}]")
    _need_top(body, "instructions", str, "a string")
    _need_top(body, "previous_response_id", str, "a string")
    _need_top(body, "parallel_tool_calls", bool, "true or false")
    for n, tool in enumerate(_objects(body["tools"], "tools", "a list of tools")
                             if body.get("tools") is not None else []):
        if tool.get("type") == "function":
            where = f"tools[{n}]"
            if not _is(tool.get("name"), str):
                raise bad(f"{where}.name must be a string", f"{where}.name")
            _need(tool, "description", str, where, "a string")
            _need(tool, "parameters", dict, where, "an object (a JSON Schema)")
            _need(tool, "strict", bool, where, "true or false")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, str):
        if not isinstance(choice, dict) or not _is(choice.get("type"), str):
            raise bad("'tool_choice' must be a string or an object with a string type",
                      "tool_choice")
        if choice["type"] == "function":
            _need(choice, "name", str, "tool_choice", "a string")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad("'text' must be an object", "text")
        shape = text.get("format")
        if shape is not None:
            if not isinstance(shape, dict) or not _is(shape.get("type"), str):
                raise bad("text.format must be an object with a string type", "text.format")
            _need(shape, "name", str, "text.format", "a string")
            _need(shape, "schema", dict, "text.format", "an object (a JSON Schema)")
            _need(shape, "strict", bool, "text.format", "true or false")


def _response_item(item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        _need(item, "role", str, where, "a string", required=True)
        _each(item.get("content"), f"{where}.content", "a string or a list of content parts",
              _response_part)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            _need(item, key, str, where, "a string", required=True)
        _need(item, "id", str, where, "a string")
    elif kind == "function_call_output":
        _need(item, "call_id", str, where, "a string", required=True)
        _each(item.get("output"), f"{where}.output", "a string or a list of content parts",
              _response_part)
    elif kind in ("input_text", "output_text", "input_image"):
        _response_part(item, where)  # a bare part as an item: what the API takes too


def _response_part(part: dict[str, Any], where: str) -> None:
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        _need(part, "text", str, where, "a string", required=True)
    elif kind == "input_image":
        _need(part, "image_url", str, where, "a string (a URL or a data: URL)")
        _need(part, "detail", str, where, "a string")


# -- Messages -------------------------------------------------------------------------------

def check_messages_api(body: dict[str, Any]) -> None:
    turns = body.get("messages")
    if not isinstance(turns, list):  # the one field Messages cannot do without
        raise bad("'messages' must be a list of messages", "messages")
    for n, turn in enumerate(turns):
        where = f"messages[{n}]"
        if not isinstance(turn, dict) or not _is(turn.get("role"), str):
            raise bad(f"{where} must be an object with a string role", where)
        _each(turn.get("content"), f"{where}.content", "a string or a list of content blocks",
              _block)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        for n, block in enumerate(_objects(system, "system", "a string or a list of text "
                                                             "blocks")):
            _need(block, "text", str, f"system[{n}]", "a string")
    for n, tool in enumerate(_objects(body["tools"], "tools", "a list of tools")
                             if body.get("tools") is not None else []):
        _need(tool, "name", str, f"tools[{n}]", "a string")
        _need(tool, "description", str, f"tools[{n}]", "a string")
        _need(tool, "input_schema", dict, f"tools[{n}]", "an object (a JSON Schema)")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or not _is(choice.get("type"), str):
            raise bad("'tool_choice' must be an object with a string type", "tool_choice")
        _need(choice, "name", str, "tool_choice", "a string")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list)
                                  and all(_is(s, str) for s in stops)):
        raise bad("'stop_sequences' must be a list of strings", "stop_sequences")


def _block(block: dict[str, Any], where: str) -> None:
    kind = block.get("type")
    if kind == "text":
        _need(block, "text", str, where, "a string", required=True)
    elif kind == "image":
        source = block.get("source")
        if not isinstance(source, dict) or not _is(source.get("type"), str):
            raise bad(f"{where}.source must be an object with a string type", f"{where}.source")
        for key in ("data", "media_type", "url"):
            _need(source, key, str, f"{where}.source", "a string")
    elif kind == "tool_use":
        for key in ("id", "name"):
            _need(block, key, str, where, "a string", required=True)
        _need(block, "input", dict, where, "an object", required=True)
    elif kind == "tool_result":
        _need(block, "tool_use_id", str, where, "a string", required=True)
        _need(block, "is_error", bool, where, "true or false")
        _each(block.get("content"), f"{where}.content", "a string or a list of content blocks",
              _block, required=False)


# The paths whose bodies are Messages requests: count_tokens takes one (less max_tokens).
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "/v1/responses": check_responses, **dict.fromkeys(MESSAGES_PATHS, check_messages_api)}
