"""A small JSON path: `$` then `.name`, `['name']` / `["name"]` and `[index]` steps, e.g.
`$.answer` or `$.choices[0]['final answer']`. Enough to point at one value in a member's JSON
answer; no wildcards or filters, so one path always names at most one value."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["Path", "parse", "pick"]

Path = tuple[str | int, ...]

_STEP = re.compile(r"""\.(?P<name>[A-Za-z_][\w-]*)
                       |\[(?P<index>-?\d+)\]
                       |\['(?P<single>[^'\\]*)'\]
                       |\["(?P<double>[^"\\]*)"\]""", re.VERBOSE)


def parse(path: str) -> Path:
    """The steps of `path`; ValueError saying where it goes wrong."""
    if not path.startswith("$"):
        raise ValueError(f"a JSON path starts with $ (got {path!r})")
    steps: list[str | int] = []
    at = 1
    while at < len(path):
        match = _STEP.match(path, at)
        if match is None:
            raise ValueError(f"bad JSON path {path!r} at character {at + 1}: expected .name, "
                             f"[index] or ['name']")
        index = match.group("index")
        if index is not None:
            steps.append(int(index))
        else:
            steps.append(next(g for g in (match.group("name"), match.group("single"),
                                          match.group("double")) if g is not None))
        at = match.end()
    return tuple(steps)


def pick(text: str, path: Path) -> Any:
    """The value `path` names in the JSON `text`; None when the text is no JSON or has no
    such value. A fenced block (```json ... ```) counts as its JSON: small models add one."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    try:
        value: Any = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return None
    for step in path:
        found = (isinstance(step, int) and isinstance(value, list)
                 and -len(value) <= step < len(value)) \
            or (isinstance(step, str) and isinstance(value, dict) and step in value)
        if not found:
            return None
        value = value[step]
    return value
