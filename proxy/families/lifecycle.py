"""A Responses `response` object with every field OpenAI's `Response` type requires: the one a
whole answer is, and the one each lifecycle event carries (`response.created`,
`response.in_progress`, `response.completed`, `response.failed`, `response.incomplete`).

llama-server leaves fields out: its `response.created` and `response.in_progress` say only
`id`, `object` and `status` (no `created_at`, `model`, `output`), and none of its responses says
`parallel_tool_calls`, `tool_choice` or `tools`, or the usage's `output_tokens_details` and
`input_tokens_details.cache_write_tokens`. The OpenAI SDK's stream helper reads such events
leniently, but a client that validates them (`Response.model_validate`, a typed client in
another language) refuses them. What is missing is filled in with what the response says
elsewhere or what it means: no output yet, the model corral serves, the tool settings of a
request that set none (a child does not say which it was given). A field the response has is
never changed."""

from __future__ import annotations

import json
from typing import Any

from corral.supervisor.json_bytes import compact

__all__ = ["LIFECYCLE", "complete_answer", "complete_response"]

# The events whose `response` is the whole response object.
LIFECYCLE = frozenset({
    "response.created", "response.in_progress", "response.queued", "response.completed",
    "response.failed", "response.incomplete"})

# A whole answer that names all of these has what the fill-in would add (vLLM's, OpenAI's):
# it goes out byte for byte, unparsed.
_PRESENT = (b'"created_at"', b'"parallel_tool_calls"', b'"tool_choice"', b'"tools"',
            b'"output_tokens_details"', b'"cache_write_tokens"')


def complete_response(response: dict[str, Any], model: str, created_at: int) -> bool:
    """Fill in what `response` lacks of the fields `Response` requires; whether it lacked any."""
    before = len(response)
    response.setdefault("object", "response")
    response.setdefault("created_at", created_at)
    if not isinstance(response.get("model"), str):
        response["model"] = model
    response.setdefault("output", [])
    response.setdefault("parallel_tool_calls", True)
    response.setdefault("tool_choice", "auto")
    response.setdefault("tools", [])
    changed = len(response) != before
    usage = response.get("usage")
    if isinstance(usage, dict):
        changed = _complete_usage(usage) or changed
    return changed


def _complete_usage(usage: dict[str, Any]) -> bool:
    """The usage's details that a server without a prompt cache's writes or reasoning
    leaves out: zero of each."""
    before = len(usage)
    inputs, outputs = usage.get("input_tokens"), usage.get("output_tokens")
    if "total_tokens" not in usage and isinstance(inputs, int) and isinstance(outputs, int):
        usage["total_tokens"] = inputs + outputs
    changed = len(usage) != before
    for key, fields in (("input_tokens_details", ("cached_tokens", "cache_write_tokens")),
                        ("output_tokens_details", ("reasoning_tokens",))):
        details = usage.get(key)
        if details is None:
            details = usage[key] = {}
            changed = True
        if not isinstance(details, dict):
            continue  # a child's own value of another type: not corral's to correct
        for field in fields:
            if field not in details:
                details[field] = 0
                changed = True
    return changed


def complete_answer(payload: bytes, model: str, created_at: int) -> bytes:
    """A whole Responses answer with every field `Response` requires, as compact JSON; the
    answer as it came when it lacks none (or is no response object: an error, not JSON)."""
    if all(key in payload for key in _PRESENT):
        return payload
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):  # a hostile upstream nests deep
        return payload
    if not isinstance(data, dict) or data.get("object") != "response":
        return payload
    return compact(data) if complete_response(data, model, created_at) else payload
