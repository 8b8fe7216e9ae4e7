"""Loading a config: a file (with its includes) or a text, validated whole against the schema
and resolved; or the embedded default when there is no file."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from corral.supervisor import demo
from corral.supervisor.config.foreign import GUIDE, recognise
from corral.supervisor.config.include import Document, read_config_file, read_config_text
from corral.supervisor.config.issues import ConfigError, ConfigIssue, issue_at
from corral.supervisor.config.loaded import LoadedConfig
from corral.supervisor.config.resolve import resolve, resolve_all
from corral.supervisor.config.schema import Config, ModelConfig

__all__ = ["Inspection", "default_config", "inspect_config", "load_config", "parse_config"]


def load_config(path: Path | str) -> LoadedConfig:
    """The config at `path` (with its includes), validated whole: every problem, or none."""
    path = Path(path)
    return _validated(read_config_file(path), path)


def parse_config(text: str, source: Path | None = None) -> LoadedConfig:
    return _validated(read_config_text(text, source), source)


@dataclass(frozen=True)
class Inspection:
    """A config with every problem found in one pass: `loaded` is what resolved (None when
    the file could not be read, or nothing could be validated or no strategy chosen), with
    the parts the schema refused left out, so what names files or plugins can be checked
    on."""

    loaded: LoadedConfig | None
    issues: list[ConfigIssue]
    files: tuple[Path, ...]


def inspect_config(path: Path | str) -> Inspection:
    """Every problem of the config at `path` (schema and cross-section alike), raising none."""
    path = Path(path)
    try:
        doc = read_config_file(path)
    except ConfigError as exc:
        return Inspection(None, exc.issues, exc.files)
    return _inspect(doc, path)


def _validated(doc: Document, source: Path | None) -> LoadedConfig:
    found = _inspect(doc, source)
    if found.issues or found.loaded is None:
        raise ConfigError(found.issues, doc.files)
    return found.loaded


# Each round drops at least one key the schema refused; a config deeper than this in errors
# that only show once others are gone is not worth more rounds.
_PRUNE_ROUNDS = 8


def _inspect(doc: Document, source: Path | None) -> Inspection:
    """The schema's errors, then (with the keys it refused dropped, so the rest validates)
    the cross-section ones: a user fixes them all in one go instead of a round per kind."""
    filename = str(source) if source else "<config>"
    issues: list[ConfigIssue] = []
    # A key an unset variable left empty is reported as that, not as the empty value.
    unset = {i.key for i in doc.issues}
    data = copy.deepcopy(doc.data)
    config: Config | None = None
    for round_ in range(_PRUNE_ROUNDS):
        try:
            config = Config.model_validate(data)
            break
        except ValidationError as exc:
            errors = exc.errors()
            if round_ == 0:  # later rounds' errors are what the pruning itself caused
                issues += _schema_issues(doc, filename, errors)
            if not [err for err in errors if _prune(data, tuple(err["loc"]))]:
                break
    loaded: LoadedConfig | None = None
    if config is not None:
        base_dir = source.parent.resolve() if source else Path.cwd()
        loaded, more = resolve_all(config, base_dir, source, doc.lines, files=doc.files,
                                   digest=doc.digest)
        if loaded is not None and doc.empty:
            loaded = dataclasses.replace(loaded, empty_files=frozenset(doc.empty))
        issues += more
    return Inspection(loaded, [*doc.issues, *(i for i in issues if not _under(i.key, unset))],
                      doc.files)


def _schema_issues(doc: Document, filename: str, errors: list[Any]) -> list[ConfigIssue]:
    """The schema's errors; where the config is another tool's (foreign.py), each of its keys
    the schema refused, or that sits under one it refused, says corral's name instead."""
    refused = [_as_written(err) for err in errors]
    shape, pointers = recognise(doc.data)
    said = {loc: pointers.pop(loc) for loc in refused if loc in pointers}
    found = [issue_at(filename, doc.lines, loc, said.get(loc, _message(err)))
             for loc, err in zip(refused, errors, strict=True)]
    found += [issue_at(filename, doc.lines, loc, pointer) for loc, pointer in pointers.items()
              if any(loc[:len(r)] == r for r in refused)]
    if shape is not None and (said or len(found) > len(errors)):
        found.insert(0, issue_at(filename, {}, (), f"this looks like {shape.tool}'s config "
                                                   f"(see {GUIDE}): corral's key for each of "
                                                   f"its keys follows"))
    return found


def _as_written(err: Any) -> tuple[Any, ...]:
    """A schema error's place as the lines know it: a mapping key YAML read as a boolean or a
    number (`no:`, `1.5:`) is there as str() of the value (the schema's place says 0 for
    False)."""
    loc = tuple(err["loc"])
    if len(loc) >= 2 and loc[-1] == "[key]" and not isinstance(err.get("input"), str):
        loc = (*loc[:-2], str(err.get("input")), "[key]")
    return tuple(str(p) if isinstance(p, bool | float) else p for p in loc)


def _message(err: Any) -> str:
    """The schema's message, with the YAML 1.1 surprise named where a string was expected:
    unquoted yes/no/on/off are booleans (`aliases: [no]` is `[false]`), 1.5 is a number."""
    value = err.get("input")
    if err["type"] != "string_type" or not isinstance(value, bool | int | float):
        return str(err["msg"])
    what = ("a boolean (unquoted yes/no/on/off/true/false are booleans in YAML)"
            if isinstance(value, bool) else "a number")
    return f"{err['msg']}: YAML read this unquoted value as {what}; put it in quotes"


def _under(key: str, keys: set[str]) -> bool:
    return any(key == k or key.startswith((f"{k}.", f"{k}[")) for k in keys)


def _prune(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    """Drop the deepest mapping key on `loc` that `data` holds (a list whole: its items'
    indexes would shift). False when there is none to drop."""
    parent: dict[str, Any] | None = None
    key: str | None = None
    node: Any = data
    for part in loc:
        if not isinstance(node, dict) or part not in node:
            break  # a union's branch name, or an item of a list: stop at what holds it
        parent, key, node = node, part, node[part]
    if parent is None or key is None:
        return False
    del parent[key]
    return True


def default_config(models_dir: Path) -> LoadedConfig:
    """The embedded default: every *.gguf in models_dir, on demand, under the default policy;
    the demo model, when there, with the request profile that makes it answer well."""
    models = {}
    demo_path = models_dir / demo.FILE
    if demo_path.is_file():
        models[demo.NAME] = ModelConfig(model=str(demo_path.resolve()), request=demo.REQUEST)
    return resolve(Config(models_dir=str(models_dir), models=models), Path.cwd(), None, {})
