"""One YAML text as plain data: parsed with the file and line of every key, ${VAR} expanded.
(Merging `include:`d files is include.py's job.)"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from corral.supervisor.config.issues import ConfigError, ConfigIssue, Lines, Loc, issue_at

__all__ = ["RESERVED", "read_yaml"]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# Names corral fills in itself when it starts a child (a command model's port), never read from
# the environment: left as written here, substituted at start (backends/command.py).
RESERVED = frozenset({"PORT"})


def read_yaml(text: str, filename: str) -> tuple[dict[str, Any], Lines, list[ConfigIssue]]:
    """The document as plain data with ${VAR} expanded, the line of every key in it, and the
    variables that are not set (each left empty: the rest of the document is still checked).
    Raises ConfigError when there is no document to check."""
    try:
        root, data = _parse(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue(filename, line, "", f"invalid YAML: {problem}")]) from exc
    lines: Lines = {}
    if root is not None:
        _collect_lines(root, (), lines, filename)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue(filename, 1, "", "the top level must be a mapping")])
    issues: list[ConfigIssue] = []
    data = _expand_env(data, (), lines, filename, issues)
    return data, lines, issues


# libyaml when PyYAML was built with it: a 100-model config parses in a few ms instead of ~50.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse(text: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (it keeps the line numbers plain data loses) and the data built from it,
    in one parse."""
    loader = _LOADER(text)
    try:
        root = loader.get_single_node()
        return root, (loader.construct_document(root) if root is not None else None)
    finally:
        loader.dispose()


def _collect_lines(node: yaml.Node, path: Loc, out: Lines, filename: str) -> None:
    out.setdefault(path, (filename, node.start_mark.line + 1))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*path, str(key_node.value))
            _collect_lines(value_node, key, out, filename)
            # A key's own line wins over its value's (a block value starts on the next line).
            out[key] = (filename, key_node.start_mark.line + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _collect_lines(item, (*path, i), out, filename)


def _expand_env(value: Any, path: Loc, lines: Lines, filename: str,
                issues: list[ConfigIssue]) -> Any:
    """Expand ${VAR} and ${VAR:-default} in string values (not the RESERVED ${PORT})."""
    if isinstance(value, dict):
        return {k: _expand_env(v, (*path, str(k)), lines, filename, issues)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, (*path, i), lines, filename, issues) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in RESERVED and default is None:
            return match.group(0)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        issues.append(issue_at(filename, lines, path, f"environment variable {name} is not set"))
        return ""

    return _ENV_REF.sub(substitute, value)
