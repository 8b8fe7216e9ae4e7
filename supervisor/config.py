"""YAML → validated config objects, with errors that point at file:line and the offending key."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from corral.supervisor import demo
from corral.supervisor.config_backends import check_backends
from corral.supervisor.config_memory import KvCacheConfig, MemoryConfig, ladder_step
from corral.supervisor.config_policy import resolve_groups, resolve_strategy
from corral.supervisor.config_schema import (
    Config,
    Defaults,
    GroupConfig,
    ModelConfig,
    PolicyConfig,
    ReplicasConfig,
    split_listen,
)
from corral.supervisor.config_specs import GroupSpec, ModelSpec

# ConfigIssue and ConfigError live with the YAML handling; importers keep using this module.
from corral.supervisor.config_yaml import (
    ConfigError,
    ConfigIssue,
    Document,
    Lines,
    Loc,
    dotted,
    issue_at,
    line_for,
    pos_for,
    read_config_file,
    read_config_text,
)
from corral.supervisor.discovery import discover
from corral.supervisor.memory.devices import GpuReader, NoGpus, load_gpu_reader
from corral.supervisor.plugins import PluginError
from corral.supervisor.policy import ModelView, Snapshot, Strategy, load_strategy

__all__ = [
    "Config", "ConfigError", "ConfigIssue", "Defaults", "GroupConfig", "GroupSpec",
    "KvCacheConfig", "LoadedConfig", "MemoryConfig", "ModelConfig", "ModelSpec",
    "PolicyConfig", "ReplicasConfig",
    "admin_exposure_problem", "admin_is_exposed", "default_config", "load_config",
    "parse_config", "resolve", "split_listen",
]

T = TypeVar("T")
# vLLM loads the model and captures CUDA graphs before /health answers: minutes on a big model.
VLLM_START_TIMEOUT = 900.0


@dataclass(frozen=True)
class LoadedConfig:
    """The validated file plus the resolved model table the daemon runs."""

    config: Config
    models: dict[str, ModelSpec]
    source: Path | None
    aliases: dict[str, str] = field(default_factory=dict)
    groups: dict[str, GroupSpec] = field(default_factory=dict)
    # File and line of every key, for checks made after loading (`corral check`'s listen).
    lines: Lines = field(default_factory=dict)
    # Every file the config was read from (the main one first, then what it includes) and a
    # hash of their contents: what a reload watches, and how /admin/config names a version.
    files: tuple[Path, ...] = ()
    digest: str = ""
    strategy: Strategy = field(default_factory=lambda: load_strategy("generic", {}, Path()))
    # Members of groups marked `pinned: true`, and what the strategy keeps loaded on its own
    # account (as decided from the config alone, with nothing loaded).
    pinned: frozenset[str] = frozenset()
    kept: frozenset[str] = frozenset()
    gpu_reader: GpuReader = field(default_factory=NoGpus)
    # The folder discovery read (models_dir, relative to the file that set it); None: none.
    models_folder: Path | None = None

    def snapshot(self, views: tuple[Any, ...] = (), now: float = 0.0) -> Snapshot:
        """The strategy's view: the models given (default: every model, none loaded)."""
        if not views:
            views = tuple(ModelView(name=n, loaded=False, stoppable=False, last_used=0.0,
                                    ttl=s.ttl) for n, s in self.models.items())
        return Snapshot(models=views, groups={g.name: g.models for g in self.groups.values()},
                        max_loaded=self.config.policy.max_loaded, now=now, pinned=self.pinned,
                        options=self.config.policy.options)

    def issue(self, loc: Loc, message: str) -> ConfigIssue:
        return issue_at(str(self.source) if self.source else "<config>", self.lines, loc,
                        message)


def load_config(path: Path | str) -> LoadedConfig:
    """The config at `path` (with its includes), validated whole: every problem, or none."""
    path = Path(path)
    return _validated(read_config_file(path), path)


def parse_config(text: str, source: Path | None = None) -> LoadedConfig:
    return _validated(read_config_text(text, source), source)


