"""Checks of a model's keys against its backend: which keys each backend reads, the flags it
must not be given in `args`, and the KV cache types its binary accepts (asked of its --help)."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from corral.supervisor.backends.binaries import BinaryNotFound, find_executable, kv_type_problem
from corral.supervisor.backends.command import PORT_MACRO
from corral.supervisor.backends.vllm import vllm_command, vllm_kv_type_problem
from corral.supervisor.config.issues import ConfigIssue, Loc, dotted
from corral.supervisor.config.schema import Config, ModelConfig, ladder_step
from corral.supervisor.config.specs import ModelSpec

__all__ = ["check_backends"]

# Keys only one backend reads, and what the other backend has instead.
_VLLM_ONLY = {
    "command": "llama-server models name their executable with `binary`",
    "gpu_memory_utilization": "llama-server models place layers with `n_gpu_layers`",
    "kv_cache_dtype": "llama-server models use `cache_type_k` / `cache_type_v`",
    "tensor_parallel_size": "llama-server splits layers over the GPUs by itself",
    "pipeline_parallel_size": "llama-server splits layers over the GPUs by itself",
    "distributed_executor_backend": "llama-server has no distributed executor",
}
_LLAMA_ONLY = {
    "binary": "vLLM models say how to start vLLM with `command`",
    "n_gpu_layers": "vLLM puts the whole model on its GPUs (see `gpu_memory_utilization`)",
    "threads": "vLLM's CPU threads are set with VLLM_CPU_OMP_THREADS_BIND in `env`",
    "cache_type_k": "vLLM models use `kv_cache_dtype`",
    "cache_type_v": "vLLM models use `kv_cache_dtype`",
    "mmproj": "vLLM reads a multimodal checkpoint's projector from its folder",
    "embeddings": "pass vLLM's own pooling flags in `args`",
    "cache_ram_mb": "vLLM's prefix cache lives in its own KV blocks",
}
# The keys of command and remote models, and what the native backends have instead.
_FOREIGN_ONLY = {
    "health": "corral knows llama-server's and vLLM's health endpoints",
    "served_name": "corral serves the model under its name (add `aliases` for more)",
    "memory_mb": "corral estimates llama-server and vLLM children from the model's files",
    "stop_signal": "corral stops llama-server and vLLM with SIGTERM",
    "url": "`url` is for backend: remote",
    "api_key": "corral gives every child an API key of its own",
    "api": "llama-server and vLLM speak every family corral translates from chat",
}
# What a command child reads: corral starts it from `command` and knows nothing else of it.
_COMMAND_KEYS = {"backend", "command", "health", "served_name", "api", "memory_mb",
                 "stop_signal", "env", "aliases", "ttl", "parallel", "start_timeout", "max_queue",
                 "queue_timeout", "stop_grace", "first_byte_timeout", "idle_timeout",
                 "health_interval", "health_timeout", "health_failures", "start_backoff",
                 "start_backoff_max", "capabilities", "request", "loading_progress",
                 "replicas", "model", "gpus", "paths"}
# What a remote endpoint reads: no process, so no start, stop, health probe or memory keys.
_REMOTE_KEYS = {"backend", "url", "api_key", "served_name", "api", "aliases", "parallel",
                "max_queue", "queue_timeout", "first_byte_timeout", "idle_timeout",
                "capabilities", "request", "ttl", "model", "paths"}
# Flags today's llama-server no longer has, and what replaced them.
_REMOVED_LLAMA_FLAGS = {
    "--mlock": "--load-mode mlock (or mmap+mlock)",
    "--no-mmap": "--load-mode none",
}
# vLLM flags corral sets itself (host, port and API key are refused for every backend).
_OWNED_VLLM_FLAGS = {
    "--model": "`model` names the checkpoint",
    "--served-model-name": "corral serves the model under its name (add `aliases` for more)",
    "--max-model-len": "`ctx` sets it",
    "--max-num-seqs": "`parallel` sets it",
    "--gpu-memory-utilization": "use the `gpu_memory_utilization` key",
    "--kv-cache-dtype": "use the `kv_cache_dtype` key (or a `kv_cache` ladder)",
    "--tensor-parallel-size": "use the `tensor_parallel_size` key",
    "--pipeline-parallel-size": "use the `pipeline_parallel_size` key",
}

# Flags corral sets itself for a model split over RPC workers.
_SET_FROM_THE_PLAN = "corral sets it from rpc.workers and the split it plans"
_OWNED_RPC_FLAGS = {"--rpc": _SET_FROM_THE_PLAN, "--tensor-split": _SET_FROM_THE_PLAN,
                    "-ts": _SET_FROM_THE_PLAN}


def check_backends(config: Config, binary: str | None, models: dict[str, ModelSpec],
                   issues: list[ConfigIssue], line: Callable[[Loc], int | None],
                   filename: str) -> None:
    """`binary`: the top-level one, resolved (relative to its file)."""
    def problem(loc: Loc, message: str) -> None:
        issues.append(ConfigIssue(filename, line(loc), dotted(loc), message))

    llama_binaries: dict[str | None, str | None] = {}

    def llama_binary(configured: str | None) -> str | None:
        if configured not in llama_binaries:
            try:
                llama_binaries[configured] = find_executable(configured, ("llama-server",))
            except BinaryNotFound:
                llama_binaries[configured] = None  # a missing binary is reported when it starts
        return llama_binaries[configured]

    if config.defaults.kv_cache:  # the defaults' ladder is for llama-server models
        for i, step in enumerate(config.defaults.kv_cache.ladder):
            for kv_type in dict.fromkeys(ladder_step(step)):
                found = kv_type_problem(kv_type, llama_binary(binary))
                if found:
                    problem(("defaults", "kv_cache", "ladder", i), found)
    if config.worker.enabled and not config.worker.token:
        problem(("worker", "token"), "a worker needs a token: peers send it as their key")
    for name, m in config.models.items():
        at: Loc = ("models", name)
        if m.rpc is not None:
            _check_rpc(config, m, at, problem)
        if m.gpus is not None:
            _check_gpus(m, at, problem)
        if m.backend in ("command", "remote"):
            _check_foreign(m, at, problem)
            continue
        if m.model is None:
            problem((*at, "model"), f"a {m.backend} model needs `model` (its file or "
                                    f"checkpoint)")
        for key in sorted(m.model_fields_set & set(_FOREIGN_ONLY)):
            problem((*at, key), f"{key} is a command/remote setting but this model's backend "
                                f"is {m.backend}; {_FOREIGN_ONLY[key]}")
        if m.backend == "vllm":
            _check_vllm(m, models[name], at, problem)
        else:
            _check_llama(m, llama_binary(models[name].binary), at, problem)


# What a child's runtime reads to pick its GPUs: a model pinned with `gpus` gets them set by
# corral, so one set by hand as well would contradict it.
_VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _check_gpus(m: ModelConfig, at: Loc, problem: Callable[[Loc, str], None]) -> None:
    assert m.gpus is not None
    for var in _VISIBLE_DEVICES:
        if var in m.env:
            problem((*at, "gpus"), f"gpus and env {var} both choose the GPUs: set one (with "
                                   f"{var} alone corral counts the model on the GPUs it names)")
    if m.rpc is not None:
        problem((*at, "gpus"), "a model split over RPC workers runs its layers on the "
                               "workers: gpus does not apply")
    wanted = (m.tensor_parallel_size or 1) * (m.pipeline_parallel_size or 1)
    if m.backend == "vllm" and len(m.gpus) < wanted:
        problem((*at, "gpus"), f"{len(m.gpus)} GPU(s) listed but tensor_parallel_size × "
                               f"pipeline_parallel_size needs {wanted}")


def _check_foreign(m: ModelConfig, at: Loc, problem: Callable[[Loc, str], None]) -> None:
    """A command child or a remote endpoint: only the keys it reads, and what it must have."""
    allowed = _COMMAND_KEYS if m.backend == "command" else _REMOTE_KEYS
    for key in sorted(m.model_fields_set - allowed):
        problem((*at, key), f"{key} is not a setting of backend: {m.backend} (it reads "
                            f"{', '.join(sorted(allowed - {'backend'}))})")
    if m.backend == "command":
        if not m.command:
            problem((*at, "command"), "a command model needs `command`: the server's argv, "
                                      f"with {PORT_MACRO} where its port goes")
        elif not any(PORT_MACRO in arg for arg in m.command):
            problem((*at, "command"), f"{PORT_MACRO} is missing from command: corral picks "
                                      f"the port and the server must listen on it")
        if m.health is not None and m.health != "none" and not m.health.startswith("/"):
            problem((*at, "health"), f"health is a path (/health) or none, not {m.health!r}")
    else:
        url = urlsplit(m.url or "")
        if m.url is None:
            problem((*at, "url"), "a remote model needs `url`: the endpoint's base URL")
        elif url.scheme not in ("http", "https") or not url.hostname:
            problem((*at, "url"), f"url must be http(s)://host[:port][/path], not {m.url!r}")
        elif url.query or url.fragment:
            problem((*at, "url"), "url is a base URL: no query and no fragment")
        elif url.username is not None or url.password is not None:
            # Userinfo is shown wherever the URL is (/admin/models, logs), and plain relays
            # would drop it: a key belongs in `api_key:`, a secret corral never shows.
            problem((*at, "url"), "url carries credentials (user:password@): they would show "
                    "in /admin and the logs; put the key in `api_key:` (sent as "
                    "Authorization: Bearer, never shown)")


def _foreign_keys(m: ModelConfig, foreign: dict[str, str], at: Loc, own: str, other: str,
                  problem: Callable[[Loc, str], None]) -> None:
    for key in sorted(m.model_fields_set & set(foreign)):
        problem((*at, key), f"{key} is a {other} setting but this model's backend is {own}; "
                            f"{foreign[key]}")


def _refuse_flags(m: ModelConfig, at: Loc, table: dict[str, str], message: str,
                  problem: Callable[[Loc, str], None]) -> None:
    """Every `args` entry whose flag (`--flag` or `--flag=value`) is in `table`."""
    for i, arg in enumerate(m.args):
        flag = arg.split("=", 1)[0]
        if flag in table:
            problem((*at, "args", i), message.format(flag=flag, why=table[flag]))


def _check_llama(m: ModelConfig, binary: str | None, at: Loc,
                 problem: Callable[[Loc, str], None]) -> None:
    _foreign_keys(m, _VLLM_ONLY, at, "llama-server", "vllm", problem)
    _refuse_flags(m, at, _REMOVED_LLAMA_FLAGS, "llama-server no longer has {flag}; use {why}",
                  problem)
    for key in ("cache_type_k", "cache_type_v"):
        value = getattr(m, key)
        found = kv_type_problem(value, binary) if value is not None else None
        if found:
            problem((*at, key), found)
    if m.kv_cache:
        for i, step in enumerate(m.kv_cache.ladder):
            for kv_type in dict.fromkeys(ladder_step(step)):
                found = kv_type_problem(kv_type, binary)
                if found:
                    problem((*at, "kv_cache", "ladder", i), found)


def _check_vllm(m: ModelConfig, spec: ModelSpec, at: Loc,
                problem: Callable[[Loc, str], None]) -> None:
    _foreign_keys(m, _LLAMA_ONLY, at, "vllm", "llama-server", problem)
    _refuse_flags(m, at, _OWNED_VLLM_FLAGS, "{flag} is not allowed in args: {why}", problem)
    wanted: list[tuple[str, Loc]] = []
    if m.kv_cache_dtype is not None:
        wanted.append((m.kv_cache_dtype, (*at, "kv_cache_dtype")))
    if m.kv_cache:
        for i, step in enumerate(m.kv_cache.ladder):
            k, v = ladder_step(step)
            if k != v:
                problem((*at, "kv_cache", "ladder", i),
                        f"ladder step {step!r}: vLLM has one KV cache dtype for K and V")
            else:
                wanted.append((k, (*at, "kv_cache", "ladder", i)))
    if not wanted:
        return
    try:
        command = vllm_command(spec)
    except BinaryNotFound:
        command = None  # reported when it starts, as for a missing llama-server
    for kv_type, loc in wanted:
        found = vllm_kv_type_problem(kv_type, command)
        if found:
            problem(loc, found)


def _check_rpc(config: Config, m: ModelConfig, at: Loc,
               problem: Callable[[Loc, str], None]) -> None:
    assert m.rpc is not None
    if m.backend != "llama-server":
        problem((*at, "rpc"), "rpc splits a GGUF model over llama.cpp's rpc-servers; vLLM "
                              "spreads a model with tensor_parallel_size / "
                              "pipeline_parallel_size and distributed_executor_backend: ray")
    for i, worker in enumerate(m.rpc.workers):
        if worker != "local" and worker not in config.peers:
            problem((*at, "rpc", "workers", i),
                    f"unknown worker {worker!r}: `local` or a peer "
                    f"({', '.join(sorted(config.peers)) or 'no peers configured'})")
    if isinstance(m.rpc.split, list) and len(m.rpc.split) != len(m.rpc.workers):
        problem((*at, "rpc", "split"), f"{len(m.rpc.split)} weights for "
                                       f"{len(m.rpc.workers)} workers")
    if not isinstance(m.replicas, int) or m.replicas != 1:
        problem((*at, "replicas"), "a model split over RPC workers runs one head")
    _refuse_flags(m, at, _OWNED_RPC_FLAGS, "{flag} is not allowed in args: {why}", problem)
