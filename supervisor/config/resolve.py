"""A validated config resolved into what the daemon runs: every model's spec with the defaults
filled in and paths made absolute, the models found in models_dir, aliases, groups, the
cross-section checks, the strategy and the GPU reader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from corral.supervisor.config.checks import check_backends, check_budgets
from corral.supervisor.config.groups import resolve_groups
from corral.supervisor.config.issues import (
    ConfigError,
    ConfigIssue,
    Lines,
    Loc,
    issue_at,
    line_for,
    pos_for,
)
from corral.supervisor.config.loaded import LoadedConfig, PluginChoice
from corral.supervisor.config.names import name_problem
from corral.supervisor.config.schema import Config, ModelConfig, ReplicasConfig, ladder_step
from corral.supervisor.config.specs import ModelSpec
from corral.supervisor.config.strategy import resolve_strategy
from corral.supervisor.discovery import Signature, discover, signature

__all__ = ["DEFAULT_MODELS_DIR", "VLLM_START_TIMEOUT", "resolve", "resolve_all"]

T = TypeVar("T")
# vLLM loads the model and captures CUDA graphs before /health answers: minutes on a big model.
VLLM_START_TIMEOUT = 900.0
# The models folder of a config file that names none: beside the file.
DEFAULT_MODELS_DIR = "models"


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
    loaded, issues = resolve_all(config, base_dir, source, lines, files, digest)
    if issues or loaded is None:
        raise ConfigError(issues)
    return loaded


def resolve_all(config: Config, base_dir: Path, source: Path | None, lines: Lines,
                files: tuple[Path, ...] = (), digest: str = "",
                ) -> tuple[LoadedConfig | None, list[ConfigIssue]]:
    """`resolve` that keeps going: every cross-section issue, and the resolved config as far
    as it resolves (None only when no strategy could be chosen), for `corral check` to go on
    checking what it names."""
    filename = str(source) if source else "<config>"
    issues: list[ConfigIssue] = []

    def base_of(loc: Loc) -> Path:
        # A relative path is relative to the file that wrote it: an included file's models
        # sit beside that file, not beside the one including it.
        pos = pos_for(loc, lines)
        return Path(pos[0]).parent if pos and pos[0] != filename else base_dir

    def executable(value: str, loc: Loc) -> str:
        # A name (no folder in it) is looked up on PATH when the child starts; a path is the
        # writer's, like every other path. Symlinks stay: a multi-call binary reads argv[0].
        if "/" not in value and os.sep not in value and not value.startswith("~"):
            return value
        path = Path(os.path.expanduser(value))
        return os.path.normpath(path if path.is_absolute() else base_of(loc) / path)

    binary = executable(config.binary, ("binary",)) if config.binary else None
    d = config.defaults
    # Children that each spin every core livelock one another (llama.cpp's compute threads
    # busy-wait): 3 tiny models on 2 cores went from 0.3 s alone to 46 s together. Split the
    # cores among the models that may be loaded at once unless told otherwise.
    auto_threads = d.threads or max(1, (os.cpu_count() or 1) // config.policy.max_loaded)

    # llama-server's RAM prompt cache is searched by prompt for every caller of a child: with
    # several user keys it would hand one key's cached prefix to another, so auto means off.
    # An admin key reaches /v1 as well (when api_keys are set), as a caller of its own.
    shared_keys = config.several_callers()

    def cache_ram(m: ModelConfig) -> int | None:
        value = _inherit(m.cache_ram_mb, d.cache_ram_mb)
        if isinstance(value, str):  # "auto"
            return 0 if shared_keys else None
        return value

    def build(name: str, m: ModelConfig) -> ModelSpec:
        replicas = m.replicas if isinstance(m.replicas, ReplicasConfig) else \
            ReplicasConfig(min=m.replicas, max=m.replicas)
        # A model that sets its own cache types runs them: the defaults' ladder is for the
        # models that say nothing about their KV cache.
        vllm = m.backend == "vllm"
        # command and remote servers own their model: corral knows no file of theirs.
        foreign = m.backend in ("command", "remote")
        own_types = m.cache_type_k is not None or m.cache_type_v is not None \
            or m.kv_cache_dtype is not None
        # The defaults' ladder holds llama.cpp's types: vLLM models take their own or none.
        kv = m.kv_cache or (None if own_types or vllm or foreign else d.kv_cache)
        # No `model` (command, remote; the checks refuse it missing elsewhere): a path with
        # no size and no facts, so memory and file views find nothing to read.
        model_path = _absolute(m.model, base_of(("models", name, "model"))) if m.model \
            else Path(os.devnull)
        # vLLM takes a folder or a Hugging Face id (org/name): an id is what names no path.
        model_id = m.model if vllm and m.model and _looks_like_hf_id(m.model) \
            and not model_path.exists() else None
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
            # A remote holds nothing here: it stays "up" unless a ttl of its own says otherwise.
            ttl=_inherit(m.ttl, 0 if m.backend == "remote" else d.ttl),
            ctx=_inherit(m.ctx, d.ctx),
            parallel=_inherit(m.parallel, d.parallel),
            n_gpu_layers=_inherit(m.n_gpu_layers, d.n_gpu_layers),
            threads=m.threads or auto_threads,
            cache_type_k=kv_dtype[0],
            cache_type_v=kv_dtype[1],
            args=tuple(m.args),
            # The child needs the values; the spec is internal (/admin/config shows the
            # config, where they stay secret).
            env={key: value.get_secret_value() for key, value in m.env.items()},
            binary=executable(m.binary, ("models", name, "binary")) if m.binary else binary,
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
            prompt_cache=config.prompt_cache.enabled and m.backend == "llama-server"
            and _inherit(m.prompt_cache, d.prompt_cache),
            cache_ram_mb=cache_ram(m),
            capabilities=tuple(m.capabilities) if m.capabilities is not None else
            _capabilities(m),
            paths=tuple(m.paths),
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
            # The executable is a path of the config's; the rest is the server's argv.
            command=(executable(m.command[0], ("models", name, "command", 0)),
                     *m.command[1:]) if m.command else (),
            gpu_memory_utilization=m.gpu_memory_utilization,
            tensor_parallel_size=m.tensor_parallel_size or 1,
            pipeline_parallel_size=m.pipeline_parallel_size or 1,
            distributed_executor_backend=m.distributed_executor_backend,
            health_path=None if m.health == "none" else (m.health or "/health"),
            served_name=m.served_name,
            api=m.api or "chat",
            memory_mb=m.memory_mb,
            stop_signal=m.stop_signal or "SIGTERM",
            url=_remote_base(m.url) if m.url else None,
            api_key=m.api_key.get_secret_value() if m.api_key else None,
            rpc_workers=tuple(m.rpc.workers) if m.rpc else (),
            rpc_split=tuple(m.rpc.split) if m.rpc and isinstance(m.rpc.split, list) else None,
            rpc_threads=m.rpc.threads if m.rpc else 1,
            gpus=tuple(m.gpus or ()),
            override_bounds=m.load_overrides or d.load_overrides,
        )

    models = {name: build(name, m) for name, m in config.models.items()}
    # A config file that names no models_dir discovers `models` beside it, as one that wrote
    # `models_dir: models` (what docs/configuration.md gives as the default); a config given as
    # text, with no file, has no folder to be beside.
    models_dir = config.models_dir or (DEFAULT_MODELS_DIR if source is not None else None)
    models_folder = _absolute(models_dir, base_of(("models_dir",))) if models_dir else None
    listed: Signature | None = None
    if models_folder is not None and models_folder.is_dir():
        found_now = discover(models_folder)
        listed = signature(models_folder, found_now)
        # Every model file not configured already is a model with all the defaults.
        # A file configured through a link (or found through one) is the same file.
        # realpath, not resolve(): a link loop is returned as it is, not raised.
        configured = {os.path.realpath(s.model_path) for s in models.values()}
        for found in found_now:
            if found.name in models or os.path.realpath(found.path) in configured:
                continue
            models[found.name] = build(found.name, ModelConfig(
                model=str(found.path), mmproj=str(found.mmproj) if found.mmproj else None))

    aliases: dict[str, str] = {}
    for name in config.models:
        bad = name_problem(name)
        if bad is not None:
            issues.append(issue_at(filename, lines, ("models", name), bad))
    for name, spec in models.items():
        for i, alias in enumerate(spec.aliases):
            loc: Loc = ("models", name, "aliases", i)
            bad = name_problem(alias)
            if bad is not None:
                issues.append(issue_at(filename, lines, loc, bad))
            elif alias in models:
                issues.append(issue_at(filename, lines, loc,
                                       f"alias {alias!r} is already a model name"))
            elif alias in aliases:
                issues.append(issue_at(filename, lines, loc,
                                       f"alias {alias!r} is already used by {aliases[alias]!r}"))
            else:
                aliases[alias] = name
    groups = resolve_groups(config, models, aliases, issues,
                             lambda loc: line_for(loc, lines), filename)
    check_backends(config, binary, models, issues, lambda loc: line_for(loc, lines), filename)
    check_budgets(config, groups, issues, lambda loc: line_for(loc, lines), filename)
    pinned = frozenset(m for g in groups.values() if g.pinned for m in g.models)
    strategy = resolve_strategy(config, base_of(("policy", "strategy")), models, aliases,
                                 groups, issues, lambda loc: line_for(loc, lines), filename)
    reader = PluginChoice(config.memory.gpu_reader, config.memory.gpu_reader_options,
                          base_of(("memory", "gpu_reader")), ("memory", "gpu_reader"))
    if strategy is None:
        return None, issues
    return LoadedConfig(
        config=config, models=models, source=source, aliases=aliases, groups=groups,
        lines=lines, files=files, digest=digest, pinned=pinned, strategy=strategy,
        gpu_reader=reader, models_folder=models_folder, models_signature=listed, binary=binary,
        state_dir=_absolute(config.state_dir, base_of(("state_dir",)))
        if config.state_dir else None,
        prompt_cache_dir=_absolute(config.prompt_cache.dir, base_of(("prompt_cache", "dir")))
        if config.prompt_cache.dir else None), issues


def _absolute(path: str, base_dir: Path) -> Path:
    p = Path(os.path.expanduser(path))
    return p if p.is_absolute() else (base_dir / p).resolve()


def _remote_base(url: str) -> str:
    """What request paths (/v1/...) are appended to: the URL less a trailing / or /v1."""
    base = url.rstrip("/")
    return base.removesuffix("/v1")


def _looks_like_hf_id(model: str) -> bool:
    """`org/name` (one slash, no leading ./ or /, no ~): how Hugging Face names a repository."""
    return (model.count("/") == 1 and not model.startswith((".", "/", "~"))
            and all(part.strip() for part in model.split("/")))
