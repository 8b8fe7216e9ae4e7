"""`include:`: a config file with every file it includes merged in, as one document.

`include: [a.yaml, b.yaml]` (or one name) at the top of a file merges those files in first, in
order, each relative to the file that names it; the including file's own keys come last. Maps
merge key by key (an included file adds models or groups, the includer overrides one model's
ttl); any other value (a list, a string, a number) replaces what came before. Included files
may include others; a cycle is an error at the `include:` line that closes it."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.supervisor.config.issues import ConfigError, ConfigIssue, Lines, Loc, issue_at
from corral.supervisor.config.yaml import MAX_FILE_BYTES, decode, read_yaml

__all__ = ["Document", "read_config_file", "read_config_text"]


@dataclass(frozen=True)
class Document:
    """A config document as plain data, merged from its file and every file it includes."""

    data: dict[str, Any]
    lines: Lines
    files: tuple[Path, ...]  # every file read, the including one first; () for a text
    digest: str  # sha256 over what was read, in order: the same files, the same digest
    # Problems that leave a document to check (an unset ${VAR}, its value left empty): the
    # config is invalid, and its other problems are worth reporting in the same run.
    issues: tuple[ConfigIssue, ...] = ()
    # Included files that hold no YAML at all (empty, or comments only): a reload that finds
    # one so, where it held something, may have caught an editor's save halfway.
    empty: tuple[Path, ...] = ()


def read_config_file(path: Path) -> Document:
    """The config at `path` with every file it includes merged in."""
    path = Path(path)
    try:
        text = _read_text(path)
    except OSError as exc:
        issue = ConfigIssue(str(path), None, "", f"cannot read: {exc.strerror}")
        raise ConfigError([issue], (Path(os.path.abspath(path)),)) from exc
    except ConfigError as exc:
        raise ConfigError(exc.issues, (Path(os.path.abspath(path)),)) from exc
    return _Reader().read(text, str(path), Path(os.path.abspath(path)))


def read_config_text(text: str, source: Path | None = None) -> Document:
    """Like read_config_file for a text already read (`source`: where includes are relative to,
    and the name errors carry)."""
    if source is None:
        return _Reader().read(text, "<config>", None)
    return _Reader().read(text, str(source), Path(os.path.abspath(source)))


def _read_text(path: Path) -> str:
    """The file as text, never more than a config may be (see decode)."""
    with open(path, "rb") as f:
        return decode(f.read(MAX_FILE_BYTES + 1), str(path))


class _Reader:
    def __init__(self) -> None:
        self.files: list[Path] = []
        self.issues: list[ConfigIssue] = []
        self.unset: list[ConfigIssue] = []  # unset variables: not fatal to the reading
        self.hash = hashlib.sha256()
        self.empty: list[Path] = []

    def read(self, text: str, filename: str, path: Path | None) -> Document:
        stack = (path.resolve(),) if path else ()
        layer = self._layer(text, filename, path, stack, root=True)
        files = tuple(dict.fromkeys(self.files))  # in order, once each
        if self.issues or layer is None:
            raise ConfigError(self.issues, files)
        return Document(layer[0], layer[1], files, self.hash.hexdigest(), tuple(self.unset),
                        tuple(dict.fromkeys(self.empty)))

    def _layer(self, text: str, filename: str, path: Path | None, stack: tuple[Path, ...],
               root: bool) -> tuple[dict[str, Any], Lines] | None:
        if path is not None:
            self.files.append(path)
        self.hash.update(f"{path or filename}\0{text}\0".encode())
        try:
            data, lines, unset = read_yaml(text, filename)
        except ConfigError as exc:
            self.issues += exc.issues
            return None
        self.unset += unset
        if not lines and not root and path is not None:
            self.empty.append(path)
        names = self._include_list(data, lines, filename)
        if not names:
            return data, lines
        base_dir = path.parent if path else Path.cwd()
        layers: list[tuple[dict[str, Any], Lines]] = []
        for loc, name in names:
            target = Path(os.path.abspath(base_dir / os.path.expanduser(name)))
            if target.resolve() in stack:
                chain = " → ".join(p.name for p in (*stack, target.resolve()))
                self.issues.append(issue_at(filename, lines, loc, f"include cycle: {chain}"))
                continue
            try:
                included = _read_text(target)
            except OSError as exc:
                self.files.append(target)  # watched: creating it is the fix
                self.issues.append(issue_at(filename, lines, loc,
                                            f"cannot read {target}: {exc.strerror}"))
                continue
            except ConfigError as exc:
                self.files.append(target)  # watched: saving it right is the fix
                self.issues += exc.issues
                continue
            layer = self._layer(included, str(target), target, (*stack, target.resolve()),
                                root=False)
            if layer is not None:
                layers.append(layer)
        if root:  # the top file's own list stays part of its config (shown by /admin/config)
            data["include"] = [name for _, name in names]
        layers.append((data, lines))
        return _merge_layers(layers)

    def _include_list(self, data: dict[str, Any], lines: Lines,
                      filename: str) -> list[tuple[Loc, str]]:
        value = data.pop("include", None)
        if value is None:
            return []
        if isinstance(value, str):
            return [(("include",), value)]
        if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
            return [(("include", i), v) for i, v in enumerate(value)]
        self.issues.append(issue_at(filename, lines, ("include",),
                                    "include must be a file name or a list of file names"))
        return []


def _merge_layers(layers: list[tuple[dict[str, Any], Lines]]) -> tuple[dict[str, Any], Lines]:
    """Merge documents in order (later wins), keeping for every key the file:line it came from."""
    merged: dict[str, Any] = {}
    origin: dict[Loc, int] = {}  # at every merge or replacement point: the layer it came from
    for index, (data, _) in enumerate(layers):
        _merge_into(merged, data, (), index, origin)
    lines: Lines = {}
    _place(merged, (), len(layers) - 1, origin, layers, lines)
    return merged, lines


def _merge_into(base: dict[str, Any], over: dict[str, Any], path: Loc, index: int,
                origin: dict[Loc, int]) -> None:
    for key, value in over.items():
        loc = (*path, str(key))
        before = base.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            # Keys already there keep the layer they came from; the map itself is this one's.
            earlier = origin.get(loc, index)
            for existing in before:
                origin.setdefault((*loc, str(existing)), earlier)
            origin[loc] = index
            _merge_into(before, value, loc, index, origin)
            continue
        origin[loc] = index
        if isinstance(before, dict):  # a merged map replaced whole: forget where its keys were
            for stale in [k for k in origin if len(k) > len(loc) and k[:len(loc)] == loc]:
                del origin[stale]
        base[key] = value


def _place(value: Any, path: Loc, layer: int, origin: dict[Loc, int],
           layers: list[tuple[dict[str, Any], Lines]], out: Lines) -> None:
    layer = origin.get(path, layer)
    pos = layers[layer][1].get(path)
    if pos is not None:
        out[path] = pos
    if isinstance(value, dict):
        for key, item in value.items():
            _place(item, (*path, str(key)), layer, origin, layers, out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _place(item, (*path, i), layer, origin, layers, out)
