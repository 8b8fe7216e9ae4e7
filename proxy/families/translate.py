"""Requests and answers between the three API families, for groups: a group runs on chat
requests, so a Responses or Messages client's request becomes one (`to_chat`), and a member
that speaks only Responses or only Messages (`api:` on a command or remote model) gets the
chat request in its own family and its answer back as chat (`member_request`,
`member_answer`). Text, images, tools, tool calls and their results translate; what has no
counterpart in the other family (a provider's built-in tools, reasoning items) is left out."""

from __future__ import annotations

import json
from typing import Any

from corral.proxy.families.answers import (
    Answer,
    NotAnAnswer,
    arguments_object,
    member_answer,
    part_text,
    stream_chunk,
    text_of,
)
from corral.proxy.families.shapes import bad
from corral.proxy.validate import check_fields

# A member's answer is read in answers.py; the groups take it from here with the requests.
__all__ = ["DEFAULT_MAX_TOKENS", "PATHS", "Answer", "NotAnAnswer", "member_answer",
           "member_request", "stream_chunk", "to_chat"]

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}
# A Messages request must say how long an answer may be; a chat request need not.
DEFAULT_MAX_TOKENS = 4096


# -- a client's request, as the chat request a group runs ----------------------------------

def to_chat(family: str, body: dict[str, Any]) -> dict[str, Any]:
    """The chat request for a client's body in `family`; a 400 naming the client's field for
    anything of the wrong type (shapes.py), or that a group cannot run."""
    if family != "chat":
        check_fields(body, PATHS[family])
    if family == "responses":
        return responses_to_chat(body)
    if family == "messages":
        return messages_to_chat(body)
    return body


def _copy(body: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {new: body[old] for old, new in names.items() if body.get(old) is not None}


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("previous_response_id") is not None:
        raise bad("corral keeps no responses: send the whole conversation in 'input' instead "
                  "of 'previous_response_id'", "previous_response_id")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    source = body.get("input")
    if isinstance(source, str):
        messages.append({"role": "user", "content": source})
    elif isinstance(source, list):
        for n, item in enumerate(source):
            _response_item(item, messages, f"input[{n}]")
    else:
        raise bad("'input' must be a string or a list of input items", "input")
    chat: dict[str, Any] = {
        "model": body.get("model"), "messages": messages,
        **_copy(body, {"temperature": "temperature", "top_p": "top_p", "stream": "stream",
                       "max_output_tokens": "max_tokens", "parallel_tool_calls":
                       "parallel_tool_calls"})}
    tools = [_response_tool(t) for t in body.get("tools") or []
             if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            chat["tool_choice"] = {"type": "function",
                                   "function": {"name": _name(choice, "tool_choice")}}
    text_format = (body.get("text") or {}).get("format")
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        if not isinstance(text_format.get("schema"), dict):
            raise bad("text.format of type json_schema needs a 'schema' object",
                      "text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: text_format[k] for k in ("name", "schema", "strict", "description")
            if k in text_format}}
    elif isinstance(text_format, dict) and text_format.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _name(obj: dict[str, Any], where: str) -> str:
    """The name a tool, a call or a choice of tool must have for a member to use it."""
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
    return name


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _response_item(item: Any, messages: list[dict[str, Any]], where: str) -> None:
    if not isinstance(item, dict):
        raise bad(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(f"{where}.role must be user, assistant, system or developer", "input")
        content = item.get("content")
        if isinstance(content, list):
            content = [_response_part(p, f"{where}.content") for p in content]
            if role != "user":  # only a user turn's content may carry images in chat
                content = "".join(part_text(p) for p in content)
        elif not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of parts", "input")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": content})
    elif kind == "function_call":
        call = {"id": item.get("call_id") or item.get("id") or f"call_{len(messages)}",
                "type": "function", "function": {"name": _name(item, where),
                             "arguments": item.get("arguments") or "{}"}}
        last = messages[-1] if messages else None
        # Calls made in one turn are one assistant message in chat.
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            if not last.get("content"):
                last["content"] = None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = "".join(part_text(p) for p in output)
        if not isinstance(item.get("call_id"), str):
            raise bad(f"{where}.call_id must name the function_call it answers",
                      f"{where}.call_id")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": output if isinstance(output, str) else json.dumps(output)})
    elif kind == "reasoning":
        return  # a model's own reasoning: nothing a member can read
    elif kind == "item_reference":
        # An item of a stored response: corral keeps none, and leaving it out would give
        # the members another conversation than the client's (as previous_response_id).
        raise bad(f"{where}: corral keeps no responses, so an item_reference names nothing; "
                  "send the item itself", "input")
    else:
        raise bad(f"{where}: items of type {str(kind)[:40]!r} are not supported by groups "
                  f"(message, function_call and function_call_output are)", "input")


