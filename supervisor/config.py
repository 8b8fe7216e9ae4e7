"""YAML → validated config objects, with errors that point at file:line and the offending key."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

KvCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
BackendKind = Literal["llama-server"]

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class _Strict(BaseModel):
    # Unknown keys are errors: a typo like `tll: 60` must not pass silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Defaults(_Strict):
    ttl: float = Field(300, ge=0, description="idle seconds before a model is stopped; 0 = never")
    ctx: int = Field(4096, ge=0)
    start_timeout: float = Field(120, gt=0)
    parallel: int = Field(1, ge=1)
    n_gpu_layers: int = -1
    threads: int | None = Field(
        None, ge=1, description="CPU threads per child; default: cores / policy.max_loaded")
    max_queue: int = Field(64, ge=0, description="requests waiting per model before 429")
    queue_timeout: float = Field(300, gt=0, description="seconds a request waits for a slot")
    stop_grace: float = Field(10, ge=0, description="seconds between SIGTERM and SIGKILL")


class PolicyConfig(_Strict):
    max_loaded: int = Field(4, ge=1)
    evict_timeout: float = Field(
        30, gt=0, description="seconds a cold start waits for a busy model to drain before 503"
    )


# Flags today's llama-server no longer has, and what replaced them.
_REMOVED_FLAGS = {
    "--mlock": "--load-mode mlock (or mmap+mlock)",
    "--no-mmap": "--load-mode none",
}


class ModelConfig(_Strict):
    backend: BackendKind = "llama-server"
    model: str
    aliases: list[str] = []
    ttl: float | None = Field(None, ge=0)
    ctx: int | None = Field(None, ge=0)
    parallel: int | None = Field(None, ge=1)
    n_gpu_layers: int | None = None
    threads: int | None = Field(None, ge=1)
    cache_type_k: KvCacheType | None = None
    cache_type_v: KvCacheType | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    binary: str | None = None
    start_timeout: float | None = Field(None, gt=0)

    @field_validator("args")
    @classmethod
    def _no_removed_flags(cls, args: list[str]) -> list[str]:
        for arg in args:
            if arg in _REMOVED_FLAGS:
                raise ValueError(f"llama-server no longer has {arg}; use {_REMOVED_FLAGS[arg]}")
        return args


GroupType = Literal["parallel", "chain", "fan_out", "consensus"]
Fallback = Literal["strict", "partial", "retry_once", "replace_with"]
Selector = Literal["first_ok", "longest", "shortest", "majority", "judge"]


class GroupConfig(_Strict):
    models: list[str] = Field(min_length=1)
    type: GroupType = "parallel"
    required_responses: int | None = Field(
        None, ge=1, description="ok answers that make the result complete; default: all")
    member_timeout: float = Field(60, gt=0)
    fallback: Fallback = "strict"
    replace_with: dict[str, str] = {}
    pinned: bool = False
    selector: Selector = "first_ok"
    judge: str | None = None
    synthesizer: str | None = None
    template: str | None = None
    expose_as_model: bool = False


class Config(_Strict):
    listen: str = "127.0.0.1:8080"
    models_dir: str | None = None
    api_keys: list[str] = []
    admin_api_keys: list[str] = []
    max_body_mb: float = Field(32, gt=0)
    shutdown_grace: float = Field(30, ge=0)
    state_dir: str | None = None
    binary: str | None = None
    defaults: Defaults = Defaults()
    policy: PolicyConfig = PolicyConfig()
    models: dict[str, ModelConfig] = {}
    groups: dict[str, GroupConfig] = {}

    @field_validator("listen")
    @classmethod
    def _listen_has_port(cls, value: str) -> str:
        split_listen(value)
        return value


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ModelSpec:
    """One model with every default filled in and every path absolute: what a backend needs."""

    name: str
    backend: BackendKind
    model_path: Path
    aliases: tuple[str, ...]
    ttl: float
    ctx: int
    parallel: int
    n_gpu_layers: int
    threads: int
    cache_type_k: str | None
    cache_type_v: str | None
    args: tuple[str, ...]
    env: dict[str, str]
    binary: str | None
    start_timeout: float
    max_queue: int
    queue_timeout: float
    stop_grace: float


@dataclass(frozen=True)
class GroupSpec:
    """A validated group: every name in it is a canonical model name."""

    name: str
    type: GroupType
    models: tuple[str, ...]
    required_responses: int
    member_timeout: float
    fallback: Fallback
    replace_with: dict[str, str]
    pinned: bool
    selector: Selector
    judge: str | None
    synthesizer: str | None
    template: str | None
    expose_as_model: bool


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


@dataclass(frozen=True)
class LoadedConfig:
    """The validated file plus the resolved model table the daemon runs."""

    config: Config
    models: dict[str, ModelSpec]
    source: Path | None
    aliases: dict[str, str] = field(default_factory=dict)
    groups: dict[str, GroupSpec] = field(default_factory=dict)


def load_config(path: Path | str) -> LoadedConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        issue = ConfigIssue(str(path), None, "", f"cannot read: {exc.strerror}")
        raise ConfigError([issue]) from exc
    return parse_config(text, source=path)


def parse_config(text: str, source: Path | None = None) -> LoadedConfig:
    filename = str(source) if source else "<config>"
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([ConfigIssue(filename, line, "", f"invalid YAML: {problem}")]) from exc
    lines: dict[tuple[str | int, ...], int] = {}
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
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = tuple(err["loc"])
            issues.append(ConfigIssue(filename, _line_for(loc, lines), _dotted(loc), err["msg"]))
        raise ConfigError(issues) from exc

    base_dir = source.parent.resolve() if source else Path.cwd()
    return resolve(config, base_dir, source, lines)


def default_config(models_dir: Path) -> LoadedConfig:
    """The embedded default: every *.gguf in models_dir, on demand, under the default policy."""
    return resolve(Config(models_dir=str(models_dir)), Path.cwd(), None, {})


def resolve(
    config: Config,
    base_dir: Path,
    source: Path | None,
    lines: dict[tuple[str | int, ...], int],
) -> LoadedConfig:
    filename = str(source) if source else "<config>"
    issues: list[ConfigIssue] = []
    d = config.defaults
    # Children that each spin every core livelock one another (llama.cpp's compute threads
    # busy-wait): 3 tiny models on 2 cores went from 0.3 s alone to 46 s together. Split the
    # cores among the models that may be loaded at once unless told otherwise.
    auto_threads = d.threads or max(1, (os.cpu_count() or 1) // config.policy.max_loaded)

    def build(name: str, m: ModelConfig) -> ModelSpec:
        return ModelSpec(
            name=name,
            backend=m.backend,
            model_path=_absolute(m.model, base_dir),
            aliases=tuple(m.aliases),
            ttl=d.ttl if m.ttl is None else m.ttl,
            ctx=d.ctx if m.ctx is None else m.ctx,
            parallel=d.parallel if m.parallel is None else m.parallel,
            n_gpu_layers=d.n_gpu_layers if m.n_gpu_layers is None else m.n_gpu_layers,
            threads=m.threads or auto_threads,
            cache_type_k=m.cache_type_k,
            cache_type_v=m.cache_type_v,
            args=tuple(m.args),
            env=dict(m.env),
            binary=m.binary or config.binary,
            start_timeout=d.start_timeout if m.start_timeout is None else m.start_timeout,
            max_queue=d.max_queue,
            queue_timeout=d.queue_timeout,
            stop_grace=d.stop_grace,
        )

    models = {name: build(name, m) for name, m in config.models.items()}
    if config.models_dir:
        # Every *.gguf not configured already is a model with all the defaults.
        for gguf in _discover(_absolute(config.models_dir, base_dir)):
            if gguf.stem not in models and all(s.model_path != gguf for s in models.values()):
                models[gguf.stem] = build(gguf.stem, ModelConfig(model=str(gguf)))

    aliases: dict[str, str] = {}
    for name, spec in models.items():
        for i, alias in enumerate(spec.aliases):
            loc: tuple[str | int, ...] = ("models", name, "aliases", i)
            if alias in models:
                issues.append(ConfigIssue(filename, _line_for(loc, lines), _dotted(loc),
                                          f"alias {alias!r} is already a model name"))
            elif alias in aliases:
                issues.append(ConfigIssue(filename, _line_for(loc, lines), _dotted(loc),
                                          f"alias {alias!r} is already used by {aliases[alias]!r}"))
            else:
                aliases[alias] = name
    groups = _resolve_groups(config, models, aliases, issues,
                             lambda loc: _line_for(loc, lines), filename)
    if issues:
        raise ConfigError(issues)
    return LoadedConfig(config=config, models=models, source=source, aliases=aliases,
                        groups=groups)


def _resolve_groups(config: Config, models: dict[str, ModelSpec], aliases: dict[str, str],
                    issues: list[ConfigIssue], line: Any, filename: str) -> dict[str, GroupSpec]:
    def problem(loc: tuple[str | int, ...], message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), _dotted(loc), message))

    def canonical(name: str, loc: tuple[str | int, ...]) -> str | None:
        found = name if name in models else aliases.get(name)
        if found is None:
            problem(loc, f"unknown model {name!r}; models: {', '.join(sorted(models)) or 'none'}")
        return found

    groups: dict[str, GroupSpec] = {}
    pinned: set[str] = set()
    for name, g in config.groups.items():
        at: tuple[str | int, ...] = ("groups", name)
        if name in models or name in aliases:
            problem(at, f"group name {name!r} is already a model name or alias")
        members: list[str] = []
        for i, member in enumerate(g.models):
            found = canonical(member, (*at, "models", i))
            if found is None:
                continue
            if found in members:
                problem((*at, "models", i), f"{member!r} is listed twice")
            members.append(found)
        judge = canonical(g.judge, (*at, "judge")) if g.judge else None
        synthesizer = canonical(g.synthesizer, (*at, "synthesizer")) if g.synthesizer else None
        if g.type == "fan_out" and g.selector == "judge" and not g.judge:
            problem((*at, "judge"), "selector 'judge' needs a judge model")
        if g.type == "consensus" and not g.synthesizer:
            problem((*at, "synthesizer"), "a consensus group needs a synthesizer model")
        replace: dict[str, str] = {}
        for member, backup in g.replace_with.items():
            loc = (*at, "replace_with", member)
            original = canonical(member, loc)
            substitute = canonical(backup, loc)
            if original and original not in members:
                problem(loc, f"{member!r} is not a member of the group")
            elif original and substitute:
                replace[original] = substitute
        if g.fallback == "replace_with" and not g.replace_with:
            problem((*at, "replace_with"), "fallback 'replace_with' needs a replace_with map")
        # fan_out wants one good answer to choose from; the others want every member.
        required = g.required_responses or (1 if g.type == "fan_out" else len(g.models))
        if required > len(g.models):
            problem((*at, "required_responses"),
                    f"{required} exceeds the group's {len(g.models)} members")
        if g.template is not None and g.type != "chain":
            problem((*at, "template"), "template applies to chain groups only")
        if g.pinned:
            pinned.update(members)
        groups[name] = GroupSpec(
            name=name, type=g.type, models=tuple(members), required_responses=required,
            member_timeout=g.member_timeout, fallback=g.fallback, replace_with=replace,
            pinned=g.pinned, selector=g.selector, judge=judge, synthesizer=synthesizer,
            template=g.template, expose_as_model=g.expose_as_model)
    if len(pinned) > config.policy.max_loaded:
        problem(("policy", "max_loaded"),
                f"pinned groups keep {len(pinned)} models loaded ({', '.join(sorted(pinned))}) "
                f"but max_loaded is {config.policy.max_loaded}")
    return groups


def _discover(models_dir: Path) -> list[Path]:
    if not models_dir.is_dir():
        return []
    return sorted(p.resolve() for p in models_dir.glob("*.gguf") if p.is_file())


def _absolute(path: str, base_dir: Path) -> Path:
    p = Path(os.path.expanduser(path))
    return p if p.is_absolute() else (base_dir / p).resolve()


def _collect_lines(node: yaml.Node, path: tuple[str | int, ...],
                   out: dict[tuple[str | int, ...], int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = (*path, str(key_node.value))
            out[key] = key_node.start_mark.line + 1
            _collect_lines(value_node, key, out)
            out[key] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _collect_lines(item, (*path, i), out)


def _line_for(loc: tuple[Any, ...], lines: dict[tuple[str | int, ...], int]) -> int | None:
    for cut in range(len(loc), -1, -1):
        hit = lines.get(tuple(loc[:cut]))
        if hit is not None:
            return hit
    return None


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _expand_env(value: Any, path: tuple[str | int, ...], lines: dict[tuple[str | int, ...], int],
                filename: str, issues: list[ConfigIssue]) -> Any:
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
        issues.append(ConfigIssue(filename, _line_for(path, lines), _dotted(path),
                                  f"environment variable {name} is not set"))
        return ""

    return _ENV_REF.sub(substitute, value)