def _validated(doc: Document, source: Path | None) -> LoadedConfig:
    filename = str(source) if source else "<config>"
    try:
        config = Config.model_validate(doc.data)
    except ValidationError as exc:
        issues = [issue_at(filename, doc.lines, tuple(err["loc"]), err["msg"])
                  for err in exc.errors()]
        raise ConfigError(issues, doc.files) from exc
    base_dir = source.parent.resolve() if source else Path.cwd()
    try:
        return resolve(config, base_dir, source, doc.lines, files=doc.files, digest=doc.digest)
    except ConfigError as exc:
        raise ConfigError(exc.issues, doc.files) from exc


def default_config(models_dir: Path) -> LoadedConfig:
    """The embedded default: every *.gguf in models_dir, on demand, under the default policy;
    the demo model, when there, with the request profile that makes it answer well."""
    models = {}
    demo_path = models_dir / demo.FILE
    if demo_path.is_file():
        models[demo.NAME] = ModelConfig(model=str(demo_path.resolve()), request=demo.REQUEST)
    return resolve(Config(models_dir=str(models_dir), models=models), Path.cwd(), None, {})


def _capabilities(m: ModelConfig) -> tuple[str, ...]:
    """What a model answers, from its settings: llama-server started with --embeddings
    answers nothing but embeddings (and reranking, with --reranking); a projector adds vision."""
    if m.embeddings:
        rerank = any(a in ("--reranking", "--rerank") for a in m.args)
        return ("embeddings", "rerank") if rerank else ("embeddings",)
    return ("chat", "completion", "vision") if m.mmproj else ("chat", "completion")


def _inherit(value: T | None, default: T) -> T:
    return default if value is None else value