def _response_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part_text(part)}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad(f"{where}: an input_image needs an image_url (a URL or a data: URL; "
                      "file ids are not supported)", "input")
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad(f"{where}: parts of type {str(kind)[:40]!r} are not supported by groups "
              "(input_text and input_image are)", "input")


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "\n".join(part_text(b) for b in system)
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    turns = body.get("messages")
    if not isinstance(turns, list):
        raise bad("'messages' must be a list of messages", "messages")
    for n, turn in enumerate(turns):
        _message_turn(turn, messages, f"messages[{n}]")
    chat: dict[str, Any] = {
        "model": body.get("model"), "messages": messages,
        **_copy(body, {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "stream": "stream", "max_tokens": "max_tokens",
                       "stop_sequences": "stop"})}
    tools = [{"type": "function", "function": {
        "name": t.get("name"), "description": t.get("description") or "",
        "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}}
        for t in body.get("tools") or []
        # A provider's own tools (web search, bash, ...) carry a type: no member has them.
        if isinstance(t, dict) and t.get("type") in (None, "custom") and _name(t, "tools")]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool" and isinstance(choice, dict):
            chat["tool_choice"] = {"type": "function",
                                   "function": {"name": _name(choice, "tool_choice")}}
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False  # at most one call: chat's way to say it
    return chat


def _message_turn(turn: Any, messages: list[dict[str, Any]], where: str) -> None:
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise bad(f"{where} must be a message with role user or assistant", "messages")
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of blocks", "messages")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": part_text(block)})
        elif kind == "image":
            parts.append(_message_image(block.get("source"), where))
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or f"toolu_{len(messages)}_{len(calls)}",
                          "type": "function", "function": {
                              "name": _name(block, where),
                              "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{where}: a tool_result block needs the tool_use_id it answers",
                          f"{where}.content")
            # A tool's result is a turn of its own in chat, before the user's own words.
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                             "content": _tool_result(block)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad(f"{where}: blocks of type {str(kind)[:40]!r} are not supported by groups "
                      "(text, image, tool_use and tool_result are)", "messages")
    if role == "assistant":
        text = "".join(part_text(p) for p in parts)
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
    elif parts:
        only_text = all(p["type"] == "text" for p in parts)
        messages.append({"role": "user", "content": "".join(p["text"] for p in parts)
                         if only_text else parts})


def _message_image(source: Any, where: str) -> dict[str, Any]:
    if isinstance(source, dict) and source.get("type") == "base64":
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source.get('data', '')}"
    elif isinstance(source, dict) and source.get("type") == "url":
        url = source.get("url") or ""
    else:
        raise bad(f"{where}: an image block needs a base64 or url source", "messages")
    return {"type": "image_url", "image_url": {"url": url}}


# What a failed tool's result begins with in chat, which has no flag for it: Messages'
# `is_error: true` says the tool failed and its content is the error, and a model must be
# able to tell that from a result (llama.cpp's and LiteLLM's own conversions drop the flag).
TOOL_ERROR = "Error: "


def _tool_result(block: dict[str, Any]) -> str:
    text = _resultpart_text(block.get("content"))
    return TOOL_ERROR + text if block.get("is_error") is True else text


def _resultpart_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part_text(b) for b in content)
    if content is None:  # a result with no content (the API allows it): no "null" text
        return ""
    return content if isinstance(content, str) else json.dumps(content)


# -- a member that speaks another family -----------------------------------------------------

