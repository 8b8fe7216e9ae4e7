"""The YAML side of config loading: parse with line numbers, expand ${VAR}, and the issue type
every config error is reported as (file:line, dotted key, message)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

# A key path into the YAML document, e.g. ("models", "smol", "args", 0).
Loc = tuple[str | int, ...]
Lines = dict[Loc, int]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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
    def __init__(self, issues: list[ConfigIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


def read_yaml(text: str, filename: str) -> tuple[dict[str, Any], Lines]:
    """The document as plain data with ${VAR} expanded, and the line of every key in it."""
    try:
        # Composed separately: the node tree keeps the line numbers safe_load throws away.
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue(filename, line, "", f"invalid YAML: {problem}")]) from exc
    lines: Lines = {}
    if root is not None:
        _collect_lines(root, (), lines)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue(filename, 1, "", "the top level must be a mapping")])
    issues: list[ConfigIssue] = []
    data = _expand_env(data, (), lines, filename, issues)
    if issues:
        raise ConfigError(issues)
    return data, lines


def line_for(loc: tuple[Any, ...], lines: Lines) -> int | None:
    """The line of `loc`, else of its nearest ancestor (a default has no line of its own)."""
    for cut in range(len(loc), -1, -1):
        hit = lines.get(tuple(loc[:cut]))
        if hit is not None:
            return hit
    return None


def dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def issue_at(filename: str, lines: Lines, loc: tuple[Any, ...], message: str) -> ConfigIssue:
    return ConfigIssue(filename, line_for(loc, lines), dotted(loc), message)


def _collect_lines(node: yaml.Node, path: Loc, out: Lines) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*path, str(key_node.value))
            out[key] = key_node.start_mark.line + 1
            _collect_lines(value_node, key, out)
            # A key's own line wins over its value's (a block value starts on the next line).
            out[key] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _collect_lines(item, (*path, i), out)


def _expand_env(value: Any, path: Loc, lines: Lines, filename: str,
                issues: list[ConfigIssue]) -> Any:
    """Expand ${VAR} and ${VAR:-default} in string values."""
    if isinstance(value, dict):
        return {k: _expand_env(v, (*path, str(k)), lines, filename, issues)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, (*path, i), lines, filename, issues) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        issues.append(issue_at(filename, lines, path, f"environment variable {name} is not set"))
        return ""

    return _ENV_REF.sub(substitute, value)
