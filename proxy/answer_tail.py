"""A whole JSON answer's `usage` and `timings`, read from its tail: the members of the top-level
object from its last `"usage"` key on, parsed as an object of their own, instead of the whole
answer.

Answers put usage near their end (chat, Messages, Responses; llama-server's `timings` after
it), so the tail is a few hundred bytes of an answer's thousands. It is read only where it can
be shown to be the top-level object's: the key opens a member (after `{` or `,`: inside a JSON
string a `"` there would have closed the string and left bare letters), and the members from
there parse as one object whose `}` ends the body, which is therefore the
top-level object's. Anything else (a `usage` nested deeper, a `timings` before `usage`, a tail
that is not JSON) is None: the caller parses the whole answer, as before. What comes before
the tail is not checked: an answer that is not JSON there (no child sends one) now has its
usage counted, where the whole parse failed and counted none."""

from __future__ import annotations

import json
import re
from typing import Any

_DECODER = json.JSONDecoder()  # what json.loads uses
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as json's own scanner skips it
_USAGE = b'"usage"'


def top_level_tail(body: bytes) -> dict[str, Any] | None:
    """The members of `body`'s top-level object from its last `usage` on (`usage` among them),
    as json.loads(body) has them; None where that is not shown cheaply."""
    at = body.rfind(_USAGE)
    if at < 0 or body[max(0, at - 64):at].rstrip(b" \t\n\r")[-1:] not in (b"{", b","):
        return None
    try:
        # The members from `usage` on are an object of their own once given a `{`: one
        # parse in C, which must end where the body does.
        text = "{" + body[at:].decode()
        members, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # not UTF-8, not JSON; a hostile upstream nests deep
        return None
    if end != len(text) and _skip(text, end) != len(text):
        return None
    # A `timings` of the same object before `usage` would be json.loads's, not missing.
    if "timings" not in members and body.find(b'"timings"', 0, at) >= 0:
        return None
    found: dict[str, Any] = members
    return found


def _skip(text: str, at: int) -> int:
    space = _SPACE.match(text, at)
    return space.end() if space else at
