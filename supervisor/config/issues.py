"""How every config problem is reported: the key path into the document (Loc), where each key
was written (file, line), and the issue type (file:line, dotted key, message)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "ConfigIssue", "Lines", "Loc", "Pos", "dotted", "issue_at",
           "line_for", "pos_for"]

# A key path into the YAML document, e.g. ("models", "smol", "args", 0).
Loc = tuple[str | int, ...]
# Where each key was written: (file, line). With `include:` one document comes from many files.
Pos = tuple[str, int]
Lines = dict[Loc, Pos]


@dataclass(frozen=True)
class ConfigIssue:
    file: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.key or '<top>'}: {self.message}"


class ConfigError(Exception):
    def __init__(self, issues: list[ConfigIssue], files: tuple[Path, ...] = ()):
        self.issues = issues
        # The files read (or tried) before the error: what a watcher keeps watching, so that
        # fixing any of them (creating a missing include) reloads.
        self.files = files
        super().__init__("\n".join(str(i) for i in issues))


def pos_for(loc: tuple[Any, ...], lines: Lines) -> Pos | None:
    """Where `loc` was written, else its nearest ancestor (a default has no line of its own)."""
    for cut in range(len(loc), -1, -1):
        hit = lines.get(tuple(loc[:cut]))
        if hit is not None:
            return hit
    return None


def line_for(loc: tuple[Any, ...], lines: Lines) -> int | None:
    pos = pos_for(loc, lines)
    return pos[1] if pos else None


def dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def issue_at(filename: str, lines: Lines, loc: tuple[Any, ...], message: str) -> ConfigIssue:
    """An issue at `loc`, in the file that wrote it (`filename` when nothing did)."""
    pos = pos_for(loc, lines)
    return ConfigIssue(pos[0] if pos else filename, pos[1] if pos else None, dotted(loc), message)
