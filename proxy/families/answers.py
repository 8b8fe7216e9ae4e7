"""A member's answer in its family, read into chat terms: what a group's writers, votes and
accounting read, every field of its type (a text, tool calls whose arguments are JSON text,
token counts). An answer of the wrong shape is NotAnAnswer, which the group runner counts as
that member's error; a member's words are only ever data, relayed inside the client's
events, never parsed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from corral.proxy.families.wire import MAX_TOKENS
from corral.proxy.validate import too_deep


@dataclass
class Answer:
    """One assistant answer in chat terms: what a member said, or what a group answers."""

    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat `tool_calls`
    finish: str = "stop"  # stop | length | tool_calls
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, total_tokens
    # The stop string that ended it (finish "stop"), where the member said which: Messages'
    # `stop_sequence`, vLLM's chat `stop_reason`. llama-server's chat answer does not say.
    stop_sequence: str | None = None


class NotAnAnswer(TypeError):
    """A member's answer that is not one of its family (a TypeError: what the group runner
    counts as a member that answered without a message)."""


def _count(value: Any, what: str) -> int:
    """A token count a member reported: a whole number, or none at all."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= MAX_TOKENS) or (isinstance(value, float) and not value.is_integer()):
        raise NotAnAnswer(f"its usage's {what} is {str(value)[:40]!r}, not a token count")
    return int(value)


def chat_usage(prompt: Any, completion: Any) -> dict[str, int]:
    p, c = _count(prompt, "input"), _count(completion, "output")
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def part_text(part: Any) -> str:
    """A part's text, or nothing (a part without one, or with null)."""
    text = part.get("text") if isinstance(part, dict) else None
    return text if isinstance(text, str) else ""


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part_text(p) for p in content)
    return content if isinstance(content, str) else ""


def member_answer(api: str, data: Any) -> Answer:
    """A member's whole answer in its family, as chat terms, every field of the type the
    group's writers and votes read (a text, calls whose arguments are JSON text, counts);
    NotAnAnswer (a TypeError) when it is not an answer of that family. What a member wrote
    is only ever data: its text is relayed inside the client's events, never parsed."""
    if not isinstance(data, dict):
        raise NotAnAnswer(f"its answer is a JSON {type(data).__name__}, not an object")
    if api == "responses":
        return _from_responses(data)
    if api == "messages":
        return _from_messages(data)
    return _from_chat(data)


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise NotAnAnswer(f"its {what} is not a list")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise NotAnAnswer(f"its {what} is not an object")
    return value


