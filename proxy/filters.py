"""Per-model request filters (config `request:`): defaults for fields the client left out,
fields always set, fields stripped, and a default system prompt. Applied to the body the child
gets, for a model asked directly and for each member of a group, each with its own."""

from __future__ import annotations

from typing import Any

from corral.supervisor.config.schema.request import RequestFilters

CHAT_PATH = "/v1/chat/completions"
# Roles that already set the stage: a request with one gets no default system prompt.
_STAGE_ROLES = ("system", "developer")


def apply(body: dict[str, Any], filters: RequestFilters | None,
          path: str = CHAT_PATH) -> dict[str, Any]:
    """The body after `filters` (the same object when nothing changes): strip, then the
    defaults for what is missing, then what is always set, then the system prompt."""
    if filters is None:
        return body
    out = body
    if filters.strip and any(key in out for key in filters.strip):
        out = {k: v for k, v in out.items() if k not in filters.strip}
    missing = {k: v for k, v in filters.defaults.items() if k not in out}
    if missing or filters.set:
        out = {**out, **missing, **filters.set}
    if filters.system_prompt is not None and path == CHAT_PATH:
        messages = out.get("messages")
        if isinstance(messages, list) and not any(
                isinstance(m, dict) and m.get("role") in _STAGE_ROLES for m in messages):
            out = {**out, "messages": [{"role": "system", "content": filters.system_prompt},
                                       *messages]}
    return out
