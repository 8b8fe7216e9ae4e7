"""Configs written for another tool (llama-swap, EIE, llm-pool), recognised by their shape: for
each of their keys the schema refuses, corral's name for it. A user moving over gets
`llama-swap's cmd: → corral's model: ...` at the key's file:line instead of "Extra inputs are
not permitted", in the one issue shape every config problem has (issues.py).

Data only: a pure function of the parsed document. load.py merges what it returns into the
schema's issues (replacing the schema's message where both name one key, adding the keys
under a refused one: llm-pool's `engine:` is refused whole, its models' keys each get a
pointer)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from corral.supervisor.config.issues import Loc

__all__ = ["SHAPES", "Shape", "recognise"]

GUIDE = "docs/paths-and-check.md#configs-from-other-tools"

# (pattern, corral's key): a pattern is a key path, each part an fnmatch pattern on a mapping
# key ("*" any name) or "#" for a list item. The first pattern that matches a path wins.
Rules = tuple[tuple[tuple[str, ...], str], ...]


@dataclass(frozen=True)
class Shape:
    tool: str
    looks_like: Callable[[dict[str, Any]], bool]
    rules: Rules

    def pointers(self, data: dict[str, Any]) -> dict[Loc, str]:
        """Every key path of `data` a rule names, with its pointer."""
        found: dict[Loc, str] = {}
        for loc in _paths(data):
            for pattern, corral in self.rules:
                if len(pattern) == len(loc) and all(
                        _matches(p, part) for p, part in zip(pattern, loc, strict=True)):
                    key = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
                    found[loc] = f"{self.tool}'s `{key}:` → corral: {corral}"
                    break
        return found


def _matches(pattern: str, part: str | int) -> bool:
    return isinstance(part, int) if pattern == "#" else (
        isinstance(part, str) and fnmatchcase(part, pattern))


def _paths(node: Any, at: Loc = ()) -> Iterator[Loc]:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                yield (*at, key)
                yield from _paths(value, (*at, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*at, i)
            yield from _paths(value, (*at, i))


def _models(data: dict[str, Any]) -> list[Any]:
    models = data.get("models")
    return list(models.values()) if isinstance(models, dict) else []


_SWAP_TOP = {"healthCheckTimeout", "globalTTL", "macros", "startPort", "matrix", "logToStdout",
             "apiKeys", "sendLoadingState", "includeAliasesInList", "hooks", "logTimeFormat"}

def _is_llama_swap(data: dict[str, Any]) -> bool:
    groups = data.get("groups")
    return bool(_SWAP_TOP & data.keys()) or any(
        isinstance(m, dict) and ("cmd" in m or "cmdStop" in m) for m in _models(data)) or (
        isinstance(groups, dict) and any(isinstance(g, dict) and "members" in g
                                         for g in groups.values()))


LLAMA_SWAP = Shape("llama-swap", _is_llama_swap, (
    (("healthCheckTimeout",), "`defaults: {start_timeout: SECONDS}`"),
    (("logLevel",), "`corral serve --log-level debug|info|warning|error`"),
    (("logTimeFormat",), "`corral serve --log-format json|console`"),
    (("logToStdout",), "`corral serve --log-format json|console`; a child's own output: "
                       "`corral logs MODEL`"),
    (("metricsMaxInMemory",), "GET /metrics (Prometheus counters; nothing kept to tune)"),
    (("captureBuffer",), "no such setting (corral keeps no request captures; access lines are "
                         "logged)"),
    (("startPort",), "no such setting: corral gives each child a free port (`${PORT}` in a "
                     "`command:`)"),
    (("sendLoadingState",), "`defaults: {loading_progress: true}`"),
    (("includeAliasesInList",), "no such setting: a model's `aliases:` route requests"),
    (("globalTTL",), "`defaults: {ttl: SECONDS}` (0 = never, as in llama-swap)"),
    (("macros",), "`defaults:` for settings every model shares, `${VAR}` / `${VAR:-default}` "
                  "from the environment, `${PORT}` for the child's port (no macros)"),
    (("apiKeys",), "`api_keys:`"),
    (("matrix",), "`groups:` with `pinned: true` and `policy: {max_loaded: N}` for what runs "
                  "together"),
    (("hooks",), "`groups: {NAME: {models: [...], pinned: true}}` (loaded at start, kept up)"),
    (("peers",), "a model per peer model: `{backend: remote, url: URL, api_key: KEY}` (corral's "
                 "`peers:` are other corrals lending devices)"),
    (("models", "*", "cmd"), "`model: FILE.gguf` (llama-server: corral builds the argv, other "
                             "flags in `args:`), or `backend: command` with `command:` as an "
                             "argv list using `${PORT}`"),
    (("models", "*", "cmdStop"), "`stop_signal:` (corral stops the child's process group)"),
    (("models", "*", "macros"), "the model's own keys (`ctx:`, `args:`, ...; no macros)"),
    (("models", "*", "name"), "the key under `models:` (a model is listed by its name)"),
    (("models", "*", "description"), "no such setting (a model is listed by its name)"),
    (("models", "*", "metadata"), "no such setting (GET /admin/models shows what corral knows)"),
    (("models", "*", "proxy"), "`backend: remote` with `url:` for a server corral does not "
                               "start; one it starts listens on `${PORT}`"),
    (("models", "*", "checkEndpoint"), "`health:` (a path, or `none`)"),
    (("models", "*", "useModelName"), "`served_name:`"),
    (("models", "*", "filters"), "`request: {strip: [FIELD, ...], set: {FIELD: VALUE}}`"),
    (("models", "*", "concurrencyLimit"), "`parallel:` (requests at once) and `max_queue:` "
                                          "(waiting, then 429)"),
    (("models", "*", "unlisted"), "no such setting (every model is listed in /v1/models)"),
    (("models", "*", "timeouts"), "`start_timeout:`, `first_byte_timeout:`, `idle_timeout:`"),
    (("models", "*", "sendLoadingState"), "`loading_progress:`"),
    (("models", "*", "env"), "`env:` as a mapping, `env: {NAME: value}` (not `- NAME=value`)"),
    (("models", "*", "aliases", "#"), "`aliases:` as a list of names, `aliases: [NAME]`"),
    (("groups", "*", "members"), "`models:` (the group's members)"),
    (("groups", "*", "swap"), "`policy: {max_loaded: N}` (how many run at once)"),
    (("groups", "*", "exclusive"), "`policy: {max_loaded: N}` (how many run at once)"),
    (("groups", "*", "persistent"), "`pinned: true`"),
))

EIE = Shape("EIE", lambda d: isinstance(d.get("groups"), list) or isinstance(
    d.get("models"), list) or "vram" in d or "inference" in d, (
    (("groups",), "`groups:` as a mapping by name: `groups: {core: {models: [...], "
                  "type: parallel}}` (not a list of `- name:` items)"),
    (("models",), "`models:` as a mapping by name: `models: {NAME: {model: FILE.gguf}}`"),
    (("vram",), "`memory:` (reserve_mb, low_watermark and critical_watermark keep their "
                "names)"),
    (("vram", "group_isolation"), "`memory: {budgets: {GROUP: MB}}`"),
    (("inference",), "`defaults:` (for every model; each model may set its own)"),
    (("inference", "kv_cache"), "`defaults: {kv_cache: {mode: auto}}`"),
))

_POOL_MODEL = ("engine", "models", "*")
LLM_POOL = Shape("llm-pool", lambda d: "service" in d or (
    isinstance(d.get("engine"), dict) and "models" in d["engine"]), (
    (("service",), "`listen: HOST:PORT`, and `corral serve --log-level` for its log_level"),
    (("service", "host"), "`listen: HOST:PORT`"),
    (("service", "port"), "`listen: HOST:PORT`"),
    (("service", "log_level"), "`corral serve --log-level`"),
    (("engine",), "`models:` at the top (`engine.models.NAME` → `models.NAME`)"),
    (("engine", "backend"), "each model's `backend:` (llama-server, vllm, command, remote)"),
    (("engine", "decoding"), "`defaults: {request: {defaults: {temperature: ..., ...}}}`"),
    (("engine", "models"), "`models:` at the top"),
    ((*_POOL_MODEL, "backend"), "`backend:` (llama_server → llama-server, vllm_serve → vllm, "
                                "a remote OpenAI-compatible server → remote)"),
    ((*_POOL_MODEL, "model_path"), "`model:`"),
    ((*_POOL_MODEL, "enabled"), "no such setting (every model under `models:` is served: leave "
                                "one out to disable it)"),
    ((*_POOL_MODEL, "replicas"), "`replicas: {min: N}`"),
    ((*_POOL_MODEL, "replica_max"), "`replicas: {max: N}`"),
    ((*_POOL_MODEL, "target_inflight"), "`parallel:` (requests one child serves at once)"),
    ((*_POOL_MODEL, "modalities"), "`capabilities:` (vision comes with `mmproj:`)"),
    ((*_POOL_MODEL, "prompt_format"), "no such setting (llama-server applies the GGUF's chat "
                                      "template)"),
    ((*_POOL_MODEL, "enable_thinking"), "`request: {defaults: {chat_template_kwargs: "
                                        "{enable_thinking: false}}}`"),
    ((*_POOL_MODEL, "llama_server_binary"), "`binary:`"),
    ((*_POOL_MODEL, "*_library_path"), "`env: {LD_LIBRARY_PATH: FOLDER}`"),
    ((*_POOL_MODEL, "llama_server_n_ctx"), "`ctx:`"),
    ((*_POOL_MODEL, "llama_server_n_gpu_layers"), "`n_gpu_layers:`"),
    ((*_POOL_MODEL, "llama_server_mmproj_path"), "`mmproj:`"),
    ((*_POOL_MODEL, "*_host"), "no such setting (corral starts each child on 127.0.0.1)"),
    ((*_POOL_MODEL, "*_port"), "no such setting (corral picks each child's port)"),
    ((*_POOL_MODEL, "llama_server_*"), "`args: [--FLAG, VALUE]` (llama-server's own flag)"),
    ((*_POOL_MODEL, "gguf_type_k"), "`cache_type_k:`"),
    ((*_POOL_MODEL, "gguf_type_v"), "`cache_type_v:`"),
    ((*_POOL_MODEL, "gguf_n_ctx"), "`ctx:`"),
    ((*_POOL_MODEL, "gguf_n_gpu_layers"), "`n_gpu_layers:`"),
    ((*_POOL_MODEL, "vllm_model"), "`model:` (a checkpoint folder or a Hugging Face id), with "
                                   "`backend: vllm`"),
    ((*_POOL_MODEL, "vllm_max_model_len"), "`ctx:`"),
    ((*_POOL_MODEL, "vllm_gpu_memory_utilization"), "`gpu_memory_utilization:`"),
    ((*_POOL_MODEL, "vllm_tensor_parallel_size"), "`tensor_parallel_size:`"),
    ((*_POOL_MODEL, "vllm_serve_binary"), "`command: [VENV/bin/python, -m, "
                                          "vllm.entrypoints.openai.api_server]`"),
    ((*_POOL_MODEL, "vllm_serve_env"), "`env:`"),
    ((*_POOL_MODEL, "vllm_*"), "`args: [--FLAG, VALUE]` (vLLM's own flag)"),
))

SHAPES = (LLAMA_SWAP, EIE, LLM_POOL)


def recognise(data: dict[str, Any]) -> tuple[Shape | None, dict[Loc, str]]:
    """The tool whose config `data` looks like, and a pointer for each of its keys."""
    for shape in SHAPES:
        if shape.looks_like(data):
            return shape, shape.pointers(data)
    return None, {}
