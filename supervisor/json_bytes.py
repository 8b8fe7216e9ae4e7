"""A JSON value as the compact UTF-8 bytes corral sends on (a body rewritten for a child, an
answer renamed for a client): UTF-8 as it came, since \\u escapes would grow the body.

JSON may carry half of a UTF-16 surrogate pair as an escape ("\\ud83d": a JavaScript client
that cut a string inside an emoji, a server that split one across two events); Python reads it
into a str that UTF-8 cannot encode. Such a value is written with its escapes, as it came."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["compact"]


def compact(value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: escaped again, as it was escaped
        return json.dumps(value, separators=(",", ":")).encode()
