"""Images in a group's (chat-shaped) request: how many there are, and the conversation each
member is sent: a chain step's text beside the user's pictures for a member that sees, the
text alone for one that does not."""

from __future__ import annotations

from typing import Any

from corral.proxy.capabilities import IMAGE_PARTS

__all__ = ["count", "is_image", "user_turn", "with_user_turn", "without_images"]


def is_image(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PARTS


def count(messages: list[dict[str, Any]]) -> int:
    """Image parts in the whole conversation (an earlier turn's picture is sent too)."""
    return sum(is_image(part) for m in messages if isinstance(m, dict)
               and isinstance(m.get("content"), list) for part in m["content"])


def user_turn(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """The last user message's text (its text parts joined) and its image parts, in order."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content, []
            if isinstance(content, list):
                text = "\n".join(p.get("text", "") for p in content
                                 if isinstance(p, dict) and not is_image(p))
                return text, [p for p in content if is_image(p)]
            return "", []
    return "", []


def with_user_turn(messages: list[dict[str, Any]], text: str,
                   images: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its last user message replaced (or appended) by `text` and
    `images`: the text first, as one part, then the pictures as the user sent them."""
    content: str | list[dict[str, Any]] = \
        [{"type": "text", "text": text}, *images] if images else text
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        if isinstance(out[i], dict) and out[i].get("role") == "user":
            out[i] = {**out[i], "content": content}
            return out
    return [*out, {"role": "user", "content": content}]


def without_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every turn with its image parts left out: what a member that cannot see is sent."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(is_image(p) for p in content):
            message = {**message, "content": [p for p in content if not is_image(p)]}
        out.append(message)
    return out