def _string(value: Any, what: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise NotAnAnswer(f"its {what} is not a string")
    return value


def _call(call_id: Any, name: Any, arguments: Any, n: int) -> dict[str, Any]:
    """A tool call in chat's shape. Arguments given as an object (some servers do) become
    the JSON text chat carries; a call without a name is no call a client could make."""
    name = _string(name, "tool call's name")
    if not name:
        raise NotAnAnswer("it made a tool call without a name")
    if not isinstance(arguments, str):
        if arguments is not None and not isinstance(arguments, dict):
            raise NotAnAnswer("its tool call's arguments are neither JSON text nor an object")
        if too_deep(arguments):  # json.dumps would run out of stack on it
            raise NotAnAnswer("its tool call's arguments are nested too deeply")
        arguments = json.dumps(arguments or {})
    return {"id": _string(call_id, "tool call's id") or f"call_{n}", "type": "function",
            "function": {"name": name, "arguments": arguments or "{}"}}


def arguments_object(raw: Any) -> dict[str, Any]:
    """A chat tool call's arguments (JSON text) as the object Messages' `tool_use.input`
    is. Text that is no JSON object still reaches the other side: broken or too deep
    (a client's or a member's string, which no request's depth check saw) as
    {"arguments": text}, another JSON value as {"value": ...}."""
    try:
        value = json.loads(raw or "{}") if isinstance(raw, str) else raw
    except (ValueError, RecursionError):  # json raises RecursionError past ~1000 levels
        return {"arguments": raw}
    if too_deep(value):  # read, but too deep to be written out again safely
        return {"arguments": raw}
    return value if isinstance(value, dict) else {"value": value}


def _usage(data: dict[str, Any]) -> dict[str, Any]:
    usage = data.get("usage")
    return {} if usage is None else _object(usage, "usage")


def _from_chat(data: dict[str, Any]) -> Answer:
    choice = _object(_list(data["choices"], "choices")[0], "choice")
    message = _object(choice["message"], "message")
    content = message.get("content")
    text = text_of(content) if isinstance(content, list) else _string(content, "content")
    calls = [_call(c.get("id"), _object(c.get("function"), "tool call").get("name"),
                   c["function"].get("arguments"), n)
             for n, c in enumerate(_list(message.get("tool_calls") or [], "tool_calls"))
             if _object(c, "tool call")]
    finish = choice.get("finish_reason") or "stop"
    usage = _usage(data)
    end = "tool_calls" if calls else finish if finish in ("stop", "length") else "stop"
    return Answer(text, calls, end,
                  chat_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
                  if usage else None, chat_stop_string(choice, end))


def chat_stop_string(choice: dict[str, Any], finish: str | None) -> str | None:
    """The stop string a chat choice ended on, where the server says it: vLLM's
    `stop_reason` (a string when one of the request's `stop` strings matched, a token id or
    null otherwise). OpenAI and llama-server do not say."""
    reason = choice.get("stop_reason")
    return reason if finish == "stop" and isinstance(reason, str) and reason else None


def stream_chunk(event: Any) -> tuple[str, str | None, dict[str, int] | None, str | None]:
    """One chunk of a member's streamed chat answer (a synthesizer's): its text, its finish
    reason, its usage and the stop string it ended on (where said), each of its type;
    NotAnAnswer when it is no chat chunk."""
    chunk = _object(event, "chunk")
    usage = chunk.get("usage")
    counts = None
    if usage is not None:
        usage = _object(usage, "chunk's usage")
        counts = chat_usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
    choices = _list(chunk.get("choices") or [], "chunk's choices")
    if not choices:
        return "", None, counts, None
    choice = _object(choices[0], "chunk's choice")
    delta = _object(choice.get("delta") or {}, "chunk's delta")
    finish = _string(choice.get("finish_reason"), "finish_reason") or None
    return (_string(delta.get("content"), "chunk's content"), finish, counts,
            chat_stop_string(choice, finish))


def _from_responses(data: dict[str, Any]) -> Answer:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in _list(data["output"], "output"):
        kind = _object(item, "output item").get("type")
        if kind == "message":
            for part in _list(item.get("content") or [], "message's content"):
                if _object(part, "content part").get("type") == "output_text":
                    text.append(_string(part.get("text"), "output_text"))
        elif kind == "function_call":
            calls.append(_call(item.get("call_id"), item.get("name"), item.get("arguments"),
                               len(calls)))
    usage = _usage(data)
    cut = data.get("status") == "incomplete"
    return Answer("".join(text), calls,
                  "tool_calls" if calls else "length" if cut else "stop",
                  chat_usage(usage.get("input_tokens"), usage.get("output_tokens")))


def _from_messages(data: dict[str, Any]) -> Answer:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in _list(data["content"], "content"):
        kind = _object(block, "content block").get("type")
        if kind == "text":
            text.append(_string(block.get("text"), "text block"))
        elif kind == "tool_use":
            tool_input = block.get("input")
            if not isinstance(tool_input, dict):
                raise NotAnAnswer("its tool_use input is not an object")
            calls.append(_call(block.get("id"), block.get("name"), tool_input, len(calls)))
    usage = _usage(data)
    stop = data.get("stop_reason")
    prompt = sum(_count(usage.get(k), k) for k in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    sequence = data.get("stop_sequence") if stop == "stop_sequence" else None
    return Answer("".join(text), calls,
                  "tool_calls" if calls else "length" if stop == "max_tokens" else "stop",
                  chat_usage(prompt, usage.get("output_tokens")),
                  None if calls else _string(sequence, "stop_sequence") or None)