def member_request(api: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The chat request a group gives a member, in the member's family. Fields that family
    does not know (llama.cpp's grammar, ignore_eos...) stay out: a strict server refuses
    them."""
    if api == "responses":
        return _chat_to_responses(chat)
    if api == "messages":
        return _chat_to_messages(chat)
    return chat


def _chat_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p for p in content or [] if isinstance(p, dict)]


def _image_url(part: dict[str, Any]) -> str:
    url = part.get("image_url")
    return str(url.get("url") if isinstance(url, dict) else url or "")


def _chat_to_responses(chat: dict[str, Any]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for message in chat.get("messages") or []:
        role = message.get("role")
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": message.get("tool_call_id"),
                          "output": text_of(message.get("content"))})
            continue
        content = message.get("content")
        if role == "user" and isinstance(content, list):
            parts = [{"type": "input_image", "image_url": _image_url(p), "detail": "auto"}
                     if p.get("type") == "image_url" else
                     {"type": "input_text", "text": part_text(p)}
                     for p in _chat_parts(content)]
            items.append({"type": "message", "role": "user", "content": parts})
        elif content:
            items.append({"type": "message", "role": role, "content": text_of(content)})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            items.append({"type": "function_call", "call_id": call.get("id"),
                          "name": function.get("name"),
                          "arguments": function.get("arguments") or "{}"})
    # store: false: a Responses server (OpenAI's own) keeps every response by default; a
    # group's member call is one turn of a conversation corral does not keep either.
    out: dict[str, Any] = {"model": chat.get("model"), "input": items, "stream": False,
                           "store": False,
                           **_copy(chat, {"temperature": "temperature", "top_p": "top_p",
                                          "parallel_tool_calls": "parallel_tool_calls"})}
    limit = chat.get("max_completion_tokens") or chat.get("max_tokens")
    if limit:
        out["max_output_tokens"] = limit
    # `strict` and `parameters` are required keys of a Responses function tool, and OpenAI's
    # Responses API takes an absent `strict` as true (it then refuses a schema that is not
    # strict-ready): chat's default is not strict, so say so.
    tools = [{"type": "function", "parameters": None, "strict": False,
              **(t.get("function") or {})} for t in chat.get("tools") or []]
    if tools:
        out["tools"] = tools
        choice = chat.get("tool_choice")
        if isinstance(choice, str):
            out["tool_choice"] = choice
        elif isinstance(choice, dict):
            out["tool_choice"] = {"type": "function",
                                  "name": (choice.get("function") or {}).get("name")}
    shape = chat.get("response_format")
    if isinstance(shape, dict) and shape.get("type") == "json_schema":
        out["text"] = {"format": {"type": "json_schema", **(shape.get("json_schema") or {})}}
    elif isinstance(shape, dict) and shape.get("type") == "json_object":
        out["text"] = {"format": {"type": "json_object"}}
    return out


def _chat_to_messages(chat: dict[str, Any]) -> dict[str, Any]:
    system: list[str] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        # Messages alternates user and assistant: consecutive turns of one role are one.
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        elif blocks:
            turns.append({"role": role, "content": blocks})

    for message in chat.get("messages") or []:
        role, content = message.get("role"), message.get("content")
        if role in ("system", "developer"):
            system.append(text_of(content))
        elif role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                          "content": text_of(content)}])
        elif role in ("user", "assistant"):
            blocks = [_message_block(p) for p in _chat_parts(content)
                      if p.get("type") != "text" or p.get("text")]
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                blocks.append({"type": "tool_use", "id": call.get("id"),
                               "name": function.get("name"),
                               "input": arguments_object(function.get("arguments"))})
            add(role, blocks)
    out: dict[str, Any] = {
        "model": chat.get("model"), "messages": turns, "stream": False,
        "max_tokens": chat.get("max_completion_tokens") or chat.get("max_tokens")
        or DEFAULT_MAX_TOKENS,
        **_copy(chat, {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"})}
    if system:
        out["system"] = "\n\n".join(system)
    stop = chat.get("stop")
    if stop:
        out["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    tools = [{"name": f.get("name"), "description": f.get("description") or "",
              "input_schema": f.get("parameters") or {"type": "object", "properties": {}}}
             for f in ((t.get("function") or {}) for t in chat.get("tools") or [])]
    if tools:
        out["tools"] = tools
        choice = chat.get("tool_choice")
        if choice in ("auto", "none"):
            out["tool_choice"] = {"type": choice}
        elif choice == "required":
            out["tool_choice"] = {"type": "any"}
        elif isinstance(choice, dict):
            out["tool_choice"] = {"type": "tool",
                                  "name": (choice.get("function") or {}).get("name")}
        # At most one call: Messages says it on the tool choice (a `none` takes no flag).
        if chat.get("parallel_tool_calls") is False and choice != "none":
            out["tool_choice"] = {"type": "auto", **out.get("tool_choice", {}),
                                  "disable_parallel_tool_use": True}
    return out


def _message_block(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") != "image_url":
        return {"type": "text", "text": part_text(part)}
    url = _image_url(part)
    if url.startswith("data:") and ";base64," in url:
        media_type, _, data = url[5:].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                            "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}

