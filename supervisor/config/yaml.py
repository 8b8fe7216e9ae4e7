"""One YAML text as plain data: parsed with the file and line of every key, ${VAR} expanded.
(Merging `include:`d files is include.py's job.)"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from corral.supervisor.config.issues import (
    ConfigError,
    ConfigIssue,
    Lines,
    Loc,
    dotted,
    issue_at,
)

__all__ = ["MAX_FILE_BYTES", "MAX_NODES", "RESERVED", "decode", "read_yaml"]

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# Names corral fills in itself when it starts a child (a command model's port), never read from
# the environment: left as written here, substituted at start (backends/command.py).
RESERVED = frozenset({"PORT"})


# A config is a few KiB; parsing runs in the daemon's process, ~2 s per MiB. Past this the file
# is something else (a model file named by mistake, a runaway generator), and reading it would
# stall the streams being relayed for minutes.
MAX_FILE_BYTES = 4 * 1024 * 1024
# Values after aliases are expanded (each alias counts as a copy of what it names). A real
# config has thousands; a "billion laughs" of nested aliases is a few lines that expand to
# 10**9, and everything after the parse (${VAR}, lines, the schema) walks the expansion.
MAX_NODES = 200_000
_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOOL_TAG = "tag:yaml.org,2002:bool"


def decode(data: bytes, filename: str) -> str:
    """A config file's bytes as text: UTF-8 (a BOM is skipped by the parser), else one error
    at the line of the first byte that is not."""
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([ConfigIssue(filename, None, "", f"larger than a config file may be "
                                       f"({MAX_FILE_BYTES // 1024 // 1024} MiB): not read")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([ConfigIssue(filename, line, "", f"not UTF-8 text: byte "
                                       f"0x{data[exc.start]:02x} cannot be read as UTF-8 "
                                       f"(save the file as UTF-8)")]) from exc


def read_yaml(text: str, filename: str) -> tuple[dict[str, Any], Lines, list[ConfigIssue]]:
    """The document as plain data with ${VAR} expanded, the line of every key in it, and the
    variables that are not set (each left empty: the rest of the document is still checked).
    Raises ConfigError when there is no document to check."""
    try:
        root, data = _parse(text, filename)
    except RecursionError as exc:
        raise ConfigError([ConfigIssue(filename, None, "", "invalid YAML: nested too deeply")]) \
            from exc
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


def _parse(text: str, filename: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (it keeps the line numbers plain data loses) and the data built from it,
    in one parse. The tree is checked before the data is built: building merges `<<:` keys
    into their mappings, and would hide a key written twice."""
    loader = _LOADER(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None
        issues = _Tree(filename).check(root)
        if issues:
            raise ConfigError(issues)
        return root, loader.construct_document(root)
    finally:
        loader.dispose()


class _TooLarge(Exception):
    def __init__(self, node: yaml.Node, why: str):
        self.node, self.why = node, why


class _Tree:
    """What PyYAML accepts and a config must not hold: a key written twice in one mapping
    (PyYAML keeps the last one silently: a model pasted twice, the first copy's settings lost
    unseen), an alias inside what it names (a cycle), and aliases that expand past MAX_NODES.
    Each node is walked once, however many aliases name it."""

    def __init__(self, filename: str):
        self.filename = filename
        self.sizes: dict[int, int] = {}  # id(node) → its values with aliases expanded
        self.open: set[int] = set()  # the nodes being walked: one met again is a cycle
        self.issues: list[ConfigIssue] = []

    def check(self, root: yaml.Node) -> list[ConfigIssue]:
        try:
            self._size(root, ())
        except _TooLarge as exc:
            return [ConfigIssue(self.filename, exc.node.start_mark.line + 1, "", exc.why)]
        return self.issues

    def _size(self, node: yaml.Node, path: Loc) -> int:
        known = self.sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in self.open:
            raise _TooLarge(node, "invalid YAML: an alias refers to a value that contains it")
        self.open.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, Any], int] = {}
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                    ident = (key_node.tag, key_node.value)
                    if ident in seen:
                        self.issues.append(ConfigIssue(
                            self.filename, line, dotted((*path, str(key_node.value))),
                            f"key written twice in one mapping (first on line {seen[ident]}); "
                            f"YAML would keep only the last: remove or rename one"))
                    else:
                        seen[ident] = line
                total += self._size(key_node, path)
                total += self._size(value_node, (*path, str(key_node.value)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += self._size(item, (*path, i))
        self.open.discard(id(node))
        if total > MAX_NODES:
            raise _TooLarge(node, f"more than {MAX_NODES} values once its aliases are expanded "
                                  f"(an alias bomb?)")
        self.sizes[id(node)] = total
        return total


def _collect_lines(node: yaml.Node, path: Loc, out: Lines, filename: str) -> None:
    out.setdefault(path, (filename, node.start_mark.line + 1))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*path, str(key_node.value))
            _collect_lines(value_node, key, out, filename)
            # A key's own line wins over its value's (a block value starts on the next line).
            out[key] = (filename, key_node.start_mark.line + 1)
            if key_node.tag == _BOOL_TAG:  # the data holds `no:` as False: found by that too
                out[(*path, str(key_node.value.lower() in ("yes", "true", "on")))] = out[key]
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

    return ENV_REF.sub(substitute, value)