def resolve(config: Config, base_dir: Path, source: Path | None, lines: Lines,
            files: tuple[Path, ...] = (), digest: str = "") -> LoadedConfig:
    filename = str(source) if source else "<config>"
    issues: list[ConfigIssue] = []

    def base_of(loc: Loc) -> Path:
        # A relative path is relative to the file that wrote it: an included file's models
        # sit beside that file, not beside the one including it.
        pos = pos_for(loc, lines)
        return Path(pos[0]).parent if pos and pos[0] != filename else base_dir

    d = config.defaults
    # Children that each spin every core livelock one another (llama.cpp's compute threads
    # busy-wait): 3 tiny models on 2 cores went from 0.3 s alone to 46 s together. Split the
    # cores among the models that may be loaded at once unless told otherwise.
    auto_threads = d.threads or max(1, (os.cpu_count() or 1) // config.policy.max_loaded)

    def build(name: str, m: ModelConfig) -> ModelSpec:
        replicas = m.replicas if isinstance(m.replicas, ReplicasConfig) else \
            ReplicasConfig(min=m.replicas, max=m.replicas)
        # A model that sets its own cache types runs them: the defaults' ladder is for the
        # models that say nothing about their KV cache.
        vllm = m.backend == "vllm"
        own_types = m.cache_type_k is not None or m.cache_type_v is not None \
            or m.kv_cache_dtype is not None
        # The defaults' ladder holds llama.cpp's types: vLLM models take their own or none.
        kv = m.kv_cache or (None if own_types or vllm else d.kv_cache)
        model_path = _absolute(m.model, base_of(("models", name, "model")))
        # vLLM takes a folder or a Hugging Face id (org/name): an id is what names no path.
        model_id = m.model if vllm and _looks_like_hf_id(m.model) and not model_path.exists() \
            else None
        kv_dtype = (m.kv_cache_dtype,) * 2 if vllm else (m.cache_type_k, m.cache_type_v)
        start_timeout = m.start_timeout or (
            VLLM_START_TIMEOUT if vllm and "start_timeout" not in d.model_fields_set
            else d.start_timeout)
        ladder = tuple(ladder_step(step) for step in kv.ladder) \
            if kv and (kv.mode == "auto" or kv.adaptive) else ()
        return ModelSpec(
            name=name,
            backend=m.backend,
            model_path=model_path,
            aliases=tuple(m.aliases),
            ttl=_inherit(m.ttl, d.ttl),
            ctx=_inherit(m.ctx, d.ctx),
            parallel=_inherit(m.parallel, d.parallel),
            n_gpu_layers=_inherit(m.n_gpu_layers, d.n_gpu_layers),
            threads=m.threads or auto_threads,
            cache_type_k=kv_dtype[0],
            cache_type_v=kv_dtype[1],
            args=tuple(m.args),
            env=dict(m.env),
            binary=m.binary or config.binary,
            start_timeout=start_timeout,
            max_queue=_inherit(m.max_queue, d.max_queue),
            queue_timeout=_inherit(m.queue_timeout, d.queue_timeout),
            stop_grace=_inherit(m.stop_grace, d.stop_grace),
            first_byte_timeout=_inherit(m.first_byte_timeout, d.first_byte_timeout),
            idle_timeout=_inherit(m.idle_timeout, d.idle_timeout),
            health_interval=_inherit(m.health_interval, d.health_interval),
            health_timeout=_inherit(m.health_timeout, d.health_timeout),
            health_failures=_inherit(m.health_failures, d.health_failures),
            start_backoff=_inherit(m.start_backoff, d.start_backoff),
            start_backoff_max=_inherit(m.start_backoff_max, d.start_backoff_max),
            embeddings=m.embeddings,
            loading_progress=_inherit(m.loading_progress, d.loading_progress),
            capabilities=tuple(m.capabilities) if m.capabilities is not None else
            _capabilities(m),
            request=m.request or d.request,
            mmproj=_absolute(m.mmproj, base_of(("models", name, "mmproj"))) if m.mmproj else None,
            replicas_min=replicas.min,
            replicas_max=replicas.max,
            scale_after=replicas.scale_after,
            kv_mode=kv.mode if kv else "fixed",
            kv_ladder=ladder,
            kv_adaptive=bool(kv and kv.adaptive),
            kv_hold=kv.hold if kv else 60.0,
            model_id=model_id,
            command=tuple(m.command or ()),
            gpu_memory_utilization=m.gpu_memory_utilization,
            tensor_parallel_size=m.tensor_parallel_size or 1,
            pipeline_parallel_size=m.pipeline_parallel_size or 1,
            distributed_executor_backend=m.distributed_executor_backend,
            rpc_workers=tuple(m.rpc.workers) if m.rpc else (),
            rpc_split=tuple(m.rpc.split) if m.rpc and isinstance(m.rpc.split, list) else None,
            rpc_threads=m.rpc.threads if m.rpc else 1,
        )

    models = {name: build(name, m) for name, m in config.models.items()}
    models_folder = _absolute(config.models_dir, base_of(("models_dir",))) \
        if config.models_dir else None
    if models_folder is not None:
        # Every model file not configured already is a model with all the defaults.
        for found in discover(models_folder):
            if found.name in models or any(s.model_path == found.path for s in models.values()):
                continue
            models[found.name] = build(found.name, ModelConfig(
                model=str(found.path), mmproj=str(found.mmproj) if found.mmproj else None))

    aliases: dict[str, str] = {}
    for name, spec in models.items():
        for i, alias in enumerate(spec.aliases):
            loc: Loc = ("models", name, "aliases", i)
            if alias in models:
                issues.append(issue_at(filename, lines, loc,
                                       f"alias {alias!r} is already a model name"))
            elif alias in aliases:
                issues.append(issue_at(filename, lines, loc,
                                       f"alias {alias!r} is already used by {aliases[alias]!r}"))
            else:
                aliases[alias] = name
    groups = resolve_groups(config, models, aliases, issues,
                             lambda loc: line_for(loc, lines), filename)
    check_backends(config, models, issues, lambda loc: line_for(loc, lines), filename)
    _check_memory(config, groups, issues, lambda loc: line_for(loc, lines), filename)
    pinned = frozenset(m for g in groups.values() if g.pinned for m in g.models)
    strategy = resolve_strategy(config, base_of(("policy", "strategy")), models, aliases,
                                 groups, issues, lambda loc: line_for(loc, lines), filename)
    gpu_reader: GpuReader = NoGpus()
    try:
        gpu_reader = load_gpu_reader(config.memory.gpu_reader, config.memory.gpu_reader_options,
                                     base_of(("memory", "gpu_reader")))
    except PluginError as exc:
        issues.append(issue_at(filename, lines, ("memory", "gpu_reader"), str(exc)))
    if issues:
        raise ConfigError(issues)
    loaded = LoadedConfig(config=config, models=models, source=source, aliases=aliases,
                          groups=groups, lines=lines, files=files, digest=digest,
                          pinned=pinned, gpu_reader=gpu_reader, models_folder=models_folder)
    if strategy is None:
        return loaded
    try:
        kept = frozenset(strategy.keep_loaded(loaded.snapshot())) & set(models)
    except Exception as exc:
        raise ConfigError([issue_at(filename, lines, ("policy", "strategy"),
                                    f"the strategy failed: {type(exc).__name__}: {exc}")]) \
            from exc
    children = sum(models[m].replicas_min for m in kept)  # each replica is a child
    if children > config.policy.max_loaded:
        raise ConfigError([issue_at(
            filename, lines, ("policy", "max_loaded"),
            f"strategy {config.policy.strategy} keeps {len(kept)} models loaded "
            f"({', '.join(sorted(kept))}"
            f"{f'; {children} children with their replicas' if children > len(kept) else ''}"
            f") but max_loaded is {config.policy.max_loaded}")])
    return dataclasses.replace(loaded, strategy=strategy, kept=kept)


def _check_memory(config: Config, groups: dict[str, GroupSpec], issues: list[ConfigIssue],
                  line: Callable[[Loc], int | None], filename: str) -> None:
    memory = config.memory

    def problem(loc: Loc, message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), dotted(loc), message))

    owner: dict[str, str] = {}
    for group in memory.budgets:
        loc: Loc = ("memory", "budgets", group)
        if group not in groups:
            problem(loc, f"unknown group {group!r}; groups: {', '.join(sorted(groups)) or 'none'}")
            continue
        for member in groups[group].models:
            if member in owner:
                problem(loc, f"{member!r} is in the budgets of both {owner[member]!r} and "
                             f"{group!r}; a model lives in one budget")
            owner.setdefault(member, group)
    total = sum(memory.budgets.values())
    if memory.budget_mb is not None and total > memory.budget_mb:
        problem(("memory", "budgets"), f"the group budgets add up to {total:g} MiB but "
                                       f"budget_mb is {memory.budget_mb:g}")


