"""What a model, alias or group may be called. Names travel in URL paths (/admin/models/<m>,
the fleet's /w/<m>/), in log lines and on the status page: a name of dots alone is a path
segment every client and browser rewrites ("/admin/models/../load" is "/admin/load" to them,
escaped or not), so such a model could never be loaded, unloaded or followed; a control
character would forge log lines and headers."""

from __future__ import annotations


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a model, alias or group; None when it can."""
    if not name.strip():
        return "a name must not be empty or blank"
    if name.strip(".") == "":
        return f"{name!r} is a path segment clients rewrite (dots alone): choose another name"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return f"{name!r} holds a control character"
    return None