def admin_is_exposed(config: Config, listen: str) -> bool:
    """Whether /admin answers without a key to anyone who can reach `listen`."""
    # Admin falls back to the API keys, and is open when there are neither (proxy/app.py).
    return not (config.admin_api_keys or config.api_keys) and not _is_loopback(listen)


def admin_exposure_problem(config: Config, listen: str) -> str | None:
    """Why corral must not serve `config` on `listen`, or None. Open admin endpoints (load,
    unload, logs) on a network address are an accident far more often than a choice, so the
    choice has to be spelled out as `admin_open: true`."""
    if not admin_is_exposed(config, listen) or config.admin_open:
        return None
    return (f"listening on {listen} (not loopback) with no api_keys or admin_api_keys would "
            "leave /admin (load, unload, logs) open to the network; set admin_api_keys "
            "(or api_keys), listen on 127.0.0.1, or set admin_open: true to allow it")


def _is_loopback(listen: str) -> bool:
    host, _ = split_listen(listen)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve to anything: treat it as the network


def _absolute(path: str, base_dir: Path) -> Path:
    p = Path(os.path.expanduser(path))
    return p if p.is_absolute() else (base_dir / p).resolve()


def _looks_like_hf_id(model: str) -> bool:
    """`org/name` (one slash, no leading ./ or /, no ~): how Hugging Face names a repository."""
    return (model.count("/") == 1 and not model.startswith((".", "/", "~"))
            and all(part.strip() for part in model.split("/")))
